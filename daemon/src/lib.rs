//! acceld: a vhost-user-blk server whose storage side (the engine) can change under a live
//! guest. See `docs/architecture.md` for the data path and the layers.
//!
//! The data plane (virtio-blk requests, guest memory, engines, drives, queue workers, the
//! vhost-user back-end) is the crate `accel_dataplane`, below every module here; this crate
//! is what drives it. Layers, bottom first; a module uses only the layers below it (checked
//! by `tests/layers.rs`):
//! 1. [`supervisor`]: VMs, QMP, policy, the switch plan and its executor
//! 2. [`qmp_proxy`]: management's QEMU-like monitor per VM
//! 3. [`run`], [`serve`]: the two daemon modes

pub mod qmp_proxy;
pub mod run;
pub mod serve;
pub mod supervisor;

pub use accel_api::control;
pub use accel_api::error_chain;
