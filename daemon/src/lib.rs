//! acceld: a vhost-user-blk server whose storage side (the engine) can change under a live
//! guest. See `docs/architecture.md` for the data path and the layers.
//!
//! Layers, bottom first; a module uses only the layers below it (checked by
//! `tests/layers.rs`):
//! 1. foundations: [`util`], [`virtio_blk`], [`guest_mem`]
//! 2. [`engine`]: held, file (io_uring, inline, image locks), nbd
//! 3. [`drive`]: config, stats, queue control, the live switch
//! 4. [`queue`]: the queue worker
//! 5. [`vhost`]: the vhost-user protocol handler and listener
//! 6. [`supervisor`]: VMs, QMP, policy, the switch plan and its executor
//! 7. [`run`], [`serve`]: the two daemon modes

pub mod drive;
pub mod engine;
pub mod guest_mem;
pub mod qmp_proxy;
pub mod queue;
pub mod run;
pub mod serve;
pub mod supervisor;
pub mod util;
pub mod vhost;
pub mod virtio_blk;

pub use accel_api::control;
pub use util::error_chain;
