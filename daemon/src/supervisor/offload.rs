//! The supervisor's way to the data plane's blocking calls: a drive's drain and resume, an
//! engine's open and `fdatasync`, a server thread's join. None of them runs on a thread of
//! the async runtime (two such waits on its two threads once stopped every VM's control
//! requests, proxy and switches); each runs on a thread of the runtime's blocking pool
//! while the VM's task awaits it. A wait that a compromised QEMU can make endless also has a
//! deadline ([`blocking_within`]): past it the task goes on and the thread is left to finish
//! on its own.

use std::time::Duration;

/// Runs `f` on a blocking thread and waits for it. Its own bounds (the drain timeout, the
/// NBD handshake's) bound the wait.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: the runtime is shutting down, and this task with it.
        Err(_) => std::future::pending().await,
    }
}

/// Like [`blocking`], but waits at most `deadline`: `None` when `f` has not returned by then
/// (it goes on, detached, and its result is dropped).
pub(crate) async fn blocking_within<T: Send + 'static>(
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    match tokio::time::timeout(deadline, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(_)) => std::future::pending().await,
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_blocked_call_past_its_deadline_leaves_the_runtime_free() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t0 = std::time::Instant::now();
        let r = blocking_within(Duration::from_millis(50), move || rx.recv()).await;
        assert!(r.is_none());
        assert!(t0.elapsed() < Duration::from_secs(5));
        // The one runtime thread still runs tasks.
        assert_eq!(tokio::spawn(async { 7 }).await.unwrap(), 7);
        drop(tx);
        assert_eq!(blocking(|| 3).await, 3);
    }
}
