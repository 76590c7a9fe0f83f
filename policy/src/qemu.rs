//! Building a [`DriveView`] from QEMU's own JSON: `query-named-block-nodes` (flat),
//! `x-debug-query-block-graph` (edges), `query-block` (legacy limits), `query-status`,
//! `query-migrate`.

use serde_json::Value;
use thiserror::Error;

use crate::{DriveView, NodeView, Parent, Pin, RecordedOptions, VmState};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("{what}: expected {expected}")]
    Shape {
        what: &'static str,
        expected: &'static str,
    },
    #[error("{what}: entry {index} has no {field}")]
    Missing {
        what: &'static str,
        index: usize,
        field: &'static str,
    },
}

/// Accepts a command's `return` value, a full reply `{"return": …}`, or a captured fixture
/// `{"execute": …, "response": {"return": …}}`.
fn ret(v: &Value) -> &Value {
    if let Some(r) = v.get("response").and_then(|r| r.get("return")) {
        return r;
    }
    v.get("return").unwrap_or(v)
}

fn limits_set(n: &Value) -> bool {
    ["iops", "iops_rd", "iops_wr", "bps", "bps_rd", "bps_wr"]
        .iter()
        .any(|k| n[*k].as_i64().unwrap_or(0) != 0)
}

/// `query-named-block-nodes` (flat) → nodes.
pub fn parse_nodes(v: &Value) -> Result<Vec<NodeView>, ParseError> {
    const WHAT: &str = "query-named-block-nodes";
    let arr = ret(v).as_array().ok_or(ParseError::Shape {
        what: WHAT,
        expected: "an array of nodes",
    })?;
    arr.iter()
        .enumerate()
        .map(|(i, n)| {
            let s = |k: &'static str| -> Result<String, ParseError> {
                n[k].as_str()
                    .map(str::to_string)
                    .ok_or(ParseError::Missing {
                        what: WHAT,
                        index: i,
                        field: k,
                    })
            };
            Ok(NodeView {
                name: s("node-name")?,
                driver: s("drv")?,
                read_only: n["ro"].as_bool().unwrap_or(false),
                filename: n["file"].as_str().unwrap_or_default().to_string(),
                virtual_size: n["image"]["virtual-size"].as_u64().unwrap_or(0),
                detect_zeroes: n["detect_zeroes"].as_str().unwrap_or("off").to_string(),
                encrypted: n["encrypted"].as_bool().unwrap_or(false),
                backing_depth: n["backing_file_depth"].as_u64().unwrap_or(0),
                cache_direct: n["cache"]["direct"].as_bool().unwrap_or(false),
                cache_no_flush: n["cache"]["no-flush"].as_bool().unwrap_or(false),
                cache_writeback: n["cache"]["writeback"].as_bool().unwrap_or(true),
                write_threshold: n["write_threshold"].as_u64().unwrap_or(0),
                dirty_bitmaps: n["dirty-bitmaps"]
                    .as_array()
                    .map_or(0, |b| b.iter().filter(|m| !temporary_bitmap(m)).count()),
                active: n["active"].as_bool().unwrap_or(true),
                throttled: limits_set(n),
            })
        })
        .collect()
}

