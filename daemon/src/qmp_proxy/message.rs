//! What a QMP client sends, checked the way QEMU 10 checks it (same error texts, measured
//! against QEMU 10.0.2): framing of the JSON stream, the request object's members, and the
//! capabilities negotiation's arguments. Pure: no I/O.

use serde_json::{Map, Value};

/// QEMU's error classes (`QapiErrorClass`, qapi/error.json in QEMU 10), and any other a QEMU
/// sends (passed on as it is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    GenericError,
    CommandNotFound,
    DeviceNotActive,
    DeviceNotFound,
    KvmMissingCap,
    Other(String),
}

impl ErrorClass {
    pub fn parse(s: &str) -> ErrorClass {
        match s {
            "GenericError" => ErrorClass::GenericError,
            "CommandNotFound" => ErrorClass::CommandNotFound,
            "DeviceNotActive" => ErrorClass::DeviceNotActive,
            "DeviceNotFound" => ErrorClass::DeviceNotFound,
            "KVMMissingCap" => ErrorClass::KvmMissingCap,
            o => ErrorClass::Other(o.to_string()),
        }
    }

    /// The class as QMP spells it.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorClass::GenericError => "GenericError",
            ErrorClass::CommandNotFound => "CommandNotFound",
            ErrorClass::DeviceNotActive => "DeviceNotActive",
            ErrorClass::DeviceNotFound => "DeviceNotFound",
            ErrorClass::KvmMissingCap => "KVMMissingCap",
            ErrorClass::Other(s) => s,
        }
    }
}

/// An error reply: QEMU's own (class and text as it sent them), or the proxy's, made as QEMU
/// would make it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {desc}", class.as_str())]
pub struct QmpError {
    pub class: ErrorClass,
    pub desc: String,
}

impl QmpError {
    pub fn new(class: ErrorClass, desc: impl Into<String>) -> QmpError {
        QmpError {
            class,
            desc: desc.into(),
        }
    }

    /// A `GenericError`: what QEMU answers for nearly every refusal.
    pub fn generic(desc: impl Into<String>) -> QmpError {
        QmpError::new(ErrorClass::GenericError, desc)
    }

    /// This error with the text is `desc`, of class GenericError.
    pub fn is_generic(&self, desc: &str) -> bool {
        self.class == ErrorClass::GenericError && self.desc == desc
    }
}

/// What a command gets: QEMU's `return` value, or an error.
pub type Reply = Result<Value, QmpError>;

/// The next message of a client's byte stream.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// Nothing whole yet.
    More,
    Value(Value),
    /// Bytes that are not JSON: QEMU answers an id-less GenericError and goes on after them.
    ParseError(String),
}

/// Takes the next JSON value off the front of `buf` (QMP is a stream of JSON values; newlines
/// and other whitespace between them do not matter).
#[cfg(test)]
pub fn next(buf: &mut Vec<u8>) -> Next {
    let (n, used) = parse_front(buf);
    buf.drain(..used);
    n
}

