//! The QMP wire format as pure functions: one line of bytes to a JSON value, and a value to
//! what it is (an event, a reply to a command id, something else). No socket: the client's
//! reader uses them, the fuzz targets call them, and a QMP proxy's server side can too.

use serde_json::Value;

use crate::{Event, QmpError};

/// Longest line accepted from a peer (a `query-named-block-nodes` of a big VM is large, but
/// not this large).
pub const MAX_LINE: usize = 64 << 20;

/// Decodes one line as read from the socket (its `\n` included). Ok(None): a blank line,
/// skipped. A line without its newline is a stream cut short.
pub fn decode_line(line: &[u8]) -> Result<Option<Value>, QmpError> {
    if line.len() > MAX_LINE {
        return Err(QmpError::Protocol(format!(
            "message longer than {MAX_LINE} bytes"
        )));
    }
    if !line.ends_with(b"\n") {
        return Err(QmpError::Protocol(format!(
            "truncated message at end of stream: {}",
            String::from_utf8_lossy(&line[..line.len().min(200)])
        )));
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(line).map(Some).map_err(|e| {
        QmpError::Protocol(format!(
            "invalid JSON from the peer ({e}): {}",
            String::from_utf8_lossy(&line[..line.len().min(200)]).trim_end()
        ))
    })
}

/// What a message from QEMU is.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Event(Event),
    /// The answer to the command sent with `id`: its `return`, or QEMU's error class and
    /// description.
    Reply {
        id: u64,
        result: Result<Value, (String, String)>,
    },
    /// Neither (no numeric id, or neither return nor error): the peer broke the protocol.
    Unexpected(Value),
}

/// Classifies a decoded message.
pub fn classify(v: Value) -> Message {
    if let Some(name) = v.get("event").and_then(Value::as_str) {
        let ts = &v["timestamp"];
        return Message::Event(Event {
            name: name.to_string(),
            data: v.get("data").cloned().unwrap_or(Value::Null),
            timestamp: (
                ts["seconds"].as_i64().unwrap_or(0),
                ts["microseconds"].as_i64().unwrap_or(0),
            ),
            seq: 0,
        });
    }
    let Some(id) = v.get("id").and_then(Value::as_u64) else {
        return Message::Unexpected(v);
    };
    if let Some(e) = v.get("error") {
        let class = e["class"].as_str().unwrap_or("GenericError").to_string();
        let desc = e["desc"].as_str().unwrap_or("").to_string();
        return Message::Reply {
            id,
            result: Err((class, desc)),
        };
    }
    match v.get("return") {
        Some(r) => Message::Reply {
            id,
            result: Ok(r.clone()),
        },
        None => Message::Unexpected(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lines_and_messages() {
        assert_eq!(decode_line(b"  \n").unwrap(), None);
        assert!(decode_line(b"{}").is_err(), "no newline");
        assert!(decode_line(b"{\n").is_err(), "bad JSON");
        let v = decode_line(b"{\"return\": {}, \"id\": 3}\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            classify(v),
            Message::Reply {
                id: 3,
                result: Ok(json!({}))
            }
        );
        let e = classify(json!({"id": 4, "error": {"class": "DeviceNotFound", "desc": "x"}}));
        assert_eq!(
            e,
            Message::Reply {
                id: 4,
                result: Err(("DeviceNotFound".into(), "x".into()))
            }
        );
        let ev = classify(json!({"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}}));
        assert!(
            matches!(ev, Message::Event(Event { ref name, timestamp: (1, 2), .. }) if name == "STOP")
        );
        assert!(matches!(
            classify(json!({"id": "x"})),
            Message::Unexpected(_)
        ));
        assert!(matches!(classify(json!({"id": 5})), Message::Unexpected(_)));
    }
}
