//! acceld: a vhost-user-blk server whose storage side (the engine) can change under a live
//! guest. See `docs/architecture.md` for the data path.

pub mod control;
pub mod drive;
pub mod engine;
pub mod nbd;
pub mod run;
pub mod serve;
pub mod supervisor;
pub mod vhost;
pub mod virtio_blk;
pub mod worker;

/// An error and its sources on one line ("a: b: c"), as errors are printed at the top.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}
