//! libvirt domain XML: what the hook needs of it, and `accelctl libvirt convert` (the domain
//! with accel's emulator wrapper and shared memfd memory; nothing else changes).

use quick_xml::events::{BytesEnd, BytesStart, BytesText, Event};
use quick_xml::{Reader, Writer};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum XmlError {
    #[error("the domain XML is not well-formed: {0}")]
    Parse(String),
    #[error("the XML's root is <{0}>, not <domain>")]
    NotDomain(String),
    #[error("the domain has no <devices>")]
    NoDevices,
}

/// What the hook reads of a domain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DomainFacts {
    pub name: String,
    pub uuid: Option<String>,
    pub emulator: Option<String>,
    /// The text of the domain's `<seclabel model='dac'><label>` (`+UID:+GID`, or names):
    /// who QEMU runs as. libvirt puts it in the XML of the `start` hook and later ones.
    pub dac_label: Option<String>,
    /// Every image a disk names (`<source file=…>` or `dev=…`, backing chain included).
    pub images: Vec<ImageFact>,
}

/// One image of the domain's disks, as its XML describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageFact {
    pub path: String,
    /// A backing file, or the image of a disk with `<readonly/>`: QEMU only reads it.
    pub read_only: bool,
    /// `<driver type=…>` of the disk, `<format type=…>` of a backing store.
    pub format: Option<String>,
}

/// What one `<disk>` said so far.
#[derive(Default)]
struct DiskAcc {
    readonly: bool,
    top: Option<String>,
    top_format: Option<String>,
    /// Per `<backingStore>` depth: its source and format.
    backing: std::collections::BTreeMap<usize, (Option<String>, Option<String>)>,
}

impl DiskAcc {
    fn finish(self, f: &mut DomainFacts) {
        let mut add = |path: Option<String>, read_only: bool, format: Option<String>| {
            let Some(path) = path else { return };
            match f.images.iter_mut().find(|i| i.path == path) {
                Some(i) => {
                    i.read_only |= read_only;
                    if i.format.is_none() {
                        i.format = format;
                    }
                }
                None => f.images.push(ImageFact {
                    path,
                    read_only,
                    format,
                }),
            }
        };
        add(self.top, self.readonly, self.top_format);
        for (_, (path, format)) in self.backing {
            add(path, true, format);
        }
    }
}

fn parse_err(e: impl std::fmt::Display) -> XmlError {
    XmlError::Parse(e.to_string())
}

fn name_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn attr(e: &BytesStart<'_>, key: &str) -> Option<String> {
    e.attributes()
        .flatten()
        .find(|a| a.key.as_ref() == key.as_bytes())
        .and_then(|a| a.unescape_value().ok().map(|v| v.into_owned()))
}

/// What an element inside a `<disk>` says of its images: a `<source>` (the disk's own or a
/// `<backingStore>`'s), `<readonly/>`, the disk's `<driver type>`, a backing store's
/// `<format type>`.
fn disk_element(path: &[String], e: &BytesStart<'_>, disk: &mut Option<DiskAcc>) {
    let Some(d) = disk.as_mut() else { return };
    if path.len() < 3 || path[1] != "devices" || path[2] != "disk" {
        return;
    }
    let depth = path[3..].iter().filter(|p| *p == "backingStore").count();
    let direct_child = path.len() == 3;
    let in_backing = path.last().is_some_and(|p| p == "backingStore");
    match e.name().as_ref() {
        b"source" => {
            let v = attr(e, "file").or_else(|| attr(e, "dev"));
            if direct_child {
                if v.is_some() {
                    d.top = v;
                }
            } else if in_backing {
                d.backing.entry(depth).or_default().0 = v;
            }
        }
        b"readonly" if direct_child => d.readonly = true,
        b"driver" if direct_child => d.top_format = attr(e, "type"),
        b"format" if in_backing => d.backing.entry(depth).or_default().1 = attr(e, "type"),
        _ => {}
    }
}

