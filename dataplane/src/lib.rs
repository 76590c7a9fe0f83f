//! accel's data plane: what serves a guest's virtio-blk requests, from the vring to the
//! storage and back. See `docs/architecture.md` for the data path and the layers.
//!
//! Blocking threads only (a worker thread per queue, a server thread per drive, an NBD reader
//! per connection): no async runtime. `acceld` (the supervisor, the QMP proxy, `acceld run`
//! and `acceld serve`) drives it from above.
//!
//! Layers, bottom first; a module uses only the layers below it (checked by
//! `daemon/tests/layers.rs`):
//! 1. foundations: [`util`], [`virtio_blk`], [`guest_mem`], [`vu_frontend`] (a vhost-user
//!    front-end of QEMU's vhost-user-blk export)
//! 2. [`engine`]: held, file (io_uring, inline, image locks), nbd, relay
//! 3. [`drive`]: config, stats, queue control, the live switch, lending the rings
//! 4. [`queue`]: the queue worker
//! 5. [`vhost`]: the vhost-user protocol handler and listener

pub mod drive;
pub mod engine;
pub mod guest_mem;
pub mod queue;
pub mod util;
pub mod vhost;
pub mod virtio_blk;
pub mod vu_frontend;

pub use util::error_chain;
