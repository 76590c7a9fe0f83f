//! Queue workers: one thread per virtqueue, from pop to completion.

pub mod inflight;
pub mod worker;

pub use worker::{
    spawn, CallHandle, WorkerError, WorkerHandle, WorkerParams, MAX_SEGS, NO_USED_LOG,
};
