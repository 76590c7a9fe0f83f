//! `block_set_io_throttle` on an accelerated drive: its arguments checked as QEMU checks them
//! (QEMU's texts), into acceld's limits. Pure.

use accel_api::control::ThrottleLimits;
use serde_json::{Map, Value};

use super::message::QmpError;

/// The six limits every `block_set_io_throttle` carries, in QEMU's order.
const REQUIRED: [&str; 6] = ["bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"];
/// The optional ones QEMU takes; acceld's throttle does not have them yet.
const OPTIONAL: [&str; 14] = [
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
    "device",
];

/// QEMU's limit on every throttle value (`THROTTLE_VALUE_MAX`).
const THROTTLE_VALUE_MAX: i64 = 1_000_000_000_000_000;

/// The group a `block_set_io_throttle` names, if any.
pub fn group(a: &Map<String, Value>) -> Option<String> {
    a.get("group").and_then(Value::as_str).map(str::to_string)
}

/// A throttle group's `limits` (QEMU's `ThrottleLimits`, for `qom-set`) applied to the
/// current ones as QEMU applies them: only the fields given change (0: unlimited). `None`
/// when all are zero then. The burst and size fields acceld does not have must be absent or
/// zero.
pub fn parse_group_limits(
    v: &Value,
    current: Option<&ThrottleLimits>,
) -> Result<Option<ThrottleLimits>, QmpError> {
    let Some(m) = v.as_object() else {
        return Err(QmpError::generic(
            "Invalid parameter type for 'limits', expected: object",
        ));
    };
    let mut l = current.cloned().unwrap_or_default();
    for (k, x) in m {
        let n = x.as_u64().ok_or_else(|| {
            QmpError::generic(format!(
                "Invalid parameter type for '{k}', expected: integer"
            ))
        })?;
        let slot = match k.as_str() {
            "iops-total" => &mut l.iops_total,
            "iops-read" => &mut l.iops_read,
            "iops-write" => &mut l.iops_write,
            "bps-total" => &mut l.bps_total,
            "bps-read" => &mut l.bps_read,
            "bps-write" => &mut l.bps_write,
            _ if n == 0 => continue,
            _ => {
                return Err(QmpError::generic(format!(
                    "acceld's QMP proxy: '{k}' is not supported on an accelerated drive yet"
                )))
            }
        };
        *slot = (n > 0).then_some(n);
    }
    Ok((!l.is_empty()).then_some(l))
}

/// Parses `block_set_io_throttle`'s arguments as QEMU does (its texts), into acceld's limits
/// (`None`: all zero, no throttle).
pub fn parse(a: &Map<String, Value>) -> Result<Option<ThrottleLimits>, QmpError> {
    let mut v = [0i64; 6];
    for (i, k) in REQUIRED.iter().enumerate() {
        match a.get(*k) {
            None => return Err(QmpError::generic(format!("Parameter '{k}' is missing"))),
            Some(x) => {
                v[i] = x.as_i64().ok_or_else(|| {
                    QmpError::generic(format!(
                        "Invalid parameter type for '{k}', expected: integer"
                    ))
                })?
            }
        }
    }
    if a.get("group")
        .is_some_and(|g| !g.is_string() && !g.is_null())
    {
        return Err(QmpError::generic(
            "Invalid parameter type for 'group', expected: string",
        ));
    }
    for k in a.keys() {
        if k == "id" || k == "group" || REQUIRED.contains(&k.as_str()) {
            continue;
        }
        if !OPTIONAL.contains(&k.as_str()) {
            return Err(QmpError::generic(format!("Parameter '{k}' is unexpected")));
        }
        let set = match &a[k] {
            Value::Null => false,
            Value::Number(n) => n.as_i64() != Some(0),
            Value::String(_) => k != "device",
            _ => true,
        };
        if set {
            return Err(QmpError::generic(format!(
                "acceld's QMP proxy: '{k}' is not supported on an accelerated drive yet"
            )));
        }
    }
    if v.iter().any(|&x| !(0..=THROTTLE_VALUE_MAX).contains(&x)) {
        return Err(QmpError::generic(format!(
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
            parse(&args(missing)).unwrap_err().desc,
            "Parameter 'iops_rd' is missing"
        );
        let mut typed = base.clone();
        typed["bps"] = json!("1");
        assert_eq!(
            parse(&args(typed)).unwrap_err().desc,
            "Invalid parameter type for 'bps', expected: integer"
        );
        let mut extra = base.clone();
        extra["nope"] = json!(1);
        assert_eq!(
            parse(&args(extra)).unwrap_err().desc,
            "Parameter 'nope' is unexpected"
        );
        let mut neg = base.clone();
        neg["bps"] = json!(-1);
        assert!(parse(&args(neg))
            .unwrap_err()
            .desc
            .contains("must be within"));
        let mut grouped = base.clone();
        grouped["group"] = json!("tg0");
        assert!(parse(&args(grouped.clone())).is_ok(), "a group is fine");
        assert_eq!(group(&args(grouped)), Some("tg0".into()));
        let gl = parse_group_limits(&json!({"iops-total": 700, "bps-read-max": 0}), None)
            .unwrap()
            .unwrap();
        assert_eq!(gl.iops_total, Some(700));
        assert_eq!(
            parse_group_limits(&json!({}), Some(&gl)).unwrap(),
            Some(gl.clone()),
            "absent fields keep their values, as in QEMU"
        );
        let both = parse_group_limits(&json!({"bps-write": 9}), Some(&gl))
            .unwrap()
            .unwrap();
        assert_eq!((both.iops_total, both.bps_write), (Some(700), Some(9)));
        assert_eq!(
            parse_group_limits(&json!({"iops-total": 0}), Some(&gl)).unwrap(),
            None
        );
        assert!(parse_group_limits(&json!({"iops-total-max": 9}), None).is_err());
        let mut max = base;
        max["iops_max"] = json!(0);
        assert!(
            parse(&args(max.clone())).is_ok(),
            "zero optional limits are fine"
        );
        max["iops_max"] = json!(5);
        assert!(parse(&args(max))
            .unwrap_err()
            .desc
            .contains("not supported"));
    }
}
