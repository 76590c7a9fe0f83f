//! What a QMP client sends, checked the way QEMU 10 checks it (same error texts, measured
//! against QEMU 10.0.2): framing of the JSON stream, the request object's members, and the
//! capabilities negotiation's arguments. Pure: no I/O.

use serde_json::{Map, Value};

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
pub fn next(buf: &mut Vec<u8>) -> Next {
    let start = buf
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(buf.len());
    if start == buf.len() {
        buf.clear();
        return Next::More;
    }
    let mut it = serde_json::Deserializer::from_slice(&buf[start..]).into_iter::<Value>();
    match it.next() {
        Some(Ok(v)) => {
            let used = start + it.byte_offset();
            buf.drain(..used);
            Next::Value(v)
        }
        Some(Err(e)) if e.is_eof() => Next::More,
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
            buf.drain(..end);
            Next::ParseError(if word.is_empty() {
                "JSON parse error, invalid token".into()
            } else {
                format!("JSON parse error, invalid keyword '{word}'")
            })
        }
        None => Next::More,
    }
}

/// A well-formed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub execute: String,
    pub arguments: Option<Map<String, Value>>,
    /// The client's id, exactly as sent (absent stays absent).
    pub id: Option<Value>,
}

#[derive(Debug, PartialEq)]
pub enum Shape {
    Request(Request),
    Invalid { desc: String, id: Option<Value> },
}

/// QEMU's checks of a request object (`qmp_dispatch_check_obj`), with its texts.
pub fn check_request(v: Value) -> Shape {
    let Value::Object(mut m) = v else {
        return Shape::Invalid {
            desc: "QMP input must be a JSON object".into(),
            id: None,
        };
    };
    let id = m.remove("id");
    let bad = |desc: String, id: Option<Value>| Shape::Invalid { desc, id };
    for (k, v) in &m {
        match k.as_str() {
            "execute" if !v.is_string() => {
                return bad("QMP input member 'execute' must be a string".into(), id)
            }
            "arguments" if !v.is_object() => {
                return bad("QMP input member 'arguments' must be an object".into(), id)
            }
            "execute" | "arguments" => {}
            // exec-oob needs the oob capability, which the proxy does not offer.
            other => return bad(format!("QMP input member '{other}' is unexpected"), id),
        }
    }
    let Some(Value::String(execute)) = m.remove("execute") else {
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
    })
}

/// `qmp_capabilities`' arguments: an optional `enable` list of capabilities. The proxy offers
/// none (no oob yet). Returns QEMU's error text, if any.
pub fn check_capabilities(args: &Option<Map<String, Value>>) -> Option<String> {
    let a = args.as_ref()?;
    for k in a.keys() {
        if k != "enable" {
            return Some(format!("Parameter '{k}' is unexpected"));
        }
    }
    match a.get("enable") {
        None => None,
        Some(Value::Array(l)) => l.first().map(|c| match c.as_str() {
            Some("oob") => "Capability 'oob' not available".to_string(),
            Some(other) => format!("Parameter 'enable' does not accept value '{other}'"),
            None => "Invalid parameter type for 'enable', expected: string".to_string(),
        }),
        Some(_) => Some("Invalid parameter type for 'enable', expected: array".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn request_checks_with_qemus_texts() {
        let desc = |v: Value| match check_request(v) {
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
        let Shape::Request(r) = check_request(json!({"execute": "q", "id": {"a": [1]}})) else {
            panic!()
        };
        assert_eq!(r.id, Some(json!({"a": [1]})));
        let Shape::Request(r) = check_request(json!({"execute": "q", "id": null})) else {
            panic!()
        };
        assert_eq!(r.id, Some(Value::Null), "a null id is an id");
        let Shape::Request(r) = check_request(json!({"execute": "q"})) else {
            panic!()
        };
        assert_eq!(r.id, None);
    }

    #[test]
    fn capabilities() {
        let a = |v: Value| check_capabilities(&v.as_object().cloned());
        assert_eq!(a(json!({})), None);
        assert_eq!(a(json!({"enable": []})), None);
        assert_eq!(
            a(json!({"enable": ["oob"]})),
            Some("Capability 'oob' not available".into())
        );
        assert_eq!(
            a(json!({"x": 1})),
            Some("Parameter 'x' is unexpected".into())
        );
    }
}