/// The domain's name, UUID, emulator, DAC label and disk images.
pub fn facts(xml: &str) -> Result<DomainFacts, XmlError> {
    let mut r = Reader::from_str(xml);
    let mut path: Vec<String> = Vec::new();
    let mut f = DomainFacts::default();
    // Inside the domain's `<seclabel model='dac'>`.
    let mut dac = false;
    // Inside a `<disk>`.
    let mut disk: Option<DiskAcc> = None;
    loop {
        match r.read_event().map_err(parse_err)? {
            Event::Start(e) => {
                let n = name_of(e.name().as_ref());
                if path.is_empty() && n != "domain" {
                    return Err(XmlError::NotDomain(n));
                }
                if path.len() == 1 && n == "seclabel" {
                    dac = attr(&e, "model").as_deref() == Some("dac");
                }
                if path.len() == 2 && path[1] == "devices" && n == "disk" {
                    disk = Some(DiskAcc::default());
                }
                disk_element(&path, &e, &mut disk);
                path.push(n);
            }
            // A `<disk/>` without children names no image (and is outside any disk).
            Event::Empty(e) => disk_element(&path, &e, &mut disk),
            Event::End(_) => {
                if path.len() == 3 && path[2] == "disk" {
                    if let Some(d) = disk.take() {
                        d.finish(&mut f);
                    }
                }
                path.pop();
            }
            Event::Text(t) => {
                let text = t.unescape().map_err(parse_err)?.trim().to_string();
                match path
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .as_slice()
                {
                    ["domain", "name"] => f.name = text,
                    ["domain", "uuid"] => f.uuid = Some(text),
                    ["domain", "devices", "emulator"] => f.emulator = Some(text),
                    ["domain", "seclabel", "label"] if dac => f.dac_label = Some(text),
                    _ => {}
                }
            }
            Event::Eof if !path.is_empty() => {
                return Err(XmlError::Parse(format!(
                    "<{}> is not closed",
                    path.join("/")
                )))
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if f.name.is_empty() {
        return Err(XmlError::Parse("the domain has no <name>".into()));
    }
    Ok(f)
}

/// Whether a domain runs under accel's emulator wrapper.
pub fn uses_wrapper(f: &DomainFacts) -> bool {
    f.emulator
        .as_deref()
        .is_some_and(|e| e.rsplit('/').next() == Some("accel-qemu"))
}

/// The converted domain and one line per change.
pub fn convert(xml: &str, emulator: &str) -> Result<(String, Vec<String>), XmlError> {
    let mut r = Reader::from_str(xml);
    let mut w = Writer::new(Vec::new());
    let mut path: Vec<String> = Vec::new();
    let mut changes = Vec::new();
    // A <memoryBacking> anywhere among the domain's children is rewritten where it is;
    // without one, one goes before <devices>.
    let mut saw_memory_backing = has_child(xml, "memoryBacking")?;
    let mut saw_emulator = false;
    let mut saw_devices = false;
    let write = |w: &mut Writer<Vec<u8>>, e: Event<'_>| w.write_event(e).map_err(parse_err);
    loop {
        let ev = r.read_event().map_err(parse_err)?;
        match ev {
            Event::Start(e) => {
                let n = name_of(e.name().as_ref());
                if path.is_empty() && n != "domain" {
                    return Err(XmlError::NotDomain(n));
                }
                let at = |p: &[String], want: &[&str]| {
                    p.iter().map(String::as_str).eq(want.iter().copied())
                };
                if at(&path, &["domain"]) && n == "devices" {
                    saw_devices = true;
                    if !saw_memory_backing {
                        memory_backing(&mut w, &[], &mut changes)?;
                        saw_memory_backing = true;
                    }
                }
                if at(&path, &["domain"]) && n == "memoryBacking" {
                    // Its children decide; rewrite the whole element.
                    let inner = read_children(&mut r)?;
                    memory_backing(&mut w, &inner, &mut changes)?;
                    saw_memory_backing = true;
                    continue;
                }
                if at(&path, &["domain", "devices"]) && n == "emulator" {
                    let old = read_text(&mut r)?;
                    saw_emulator = true;
                    write_emulator(&mut w, emulator)?;
                    if old.trim() != emulator {
                        changes.push(format!(
                            "<emulator>: {} -> {emulator} (accel's wrapper runs QEMU)",
                            old.trim()
                        ));
                    }
                    continue;
                }
                write(&mut w, Event::Start(e))?;
                path.push(n);
            }
            Event::Empty(e) => {
                let n = name_of(e.name().as_ref());
                let at_domain = path.iter().map(String::as_str).eq(["domain"]);
                if at_domain && n == "memoryBacking" {
                    memory_backing(&mut w, &[], &mut changes)?;
                    saw_memory_backing = true;
                    continue;
                }
                if path.iter().map(String::as_str).eq(["domain", "devices"]) && n == "emulator" {
                    saw_emulator = true;
                    write_emulator(&mut w, emulator)?;
                    changes.push(format!(
                        "<emulator>: empty -> {emulator} (accel's wrapper runs QEMU)"
                    ));
                    continue;
                }
                write(&mut w, Event::Empty(e))?;
            }
            Event::End(e) => {
                if path.iter().map(String::as_str).eq(["domain", "devices"]) && !saw_emulator {
                    write_emulator(&mut w, emulator)?;
                    saw_emulator = true;
                    changes.push(format!(
                        "<emulator>: added, {emulator} (accel's wrapper runs QEMU)"
                    ));
                }
                path.pop();
                write(&mut w, Event::End(e))?;
            }
            Event::Eof if !path.is_empty() => {
                return Err(XmlError::Parse(format!(
                    "<{}> is not closed",
                    path.join("/")
                )))
            }
            Event::Eof => break,
            other => write(&mut w, other)?,
        }
    }
    if !saw_devices {
        return Err(XmlError::NoDevices);
    }
    let out = String::from_utf8(w.into_inner()).map_err(parse_err)?;
    Ok((out, changes))
}

/// Whether the domain element has a direct child named `name`.
fn has_child(xml: &str, name: &str) -> Result<bool, XmlError> {
    let mut r = Reader::from_str(xml);
    let mut depth = 0usize;
    loop {
        match r.read_event().map_err(parse_err)? {
            Event::Start(e) => {
                if depth == 1 && e.name().as_ref() == name.as_bytes() {
                    return Ok(true);
                }
                depth += 1;
            }
            Event::Empty(e) if depth == 1 && e.name().as_ref() == name.as_bytes() => {
                return Ok(true)
            }
            Event::End(_) => depth = depth.saturating_sub(1),
            Event::Eof => return Ok(false),
            _ => {}
        }
    }
}

fn write_emulator(w: &mut Writer<Vec<u8>>, emulator: &str) -> Result<(), XmlError> {
    w.write_event(Event::Start(BytesStart::new("emulator")))
        .and_then(|()| w.write_event(Event::Text(BytesText::new(emulator))))
        .and_then(|()| w.write_event(Event::End(BytesEnd::new("emulator"))))
        .map_err(parse_err)
}

/// The events inside an element just opened, up to its end (which is consumed).
fn read_children(r: &mut Reader<&[u8]>) -> Result<Vec<Event<'static>>, XmlError> {
    let mut depth = 0usize;
    let mut out = Vec::new();
    loop {
        let ev = r.read_event().map_err(parse_err)?.into_owned();
        match &ev {
            Event::Start(_) => depth += 1,
            Event::End(_) if depth == 0 => return Ok(out),
            Event::End(_) => depth -= 1,
            Event::Eof => return Err(XmlError::Parse("unexpected end of the XML".into())),
            _ => {}
        }
        out.push(ev);
    }
}

fn read_text(r: &mut Reader<&[u8]>) -> Result<String, XmlError> {
    let mut s = String::new();
    for ev in read_children(r)? {
        if let Event::Text(t) = ev {
            s += &t.unescape().map_err(parse_err)?;
        }
    }
    Ok(s)
}

/// `<memoryBacking>` with shared memory: `<source type='memfd'/>` (unless hugepages decide
/// the backend) and `<access mode='shared'/>`; every other child stays.
fn memory_backing(
    w: &mut Writer<Vec<u8>>,
    inner: &[Event<'static>],
    changes: &mut Vec<String>,
) -> Result<(), XmlError> {
    let top_name = |e: &BytesStart<'_>| name_of(e.name().as_ref());
    // Top-level children: (name, events).
    let mut children: Vec<(String, Vec<Event<'static>>)> = Vec::new();
    let mut depth = 0usize;
    for ev in inner {
        match ev {
            Event::Start(e) => {
                if depth == 0 {
                    children.push((top_name(e), Vec::new()));
                }
                depth += 1;
            }
            Event::Empty(e) if depth == 0 => children.push((top_name(e), Vec::new())),
            Event::End(_) => depth -= 1,
            _ if depth == 0 => {
                // Whitespace between children.
                continue;
            }
            _ => {}
        }
        if let Some(c) = children.last_mut() {
            c.1.push(ev.clone());
        }
    }
    let attr = |evs: &[Event<'_>], key: &str| -> Option<String> {
        match evs.first() {
            Some(Event::Start(e) | Event::Empty(e)) => e
                .try_get_attribute(key)
                .ok()
                .flatten()
                .and_then(|a| a.unescape_value().ok().map(|v| v.into_owned())),
            _ => None,
        }
    };
    let hugepages = children.iter().any(|(n, _)| n == "hugepages");
    let source = children
        .iter()
        .find(|(n, _)| n == "source")
        .map(|(_, e)| attr(e, "type"));
    let access = children
        .iter()
        .find(|(n, _)| n == "access")
        .map(|(_, e)| attr(e, "mode"));
    w.write_event(Event::Start(BytesStart::new("memoryBacking")))
        .map_err(parse_err)?;
    for (n, evs) in &children {
        if n == "access" || (n == "source" && !hugepages) {
            continue;
        }
        for ev in evs {
            w.write_event(ev.clone()).map_err(parse_err)?;
        }
    }
    if !hugepages {
        w.write_event(Event::Empty(
            BytesStart::new("source").with_attributes([("type", "memfd")]),
        ))
        .map_err(parse_err)?;
        if source.flatten().as_deref() != Some("memfd") {
            changes.push(
                "<memoryBacking>: <source type='memfd'/> (guest memory a vhost-user backend can map)"
                    .into(),
            );
        }
    }
    w.write_event(Event::Empty(
        BytesStart::new("access").with_attributes([("mode", "shared")]),
    ))
    .map_err(parse_err)?;
    if access.flatten().as_deref() != Some("shared") {
        changes.push(
            "<memoryBacking>: <access mode='shared'/> (vhost-user needs shared guest memory)"
                .into(),
        );
    }
    w.write_event(Event::End(BytesEnd::new("memoryBacking")))
        .map_err(parse_err)
}