/// [`next`] on a slice: the message and how many bytes it used (to drop).
fn parse_front(buf: &[u8]) -> (Next, usize) {
    let start = buf
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(buf.len());
    if start == buf.len() {
        return (Next::More, buf.len());
    }
    let mut it = serde_json::Deserializer::from_slice(&buf[start..]).into_iter::<Value>();
    match it.next() {
        Some(Ok(v)) => (Next::Value(v), start + it.byte_offset()),
        Some(Err(e)) if e.is_eof() => (Next::More, 0),
        Some(Err(_)) => {
            // Drop the bad token up to the next line (QEMU's lexer resyncs; clients send one
            // message per line).
            let end = buf[start..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(buf.len(), |p| start + p + 1);
            let word: String = String::from_utf8_lossy(&buf[start..end])
                .split(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-')
                .next()
                .unwrap_or("")
                .to_string();
            let e = if word.is_empty() {
                "JSON parse error, invalid token".into()
            } else {
                format!("JSON parse error, invalid keyword '{word}'")
            };
            (Next::ParseError(e), end)
        }
        None => (Next::More, 0),
    }
}

/// A client's byte stream cut into messages in linear time: each byte is scanned once (JSON
/// nesting, strings and keywords tracked as they come), and a message is parsed once, when the
/// scan finds its end (or a byte no JSON value can hold, for QEMU's error at once). The
/// buffer holds at most the current message plus one read.
#[derive(Debug, Default)]
pub struct Framer {
    buf: Vec<u8>,
    /// Start of the current message in `buf`.
    head: usize,
    /// Next byte to scan.
    pos: usize,
    depth: usize,
    in_str: bool,
    esc: bool,
    /// Inside a bare word (keyword) or a number.
    word: Option<Vec<u8>>,
    number: bool,
    /// The rest of a bad line is dropped when it comes (QEMU drops the bad line).
    skip_line: bool,
}

/// What the scan found at a byte.
enum Found {
    /// A whole value ends before `usize`.
    End(usize),
    /// A byte no JSON text can have here: parse now for QEMU's error.
    Bad,
}

impl Framer {
    pub fn push(&mut self, bytes: &[u8]) {
        if self.head > 0 {
            self.buf.drain(..self.head);
            self.pos -= self.head;
            self.head = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes of the message not yet whole (to bound it).
    pub fn pending(&self) -> usize {
        self.buf.len() - self.head
    }

    fn reset(&mut self, to: usize) {
        self.head = to;
        self.pos = to;
        self.depth = 0;
        self.in_str = false;
        self.esc = false;
        self.word = None;
        self.number = false;
    }

    /// The next message, once its last byte has arrived.
    pub fn next(&mut self) -> Next {
        let Some(found) = self.scan() else {
            return Next::More;
        };
        if let Found::End(e) = found {
            if let (v @ Next::Value(_), used) = parse_front(&self.buf[self.head..e]) {
                self.reset(self.head + used);
                return v;
            }
        }
        // Not JSON: QEMU's error, and on after the bad line (as `next` on the whole stream).
        match parse_front(&self.buf[self.head..]) {
            (Next::More, _) => {
                let nl = self.buf[self.head..]
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(self.buf.len(), |p| self.head + p + 1);
                self.reset(nl);
                Next::ParseError("JSON parse error, invalid token".into())
            }
            (n, used) => {
                let to = self.head + used;
                self.skip_line = matches!(n, Next::ParseError(_))
                    && to == self.buf.len()
                    && self.buf.last() != Some(&b'\n');
                self.reset(to);
                n
            }
        }
    }

    /// Scans new bytes for the end of the current value.
    fn scan(&mut self) -> Option<Found> {
        while self.pos < self.buf.len() {
            let b = self.buf[self.pos];
            let at = self.pos;
            self.pos += 1;
            if self.skip_line {
                self.skip_line = b != b'\n';
                self.head = self.pos;
                continue;
            }
            if self.in_str {
                if self.esc {
                    self.esc = false;
                } else if b == b'\\' {
                    self.esc = true;
                } else if b == b'"' {
                    self.in_str = false;
                    if self.depth == 0 {
                        return Some(Found::End(self.pos));
                    }
                }
                continue;
            }
            if let Some(w) = self.word.as_mut() {
                if b.is_ascii_alphabetic() {
                    w.push(b);
                    if w.len() > 5 {
                        return Some(Found::Bad);
                    }
                    continue;
                }
                let ok = matches!(w.as_slice(), b"true" | b"false" | b"null");
                self.word = None;
                if !ok {
                    return Some(Found::Bad);
                }
                if self.depth == 0 {
                    return Some(Found::End(at));
                }
            } else if self.number {
                if b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-') {
                    continue;
                }
                self.number = false;
                if self.depth == 0 {
                    return Some(Found::End(at));
                }
            }
            match b {
                b' ' | b'\t' | b'\r' | b'\n' => {
                    if self.depth == 0 && at == self.head {
                        self.head += 1;
                    }
                }
                b'"' => self.in_str = true,
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth > 1024 {
                        return Some(Found::Bad);
                    }
                }
                b'}' | b']' => {
                    if self.depth == 0 {
                        return Some(Found::Bad);
                    }
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Some(Found::End(self.pos));
                    }
                }
                b',' | b':' if self.depth > 0 => {}
                b'-' | b'0'..=b'9' => self.number = true,
                b'a'..=b'z' | b'A'..=b'Z' => self.word = Some(vec![b]),
                _ => return Some(Found::Bad),
            }
        }
        None
    }
}

/// A well-formed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub execute: String,
    pub arguments: Option<Map<String, Value>>,
    /// The client's id, exactly as sent (absent stays absent).
    pub id: Option<Value>,
    /// Sent as `exec-oob`.
    pub oob: bool,
}

#[derive(Debug, PartialEq)]
pub enum Shape {
    Request(Request),
    Invalid { desc: String, id: Option<Value> },
}

