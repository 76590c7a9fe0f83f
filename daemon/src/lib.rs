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
