//! Domain-free helpers shared by every layer.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, recovering the data if a thread panicked while holding it: every value
/// under these locks stays consistent between statements.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub use accel_api::error_chain;