/// QEMU's checks of a request object (`qmp_dispatch_check_obj`), with its texts.
/// `allow_oob`: the client enabled oob, so `exec-oob` may stand for `execute`.
pub fn check_request(v: Value, allow_oob: bool) -> Shape {
    let Value::Object(mut m) = v else {
        return Shape::Invalid {
            desc: "QMP input must be a JSON object".into(),
            id: None,
        };
    };
    let id = m.remove("id");
    let bad = |desc: String, id: Option<Value>| Shape::Invalid { desc, id };
    let mut exec_key: Option<&str> = None;
    for (k, v) in &m {
        match k.as_str() {
            key @ "execute" | key @ "exec-oob" if key == "execute" || allow_oob => {
                if !v.is_string() {
                    return bad(format!("QMP input member '{key}' must be a string"), id);
                }
                if let Some(first) = exec_key {
                    return bad(
                        format!("QMP input member '{key}' clashes with '{first}'"),
                        id,
                    );
                }
                exec_key = Some(key);
            }
            "arguments" if !v.is_object() => {
                return bad("QMP input member 'arguments' must be an object".into(), id)
            }
            "arguments" => {}
            // exec-oob without the oob capability is just an unknown member.
            other => return bad(format!("QMP input member '{other}' is unexpected"), id),
        }
    }
    let Some(key) = exec_key.map(str::to_string) else {
        return bad("QMP input lacks member 'execute'".into(), id);
    };
    let oob = key == "exec-oob";
    let Some(Value::String(execute)) = m.remove(&key) else {
        return bad("QMP input lacks member 'execute'".into(), id);
    };
    let arguments = match m.remove("arguments") {
        Some(Value::Object(a)) => Some(a),
        _ => None,
    };
    Shape::Request(Request {
        execute,
        arguments,
        id,
        oob,
    })
}

