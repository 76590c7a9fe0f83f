//! `block_set_io_throttle` on an accelerated drive: its arguments checked as QEMU checks them
//! (QEMU's texts), into acceld's limits. Pure.

use accel_api::control::ThrottleLimits;
use serde_json::{Map, Value};

fn generic(desc: impl Into<String>) -> (String, String) {
    ("GenericError".into(), desc.into())
}

/// The six limits every `block_set_io_throttle` carries, in QEMU's order.
const REQUIRED: [&str; 6] = ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"];
/// The optional ones QEMU takes; acceld's throttle does not have them yet.
const OPTIONAL: [&str; 15] = [
    "bps_max",
    "bps_rd_max",
    "bps_wr_max",
    "iops_max",
    "iops_rd_max",
    "iops_wr_max",
    "bps_max_length",
    "bps_rd_max_length",
    "bps_wr_max_length",
    "iops_max_length",
    "iops_rd_max_length",
    "iops_wr_max_length",
    "iops_size",
    "group",
    "device",
];

/// QEMU's limit on every throttle value (`THROTTLE_VALUE_MAX`).
const THROTTLE_VALUE_MAX: i64 = 1_000_000_000_000_000;

/// Parses `block_set_io_throttle`'s arguments as QEMU does (its texts), into acceld's limits
/// (`None`: all zero, no throttle).
pub fn parse(a: &Map<String, Value>) -> Result<Option<ThrottleLimits>, (String, String)> {
    let mut v = [0i64; 6];
    for (i, k) in REQUIRED.iter().enumerate() {
        match a.get(*k) {
            None => return Err(generic(format!("Parameter '{k}' is missing"))),
            Some(x) => {
                v[i] = x.as_i64().ok_or_else(|| {
                    generic(format!(
                        "Invalid parameter type for '{k}', expected: integer"
                    ))
                })?
            }
        }
    }
    for k in a.keys() {
        if k == "id" || REQUIRED.contains(&k.as_str()) {
            continue;
        }
        if !OPTIONAL.contains(&k.as_str()) {
            return Err(generic(format!("Parameter '{k}' is unexpected")));
        }
        let set = match &a[k] {
            Value::Null => false,
            Value::Number(n) => n.as_i64() != Some(0),
            Value::String(_) => k != "device",
            _ => true,
        };
        if set {
            return Err(generic(format!(
                "acceld's QMP proxy: '{k}' is not supported on an accelerated drive yet"
            )));
        }
    }
    if v.iter().any(|&x| !(0..=THROTTLE_VALUE_MAX).contains(&x)) {
        return Err(generic(format!(
            "bps/iops/max values must be within [0, {THROTTLE_VALUE_MAX}]"
        )));
    }
    if v.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let o = |x: i64| (x > 0).then_some(x as u64);
    Ok(Some(ThrottleLimits {
        bps_total: o(v[0]),
        bps_read: o(v[1]),
        bps_write: o(v[2]),
        iops_total: o(v[3]),
        iops_read: o(v[4]),
        iops_write: o(v[5]),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("an object"),
        }
    }

    #[test]
    fn throttle_arguments_as_qemu_checks_them() {
        let base = json!({"id": "x", "bps": 0, "bps_rd": 0, "bps_wr": 0, "iops": 100,
                          "iops_rd": 0, "iops_wr": 0});
        let l = parse(&args(base.clone())).unwrap().unwrap();
        assert_eq!(l.iops_total, Some(100));
        assert_eq!(l.bps_total, None);
        let mut zero = base.clone();
        zero["iops"] = json!(0);
        assert_eq!(parse(&args(zero)).unwrap(), None, "all zero: no throttle");
        let mut missing = base.clone();
        missing.as_object_mut().unwrap().remove("iops_rd");
        assert_eq!(
            parse(&args(missing)).unwrap_err().1,
            "Parameter 'iops_rd' is missing"
        );
        let mut typed = base.clone();
        typed["bps"] = json!("1");
        assert_eq!(
            parse(&args(typed)).unwrap_err().1,
            "Invalid parameter type for 'bps', expected: integer"
        );
        let mut extra = base.clone();
        extra["nope"] = json!(1);
        assert_eq!(
            parse(&args(extra)).unwrap_err().1,
            "Parameter 'nope' is unexpected"
        );
        let mut neg = base.clone();
        neg["bps"] = json!(-1);
        assert!(parse(&args(neg)).unwrap_err().1.contains("must be within"));
        let mut max = base;
        max["iops_max"] = json!(0);
        assert!(
            parse(&args(max.clone())).is_ok(),
            "zero optional limits are fine"
        );
        max["iops_max"] = json!(5);
        assert!(parse(&args(max)).unwrap_err().1.contains("not supported"));
    }
}