/// Node names that have legacy I/O limits according to `query-block` (where `-drive
/// throttling.*` shows; `query-named-block-nodes` reports 0 for them).
pub fn throttled_nodes(query_block: &Value) -> Vec<String> {
    ret(query_block)
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|b| limits_set(&b["inserted"]))
                .filter_map(|b| b["inserted"]["node-name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// `x-debug-query-block-graph`.
#[derive(Clone, Debug, Default)]
pub struct BlockGraph {
    /// (id, type, name)
    pub nodes: Vec<(u64, String, String)>,
    /// (parent, child, edge name)
    pub edges: Vec<(u64, u64, String)>,
}

pub fn parse_graph(v: &Value) -> Result<BlockGraph, ParseError> {
    const WHAT: &str = "x-debug-query-block-graph";
    let r = ret(v);
    let (Some(nodes), Some(edges)) = (r["nodes"].as_array(), r["edges"].as_array()) else {
        return Err(ParseError::Shape {
            what: WHAT,
            expected: "an object with nodes and edges",
        });
    };
    let mut g = BlockGraph::default();
    for (i, n) in nodes.iter().enumerate() {
        let id = n["id"].as_u64().ok_or(ParseError::Missing {
            what: WHAT,
            index: i,
            field: "id",
        })?;
        g.nodes.push((
            id,
            n["type"].as_str().unwrap_or_default().to_string(),
            n["name"].as_str().unwrap_or_default().to_string(),
        ));
    }
    for (i, e) in edges.iter().enumerate() {
        let get = |k: &'static str| {
            e[k].as_u64().ok_or(ParseError::Missing {
                what: WHAT,
                index: i,
                field: k,
            })
        };
        g.edges.push((
            get("parent")?,
            get("child")?,
            e["name"].as_str().unwrap_or_default().to_string(),
        ));
    }
    Ok(g)
}

/// The VM state from `query-status` and (optionally) `query-migrate`.
pub fn vm_state(query_status: &Value, query_migrate: Option<&Value>) -> VmState {
    VmState {
        run_state: ret(query_status)["status"]
            .as_str()
            .unwrap_or("unknown")
            .to_string(),
        migration: query_migrate.and_then(|m| ret(m)["status"].as_str().map(str::to_string)),
    }
}

/// Everything but QEMU's answers, for [`drive_view`].
#[derive(Clone, Debug, Default)]
pub struct DriveContext {
    pub vm: VmState,
    pub memory_shared: bool,
    pub pin: Option<Pin>,
    pub options: RecordedOptions,
    /// From [`throttled_nodes`].
    pub throttled: Vec<String>,
}

/// The view of drive `drive` (its node is named after it, per the VM contract). With the block
/// graph, parents and children are exact; without it, the `file` child is the other node
/// reporting the same file name, and parents are unknown.
/// libvirt's `libvirt-tmp-activewrite`: added to the base of an active `block-commit` in the
/// transaction that completes the job, and left there afterwards (libvirt 11.3 with QEMU
/// 10.0.2, measured). Nothing reads it after the job: not a reason to keep the drive in QEMU.
fn temporary_bitmap(m: &Value) -> bool {
    m["name"] == "libvirt-tmp-activewrite" && m["persistent"] != true
}

pub fn drive_view(
    drive: &str,
    nodes: &[NodeView],
    graph: Option<&BlockGraph>,
    ctx: &DriveContext,
) -> DriveView {
    let mut v = DriveView {
        drive: drive.to_string(),
        vm: ctx.vm.clone(),
        memory_shared: ctx.memory_shared,
        pin: ctx.pin,
        options: ctx.options.clone(),
        ..Default::default()
    };
    let by_name = |n: &str| nodes.iter().find(|x| x.name == n).cloned();
    let Some(mut node) = by_name(drive) else {
        return v;
    };
    node.throttled |= ctx.throttled.iter().any(|t| t == drive);
    match graph {
        Some(g) => {
            let id = g
                .nodes
                .iter()
                .find(|(_, t, n)| t == "block-driver" && n == drive)
                .map(|(id, _, _)| *id);
            if let Some(id) = id {
                for (p, c, name) in &g.edges {
                    if *c == id {
                        let Some((_, t, pname)) = g.nodes.iter().find(|(i, _, _)| i == p) else {
                            continue;
                        };
                        v.parents.push(match t.as_str() {
                            "block-driver" => Parent::Filter(
                                by_name(pname)
                                    .map(|n| n.driver)
                                    .unwrap_or_else(|| pname.clone()),
                            ),
                            "block-job" => Parent::Job(pname.clone()),
                            _ if pname.is_empty() => {
                                Parent::Backend("an export or device (anonymous backend)".into())
                            }
                            _ => Parent::Backend(pname.clone()),
                        });
                    } else if *p == id {
                        let child = g.nodes.iter().find(|(i, _, _)| i == c);
                        match (name.as_str(), child) {
                            ("file", Some((_, _, cname))) => v.protocol = by_name(cname),
                            (other, _) => v.other_children.push(other.to_string()),
                        }
                    }
                }
            }
        }
        None => {
            v.protocol = nodes
                .iter()
                .find(|n| n.name != drive && n.filename == node.filename && n.driver != node.driver)
                .cloned();
        }
    }
    v.node = Some(node);
    v
}