/// `qmp_capabilities`' arguments: an optional `enable` list of capabilities; `oob` is the only
/// one QEMU has, and the proxy offers it when QEMU does (`offered`). Whether oob is on, or
/// QEMU's error text.
pub fn check_capabilities(
    args: &Option<Map<String, Value>>,
    offered: bool,
) -> Result<bool, String> {
    let Some(a) = args.as_ref() else {
        return Ok(false);
    };
    for k in a.keys() {
        if k != "enable" {
            return Err(format!("Parameter '{k}' is unexpected"));
        }
    }
    match a.get("enable") {
        None => Ok(false),
        Some(Value::Array(l)) => {
            let mut oob = false;
            for c in l {
                match c.as_str() {
                    Some("oob") if offered => oob = true,
                    Some("oob") => return Err("Capability 'oob' not available".into()),
                    Some(other) => {
                        return Err(format!(
                            "Parameter 'enable' does not accept value '{other}'"
                        ))
                    }
                    None => {
                        return Err("Invalid parameter type for 'enable', expected: string".into())
                    }
                }
            }
            Ok(oob)
        }
        Some(_) => Err("Invalid parameter type for 'enable', expected: array".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_classes_keep_qemus_spelling() {
        for c in [
            "GenericError",
            "CommandNotFound",
            "DeviceNotActive",
            "DeviceNotFound",
            "KVMMissingCap",
            "SomethingNew",
        ] {
            assert_eq!(ErrorClass::parse(c).as_str(), c);
        }
        assert_eq!(
            ErrorClass::parse("KVMMissingCap"),
            ErrorClass::KvmMissingCap
        );
        let e = QmpError::generic("NBD server not running");
        assert!(e.is_generic("NBD server not running"));
        assert!(
            !QmpError::new(ErrorClass::DeviceNotFound, "NBD server not running")
                .is_generic("NBD server not running")
        );
        assert_eq!(e.to_string(), "GenericError: NBD server not running");
    }
    use serde_json::json;

    fn all(input: &str) -> Vec<Next> {
        let mut b = input.as_bytes().to_vec();
        let mut out = Vec::new();
        loop {
            match next(&mut b) {
                Next::More => return out,
                n => out.push(n),
            }
        }
    }

    #[test]
    fn framing_as_qemu_reads_it() {
        // Two objects on one line both run; whitespace between does not matter.
        assert_eq!(
            all("{\"execute\":\"a\"} {\"execute\":\"b\"}\n"),
            [
                Next::Value(json!({"execute": "a"})),
                Next::Value(json!({"execute": "b"}))
            ]
        );
        // A split object waits for its rest.
        let mut b = b"{\"execute\":".to_vec();
        assert_eq!(next(&mut b), Next::More);
        b.extend_from_slice(b"\"x\"}");
        assert_eq!(next(&mut b), Next::Value(json!({"execute": "x"})));
        // Bad JSON: QEMU's text, and the stream goes on.
        assert_eq!(
            all("bad\n{\"execute\":\"c\"}"),
            [
                Next::ParseError("JSON parse error, invalid keyword 'bad'".into()),
                Next::Value(json!({"execute": "c"}))
            ]
        );
    }

    /// The framer gives what `next` gives on the whole stream, fed in any pieces.
    #[test]
    fn framer_matches_next_in_pieces() {
        let inputs = [
            "{\"execute\":\"a\"} {\"execute\":\"b\"}\n",
            "bad\n{\"execute\":\"c\"}\n",
            "{\"execute\": \"x\", \"arguments\": {\"s\": \"}{\\\"]\", \"n\": [1, -2.5e3, true, null]}}\r\n",
            "[1,2]\n{\"execute\":\"d\"}\n",
            "123\n\"str\"\n{\"execute\":\"e\"}\n",
            "{\"execute\": bad}\n{\"execute\":\"f\"}\n",
            "bad stuff here\n{\"execute\":\"g\"}\n",
        ];
        for input in inputs {
            let want = all(input);
            for step in [1, 2, 3, 7, input.len()] {
                let mut f = Framer::default();
                let mut got = Vec::new();
                for piece in input.as_bytes().chunks(step) {
                    f.push(piece);
                    loop {
                        match f.next() {
                            Next::More => break,
                            n => got.push(n),
                        }
                    }
                }
                assert_eq!(got, want, "{input:?} in pieces of {step}");
            }
        }
    }

    /// A message that arrives a byte at a time is scanned once, not re-parsed per read: a
    /// 1 MiB string in 64 KiB reads is quick (quadratic re-parsing took seconds).
    #[test]
    fn framer_is_linear() {
        let body = "x".repeat(4 << 20);
        let msg = format!("{{\"execute\":\"a\",\"arguments\":{{\"s\":\"{body}\"}}}}\n");
        let mut f = Framer::default();
        let t0 = std::time::Instant::now();
        let mut got = None;
        for piece in msg.as_bytes().chunks(512) {
            f.push(piece);
            if let Next::Value(v) = f.next() {
                got = Some(v);
            }
            assert!(f.pending() <= msg.len());
        }
        assert!(got.is_some());
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "took {:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn request_checks_with_qemus_texts() {
        let desc = |v: Value| match check_request(v, false) {
            Shape::Invalid { desc, id } => (desc, id),
            Shape::Request(r) => panic!("accepted {r:?}"),
        };
        assert_eq!(desc(json!([1, 2])).0, "QMP input must be a JSON object");
        assert_eq!(
            desc(json!({"execute": "x", "extra": 1, "id": 3})),
            (
                "QMP input member 'extra' is unexpected".into(),
                Some(json!(3))
            )
        );
        assert_eq!(
            desc(json!({"arguments": {}})).0,
            "QMP input lacks member 'execute'"
        );
        assert_eq!(
            desc(json!({"execute": 1})).0,
            "QMP input member 'execute' must be a string"
        );
        assert_eq!(
            desc(json!({"execute": "x", "arguments": [1]})).0,
            "QMP input member 'arguments' must be an object"
        );
        assert_eq!(
            desc(json!({"exec-oob": "migrate-pause"})).0,
            "QMP input member 'exec-oob' is unexpected"
        );
        let Shape::Request(r) = check_request(json!({"execute": "q", "id": {"a": [1]}}), false)
        else {
            panic!()
        };
        assert_eq!(r.id, Some(json!({"a": [1]})));
        let Shape::Request(r) = check_request(json!({"execute": "q", "id": null}), false) else {
            panic!()
        };
        assert_eq!(r.id, Some(Value::Null), "a null id is an id");
        let Shape::Request(r) = check_request(json!({"execute": "q"}), false) else {
            panic!()
        };
        assert_eq!(r.id, None);
    }

    #[test]
    fn capabilities() {
        let a = |v: Value| check_capabilities(&v.as_object().cloned(), false);
        assert_eq!(a(json!({})), Ok(false));
        assert_eq!(a(json!({"enable": []})), Ok(false));
        assert_eq!(
            a(json!({"enable": ["oob"]})),
            Err("Capability 'oob' not available".into())
        );
        assert_eq!(
            a(json!({"x": 1})),
            Err("Parameter 'x' is unexpected".into())
        );
        let offered = |v: Value| check_capabilities(&v.as_object().cloned(), true);
        assert_eq!(offered(json!({"enable": ["oob"]})), Ok(true));
        assert_eq!(offered(json!({})), Ok(false));
    }
}
