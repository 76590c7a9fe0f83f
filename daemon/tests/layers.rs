//! The daemon's layers (see `src/lib.rs` and `docs/architecture.md`): a module may use only
//! itself and the layers below it. This reads every source file and checks each `crate::…`
//! path against the order, so an import from a higher layer (the start of a cycle) fails here.

use std::path::{Path, PathBuf};

/// Bottom first. Modules on one line share a rank and must not use each other.
const LAYERS: &[&[&str]] = &[
    &["util", "control", "error_chain"],
    &["virtio_blk"],
    &["guest_mem"],
    &["engine"],
    &["drive"],
    &["queue"],
    &["vhost"],
    &["supervisor"],
    &["qmp_proxy"],
    &["run", "serve"],
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every top-level module named by a `crate::` path in `text`, including grouped imports
/// (`use crate::{a::X, b}`).
fn crate_refs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
        rest = after;
    }
    out
}

#[test]
fn no_module_uses_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut violations = Vec::new();
    let mut checked = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel.iter().next().unwrap().to_str().unwrap();
        let module = first.trim_end_matches(".rs");
        if module == "lib" || module == "main" {
            continue;
        }
        let own = rank(module).unwrap_or_else(|| {
            panic!(
                "{}: module {module} is not in the layer table",
                rel.display()
            )
        });
        let text = std::fs::read_to_string(f).unwrap();
        for r in crate_refs(&text) {
            checked += 1;
            let theirs = rank(&r).unwrap_or_else(|| {
                panic!("{}: crate::{r} is not in the layer table", rel.display())
            });
            if r != module && theirs >= own {
                violations.push(format!("{} uses crate::{r}", rel.display()));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} crate paths found: the scan is broken"
    );
    assert!(
        violations.is_empty(),
        "imports from the same or a higher layer:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_scan_sees_grouped_and_inline_paths() {
    let refs = crate_refs("use crate::{drive::Drive, util};\nlet x = crate::engine::HeldEngine;");
    assert_eq!(refs, ["drive", "util", "engine"]);
}
