//! The layers of both daemon crates (see each crate's `src/lib.rs` and
//! `docs/architecture.md`), checked on their source text:
//!
//! 1. **Layer order.** A top-level module may use only itself and the layers below it. In
//!    `accel_dataplane`: util, virtio_blk, guest_mem and vu_frontend, engine, drive, queue, vhost; in `acceld`:
//!    supervisor, qmp_proxy, run/serve, with the whole of `accel_dataplane` below them (Cargo
//!    keeps the data plane from naming `acceld` at all).
//! 2. **No circles between the files of one top-level module** (`supervisor/a.rs` uses
//!    `supervisor/b.rs` and `b.rs` uses `a.rs`, directly or over other files), except the ones
//!    named in [`ALLOWED_CIRCLES`], each exactly: a new circle, a file joining one, or a circle
//!    that got smaller (update the list) fails.
//!
//! Every path form counts: `crate::…`, `self::…`, `super::…` (and `super::super::…`), a bare
//! path that starts with a child module (`queue::Conn` in `nbd/mod.rs`) or with a name the
//! module imported (`SupError::Invalid` after `use super::SupError`), grouped imports
//! (`use super::{a::X, b}`), `self` in groups, `as` renames, and globs (`use super::*`: an
//! edge to the module globbed). A path that names an item through a re-export is followed to
//! the file that defines it (`super::ManagedDrive` in `supervisor/vm.rs` is
//! `supervisor/drive_state.rs`); a re-export (`pub use`) is an edge of its own file only if
//! that file names the item outside its `use` lines. Inline modules (`mod tests { use
//! super::*; }`) are part of their file. Comments and string literals are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `accel_dataplane`, bottom first. Modules on one line share a rank and must not use each other.
const DATAPLANE_LAYERS: &[&[&str]] = &[
    &["util"],
    &["virtio_blk"],
    &["guest_mem", "vu_frontend"],
    &["engine"],
    &["drive"],
    &["queue"],
    &["vhost"],
];

/// `acceld`, bottom first; `accel_dataplane` is below all of them.
const ACCELD_LAYERS: &[&[&str]] = &[&["supervisor"], &["qmp_proxy"], &["run", "serve"]];

/// The circles between files that remain, each by its crate and files (relative to `src/`).
/// Each needs a redesign rather than a moved type; the test fails when one changes, so that a
/// broken circle leaves the list and no file joins one unnoticed.
const ALLOWED_CIRCLES: &[(&str, &[&str])] = &[
    // `Supervisor` (mod.rs) has its `impl` blocks in nine files (contract.rs, outside the
    // circle, is one), which name `super::Supervisor` and `super::SupError`, while mod.rs
    // calls into persist, status, observe and permit; the executor's files (switch,
    // qemu_graph, migration) take the VM (`vm::Vm`), and vm.rs names migration's
    // `PauseOwner` and the parent's `Supervisor`. Ends with the registry / task per VM /
    // executor split (issue 26, item 3).
    (
        "acceld",
        &[
            "supervisor/drive_state.rs",
            "supervisor/migration.rs",
            "supervisor/mod.rs",
            "supervisor/observe.rs",
            "supervisor/permit.rs",
            "supervisor/persist.rs",
            "supervisor/qemu_graph.rs",
            "supervisor/registry.rs",
            "supervisor/status.rs",
            "supervisor/switch.rs",
            "supervisor/vm.rs",
        ],
    ),
];

// ---------------------------------------------------------------------------------------------
// Lexing: source text without comments and literals, as tokens.

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` with comments removed and every string, byte-string, raw-string and char literal
/// replaced by `""`, so that neither can hold a path.
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let n = c.len();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < n {
        let prev_ident = i > 0 && is_ident_char(c[i - 1]);
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r'
            && (!prev_ident || (i == 1 || !is_ident_char(c[i - 2])) && "bc".contains(c[i - 1]))
            && matches!(c.get(i + 1), Some('"') | Some('#'))
        {
            // A raw string r"…", r#"…"#, br"…" (the prefix letter is left as an identifier).
            let mut j = i + 1;
            let mut hashes = 0;
            while j < n && c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            if j < n && c[j] == '"' {
                j += 1;
                'end: while j < n {
                    if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
                        j += 1 + hashes;
                        break 'end;
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
            } else {
                out.push(c[i]);
                i += 1;
            }
        } else if c[i] == '"' {
            i += 1;
            while i < n && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' {
            // A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            if c.get(i + 1) == Some(&'\\') {
                let mut j = i + 2;
                while j < n && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("\"\"");
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("\"\"");
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Identifiers (and numbers), `::`, and every other character on its own.
fn tokens(text: &str) -> Vec<String> {
    let s = strip(text);
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if c[i].is_whitespace() {
            i += 1;
        } else if is_ident_char(c[i]) {
            let start = i;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            out.push(c[i].to_string());
            i += 1;
        }
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

// ---------------------------------------------------------------------------------------------
// Scanning: what each module declares, imports and names.

type ModPath = Vec<String>;

#[derive(Debug)]
struct Use {
    file: String,
    module: ModPath,
    path: Vec<String>,
    /// The name it binds; `None` for a glob.
    alias: Option<String>,
    public: bool,
}

#[derive(Debug)]
struct Named {
    file: String,
    module: ModPath,
    path: Vec<String>,
}

#[derive(Debug, Default)]
struct Scan {
    /// Module path -> the file it is written in (inline modules: their file).
    modules: BTreeMap<ModPath, String>,
    children: BTreeMap<ModPath, BTreeSet<String>>,
    uses: Vec<Use>,
    named: Vec<Named>,
    /// Identifiers each file names outside its `use` declarations.
    idents: BTreeMap<String, BTreeSet<String>>,
}

/// The module a file holds: `a/b.rs` and `a/b/mod.rs` are `a::b`, `lib.rs` the crate root.
fn file_module(rel: &str) -> ModPath {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if parts == ["lib"] || parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// One use tree from `toks[i]`, each leaf as (path, bound name or None for a glob).
fn use_tree(
    toks: &[String],
    mut i: usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let mut path = prefix.to_vec();
    loop {
        let t = toks[i].as_str();
        match t {
            "{" => {
                i += 1;
                while toks[i] != "}" {
                    i = use_tree(toks, i, &path, out);
                    if toks[i] == "," {
                        i += 1;
                    }
                }
                return i + 1;
            }
            "*" => {
                out.push((path, None));
                return i + 1;
            }
            "::" => i += 1,
            _ => {
                path.push(t.to_string());
                i += 1;
                if toks[i] == "::" {
                    i += 1;
                    continue;
                }
                let mut alias = t.to_string();
                if toks[i] == "as" {
                    alias = toks[i + 1].clone();
                    i += 2;
                }
                if t == "self" {
                    path.pop();
                    if alias == "self" {
                        alias = path.last().cloned().unwrap_or_default();
                    }
                }
                out.push((path, Some(alias)));
                return i;
            }
        }
    }
}

/// Whether the `use` at `toks[i]` is `pub`, `pub(crate)`, `pub(super)` or `pub(in …)`.
fn is_public(toks: &[String], i: usize) -> bool {
    if i == 0 {
        return false;
    }
    if toks[i - 1] == "pub" {
        return true;
    }
    if toks[i - 1] == ")" {
        if let Some(open) = toks[..i - 1].iter().rposition(|t| t == "(") {
            return open > 0 && toks[open - 1] == "pub";
        }
    }
    false
}

fn scan_file(scan: &mut Scan, rel: &str, text: &str) {
    let toks = tokens(text);
    let mut stack: Vec<(ModPath, usize)> = vec![(file_module(rel), 0)];
    let mut depth = 0usize;
    let mut idents = BTreeSet::new();
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        let here = stack.last().unwrap().0.clone();
        match t {
            "{" => {
                depth += 1;
                i += 1;
            }
            "}" => {
                depth -= 1;
                if stack.len() > 1 && stack.last().unwrap().1 == depth {
                    stack.pop();
                }
                i += 1;
            }
            "mod" if toks.get(i + 1).is_some_and(|n| is_ident(n)) => {
                let name = toks[i + 1].clone();
                scan.children
                    .entry(here.clone())
                    .or_default()
                    .insert(name.clone());
                if toks.get(i + 2).is_some_and(|t| t == "{") {
                    let mut inner = here;
                    inner.push(name);
                    scan.modules.insert(inner.clone(), rel.to_string());
                    stack.push((inner, depth));
                    depth += 1;
                    i += 3;
                } else {
                    i += 2;
                }
            }
            "use" => {
                let public = is_public(&toks, i);
                let mut leaves = Vec::new();
                i = use_tree(&toks, i + 1, &[], &mut leaves);
                for (path, alias) in leaves {
                    scan.uses.push(Use {
                        file: rel.to_string(),
                        module: here.clone(),
                        path,
                        alias,
                        public,
                    });
                }
            }
            _ if is_ident(t) => {
                idents.insert(t.to_string());
                if toks.get(i + 1).is_some_and(|n| n == "::") && (i == 0 || toks[i - 1] != "::") {
                    let mut path = vec![t.to_string()];
                    let mut j = i + 1;
                    while j + 1 < toks.len() && toks[j] == "::" && is_ident(&toks[j + 1]) {
                        path.push(toks[j + 1].clone());
                        idents.insert(toks[j + 1].clone());
                        j += 2;
                    }
                    scan.named.push(Named {
                        file: rel.to_string(),
                        module: here,
                        path,
                    });
                    i = j;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    scan.idents.insert(rel.to_string(), idents);
}

/// Every file of a crate, by path relative to `src/` (`main.rs`, a crate of its own, left out).
fn scan_crate(files: &BTreeMap<String, String>) -> Scan {
    let mut scan = Scan::default();
    for rel in files.keys() {
        if rel != "main.rs" {
            scan.modules.insert(file_module(rel), rel.clone());
        }
    }
    for (rel, text) in files {
        if rel != "main.rs" {
            scan_file(&mut scan, rel, text);
        }
    }
    scan
}

fn read_crate(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    walk(src, &mut paths);
    paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(src).unwrap().to_str().unwrap().to_string();
            (rel, std::fs::read_to_string(p).unwrap())
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Resolution: the file each path names.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// A module of this crate (the file is `Scan::modules[..]`).
    Module(ModPath),
    /// Another crate, or a name the scan does not track (a local item, a prelude name).
    Outside,
}

struct Resolver<'a> {
    scan: &'a Scan,
    /// (module, bound name) -> (the module the `use` is in, its path).
    aliases: BTreeMap<(ModPath, String), (ModPath, Vec<String>)>,
}

impl<'a> Resolver<'a> {
    fn new(scan: &'a Scan) -> Self {
        let mut aliases = BTreeMap::new();
        for u in &scan.uses {
            if let Some(a) = &u.alias {
                aliases.insert(
                    (u.module.clone(), a.clone()),
                    (u.module.clone(), u.path.clone()),
                );
            }
        }
        Resolver { scan, aliases }
    }

    /// `path`, written in module `m`, as a path from the crate root; `None` when it does not
    /// start in this crate.
    fn absolute(&self, m: &[String], path: &[String], hops: usize) -> Option<Vec<String>> {
        let head = path.first()?.as_str();
        let mut m = m.to_vec();
        let rest = match head {
            "crate" => {
                m.clear();
                &path[1..]
            }
            "self" => &path[1..],
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                for _ in 0..ups {
                    m.pop()?;
                }
                &path[ups..]
            }
            _ if self.scan.children.get(&m).is_some_and(|c| c.contains(head)) => path,
            _ => {
                let (am, ap) = self.aliases.get(&(m.clone(), head.to_string()))?;
                if hops > 8 {
                    return None;
                }
                let mut abs = self.absolute(am, ap, hops + 1)?;
                abs.extend_from_slice(&path[1..]);
                return Some(abs);
            }
        };
        m.extend_from_slice(rest);
        Some(m)
    }

    /// The module an absolute path ends in, following re-exports and imports to the module
    /// that defines the item.
    fn target(&self, abs: &[String], hops: usize) -> Target {
        let mut m: ModPath = Vec::new();
        for (k, seg) in abs.iter().enumerate() {
            let mut deeper = m.clone();
            deeper.push(seg.clone());
            if self.scan.modules.contains_key(&deeper) {
                m = deeper;
                continue;
            }
            if let Some((am, ap)) = self.aliases.get(&(m.clone(), seg.clone())) {
                if hops > 8 {
                    break;
                }
                return match self.absolute(am, ap, hops + 1) {
                    Some(mut next) => {
                        next.extend_from_slice(&abs[k + 1..]);
                        self.target(&next, hops + 1)
                    }
                    None => Target::Outside,
                };
            }
            break;
        }
        Target::Module(m)
    }

    fn resolve(&self, m: &[String], path: &[String]) -> Target {
        match self.absolute(m, path, 0) {
            Some(abs) => self.target(&abs, 0),
            None => Target::Outside,
        }
    }
}

/// One dependency: `from` (a file) names `what`, which lives in `to` (a module).
#[derive(Debug)]
struct Edge {
    from: String,
    to: ModPath,
    what: String,
}

fn edges(scan: &Scan) -> Vec<Edge> {
    let r = Resolver::new(scan);
    let mut out = Vec::new();
    for u in &scan.uses {
        if u.public {
            // A re-export is a dependency of its own file only if the file names the item.
            let used_here = u
                .alias
                .as_ref()
                .is_some_and(|a| scan.idents[&u.file].contains(a));
            if !used_here {
                continue;
            }
        }
        if let Target::Module(to) = r.resolve(&u.module, &u.path) {
            let glob = if u.alias.is_none() { "::*" } else { "" };
            out.push(Edge {
                from: u.file.clone(),
                to,
                what: format!("use {}{glob}", u.path.join("::")),
            });
        }
    }
    for n in &scan.named {
        if let Target::Module(to) = r.resolve(&n.module, &n.path) {
            out.push(Edge {
                from: n.file.clone(),
                to,
                what: n.path.join("::"),
            });
        }
    }
    out
}

fn top(rel: &str) -> &str {
    rel.split('/').next().unwrap().trim_end_matches(".rs")
}

// ---------------------------------------------------------------------------------------------
// The checks.

fn rank(layers: &[&[&str]], module: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&module))
}

/// Every path from a module into the same or a higher layer, as "file uses path (module)".
fn layer_violations(files: &BTreeMap<String, String>, layers: &[&[&str]]) -> Vec<String> {
    let scan = scan_crate(files);
    let mut out = Vec::new();
    for e in edges(&scan) {
        if e.to.is_empty() || file_module(&e.from).is_empty() {
            continue; // the crate root (lib.rs) declares the modules and re-exports
        }
        let (from, to) = (top(&e.from), e.to[0].as_str());
        let own = rank(layers, from)
            .unwrap_or_else(|| panic!("{}: module {from} is not in the layer table", e.from));
        let theirs = rank(layers, to).unwrap_or_else(|| {
            panic!(
                "{}: {}: module {to} is not in the layer table",
                e.from, e.what
            )
        });
        if from != to && theirs >= own {
            out.push(format!("{} uses {} (module {to})", e.from, e.what));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The circles between files inside one top-level module: each strongly connected set of
/// more than one file, sorted, with the edges that make it.
fn circles(files: &BTreeMap<String, String>) -> Vec<(Vec<String>, Vec<String>)> {
    let scan = scan_crate(files);
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for e in edges(&scan) {
        let to = scan.modules[&e.to].clone();
        if to != e.from && !file_module(&e.from).is_empty() && top(&to) == top(&e.from) {
            graph.entry(e.from).or_default().entry(to).or_insert(e.what);
        }
    }
    let nodes: BTreeSet<String> = graph
        .iter()
        .flat_map(|(f, ts)| std::iter::once(f.clone()).chain(ts.keys().cloned()))
        .collect();
    // Which files each file reaches; a circle is a set that all reach each other.
    let reach = |start: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![start.clone()];
        while let Some(f) = todo.pop() {
            for t in graph.get(&f).into_iter().flat_map(|ts| ts.keys()) {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in &nodes {
        if done.contains(n) || !reached[n].contains(n) {
            continue;
        }
        let set: Vec<String> = nodes
            .iter()
            .filter(|m| reached[n].contains(*m) && reached[*m].contains(n))
            .cloned()
            .collect();
        let mut why = Vec::new();
        for f in &set {
            for (t, what) in graph.get(f).into_iter().flatten() {
                if set.contains(t) {
                    why.push(format!("{f} -> {t}: {what}"));
                }
            }
        }
        done.extend(set.iter().cloned());
        out.push((set, why));
    }
    out
}

/// The circles of `krate` not exactly in [`ALLOWED_CIRCLES`], and the allowed ones not found.
fn circle_failures(
    krate: &str,
    files: &BTreeMap<String, String>,
    allowed: &[(&str, &[&str])],
) -> Vec<String> {
    let found = circles(files);
    let allowed: Vec<Vec<String>> = allowed
        .iter()
        .filter(|(k, _)| *k == krate)
        .map(|(_, fs)| {
            let mut v: Vec<String> = fs.iter().map(|f| f.to_string()).collect();
            v.sort();
            v
        })
        .collect();
    let mut out = Vec::new();
    for (set, why) in &found {
        if !allowed.contains(set) {
            out.push(format!(
                "{krate}: a circle between {}:\n  {}",
                set.join(", "),
                why.join("\n  ")
            ));
        }
    }
    for a in &allowed {
        if !found.iter().any(|(set, _)| set == a) {
            out.push(format!(
                "{krate}: the allowed circle {} is not there as listed (broken or changed: update ALLOWED_CIRCLES)",
                a.join(", ")
            ));
        }
    }
    out
}

struct Crate {
    name: &'static str,
    src: PathBuf,
    layers: &'static [&'static [&'static str]],
}

fn crates() -> [Crate; 2] {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    [
        Crate {
            name: "accel_dataplane",
            src: here.join("../dataplane/src"),
            layers: DATAPLANE_LAYERS,
        },
        Crate {
            name: "acceld",
            src: here.join("src"),
            layers: ACCELD_LAYERS,
        },
    ]
}

#[test]
fn no_module_uses_a_layer_above_it() {
    let mut violations = Vec::new();
    for c in crates() {
        let files = read_crate(&c.src);
        assert!(
            files.len() > 10,
            "{}: only {} files found in {}",
            c.name,
            files.len(),
            c.src.display()
        );
        let scan = scan_crate(&files);
        let n = edges(&scan).len();
        assert!(
            n > 100,
            "{}: only {n} paths into the crate found: the scan is broken",
            c.name
        );
        for m in scan.children[&Vec::new()].iter() {
            assert!(
                rank(c.layers, m).is_some(),
                "{}: module {m} is not in the layer table",
                c.name
            );
        }
        for v in layer_violations(&files, c.layers) {
            violations.push(format!("{}: {v}", c.name));
        }
    }
    assert!(
        violations.is_empty(),
        "imports from the same or a higher layer:\n{}",
        violations.join("\n")
    );
}

#[test]
fn no_new_circle_between_the_files_of_a_module() {
    let mut failures = Vec::new();
    for c in crates() {
        failures.extend(circle_failures(
            c.name,
            &read_crate(&c.src),
            ALLOWED_CIRCLES,
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// The scanner itself, on small made-up crates.

fn fake(files: &[(&str, &str)]) -> BTreeMap<String, String> {
    files
        .iter()
        .map(|(p, t)| (p.to_string(), t.to_string()))
        .collect()
}

fn edge_list(files: &BTreeMap<String, String>) -> Vec<String> {
    let scan = scan_crate(files);
    let mut v: Vec<String> = edges(&scan)
        .iter()
        .map(|e| format!("{} -> {}", e.from, scan.modules[&e.to]))
        .filter(|s| !s.starts_with("lib.rs"))
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn the_scan_sees_every_path_form() {
    let files = fake(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c; pub use a::Top as Alias;"),
        ("a.rs", "pub struct Top;"),
        // grouped, nested, self in a group, inline paths, a re-export through lib.rs
        ("b/mod.rs", "mod x; mod y; use crate::{a::{self}, c::C}; fn f() { let _ = crate::Alias; let _ = y::Y; }"),
        // super, and super::super; a string and a comment that must not count
        ("b/x.rs", "use super::super::c; // crate::a::Top\nfn f() { let _ = \"crate::a\"; super::helper(); }"),
        // a glob; self::
        ("b/y.rs", "use super::*; pub struct Y; fn f() { self::g(); } fn g() {}"),
        // `mod tests { use super::*; }` is this file, not its parent
        ("c.rs", "pub struct C; #[cfg(test)] mod tests { use super::*; fn t() { let _ = C; } }"),
    ]);
    assert_eq!(
        edge_list(&files),
        [
            "b/mod.rs -> a.rs",
            "b/mod.rs -> b/y.rs",
            "b/mod.rs -> c.rs",
            "b/x.rs -> b/mod.rs",
            "b/x.rs -> c.rs",
            "b/y.rs -> b/mod.rs",
            "b/y.rs -> b/y.rs",
            "c.rs -> c.rs",
        ]
    );
}

#[test]
fn a_path_through_a_re_export_names_the_defining_file() {
    let files = fake(&[
        ("lib.rs", "pub mod s;"),
        // mod.rs re-exports T and does not use it: no edge of its own
        (
            "s/mod.rs",
            "mod d; mod v; pub use d::T; use v::V; pub struct Sup(V);",
        ),
        ("s/d.rs", "pub struct T;"),
        // super::T is d.rs, through mod.rs's re-export
        ("s/v.rs", "use super::T; pub struct V(T);"),
    ]);
    assert_eq!(
        edge_list(&files),
        ["s/mod.rs -> s/v.rs", "s/v.rs -> s/d.rs"]
    );
    assert!(circles(&files).is_empty());
}

#[test]
fn the_layer_check_catches_every_path_form() {
    let layers: &[&[&str]] = &[&["low"], &["high"]];
    let crate_of = |root: &str, low: &str, deep: &str| {
        fake(&[
            ("lib.rs", root),
            ("low/mod.rs", low),
            ("low/deep.rs", deep),
            ("high.rs", "pub struct H; pub fn f() {}"),
        ])
    };
    let root = "pub mod low; pub mod high;";
    let ok = crate_of(root, "mod deep; pub struct L;", "use super::L;");
    assert!(layer_violations(&ok, layers).is_empty());
    for (file, bad) in [
        (
            "low/mod.rs",
            crate_of(root, "mod deep; use crate::high::H;", ""),
        ),
        (
            "low/mod.rs",
            crate_of(root, "mod deep; fn g() { crate::high::f() }", ""),
        ),
        (
            "low/mod.rs",
            crate_of(root, "mod deep; use super::high::H;", ""),
        ),
        (
            "low/mod.rs",
            crate_of(root, "mod deep; use crate::{high::{self}};", ""),
        ),
        (
            "low/mod.rs",
            crate_of(root, "mod deep; pub use crate::high::H; fn g(_: H) {}", ""),
        ),
        (
            "low/deep.rs",
            crate_of(root, "mod deep;", "use super::super::high::H;"),
        ),
        (
            "low/deep.rs",
            crate_of(root, "mod deep;", "fn g() { super::super::high::f() }"),
        ),
        (
            "low/deep.rs",
            crate_of(
                root,
                "mod deep; use crate::high as up;",
                "fn g() { super::up::f() }",
            ),
        ),
        (
            "low/deep.rs",
            crate_of(
                "pub mod low; pub mod high; pub use high::H;",
                "mod deep;",
                "use crate::H;",
            ),
        ),
    ] {
        let v = layer_violations(&bad, layers);
        assert!(
            v.iter().any(|l| l.starts_with(file)),
            "{file}: {bad:?}: {v:?}"
        );
    }
}

#[test]
fn a_circle_between_files_is_found_and_must_be_listed() {
    let files = fake(&[
        ("lib.rs", "pub mod s;"),
        ("s/mod.rs", "mod a; mod b; mod c;"),
        ("s/a.rs", "use super::b::B; pub struct A;"),
        ("s/b.rs", "pub struct B; fn f() { let _ = super::c::C; }"),
        ("s/c.rs", "pub struct C(super::a::A);"),
    ]);
    let found = circles(&files);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, ["s/a.rs", "s/b.rs", "s/c.rs"]);
    assert_eq!(circle_failures("k", &files, &[]).len(), 1);
    assert!(circle_failures("k", &files, &[("k", &["s/c.rs", "s/b.rs", "s/a.rs"])]).is_empty());
    // a listed circle that is gone fails too
    assert_eq!(
        circle_failures("k", &files, &[("k", &["s/a.rs", "s/b.rs"])]).len(),
        2
    );
}
