//! A QEMU that announced its end and does not end: woken with SIGTERM.
//!
//! QEMU 10.0.2 can wait forever in its exit. When its main loop ends (a guest's poweroff, a
//! signal, `quit`) while the QMP dispatcher is between the two halves of a command (it took
//! the request and scheduled the handler in `iohandler_ctx`, which the last main-loop round
//! did not run), `monitor_cleanup` polls `iohandler_ctx` once, which runs the handler and
//! schedules the dispatcher's wake-up in that context, then blocks in `qemu_aio_context` with
//! nothing left to wake it. Any QMP client's command can be the one (acceld's, a management
//! tool's): with a client asking as fast as it can, about one exit in two hangs (`integration`
//! test `qemu_exits_though_a_monitor_keeps_asking`). A signal wakes it: QEMU's SIGTERM handler
//! calls `qemu_notify_event`, the wait looks again, the dispatcher finishes, QEMU exits 0. A
//! SIGTERM to a QEMU already in its exit changes nothing else (it only requests a shutdown).
//!
//! So acceld, whose monitor sees the SHUTDOWN event, sends one when QEMU's QMP connection is
//! still open [`EXIT_GRACE`] after it, at most [`KICKS`] times. Only to the process that made
//! acceld's QMP socket (SO_PEERCRED; alive, its pid not reused, while the connection is open),
//! and for a VM of a permit only when that process is the permit's user's.

use std::sync::Arc;
use std::time::Duration;

use qmp_client::{Event, Qmp};
use serde_json::Value;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::Instant;
use tracing::{info, warn};

use accel_dataplane::util::{suppressed, LogLimit};

/// How long QEMU may take to exit after its SHUTDOWN before it is woken.
pub(super) const EXIT_GRACE: Duration = Duration::from_secs(5);
/// Wake-ups at most, [`EXIT_GRACE`] apart.
pub(super) const KICKS: u32 = 3;

/// What QEMU's events say about the end of its process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// No end announced (or QEMU stays after it).
    Running,
    /// The guest shut down: QEMU exits, unless `-no-shutdown` keeps it (then STOP follows
    /// SHUTDOWN at once, from the same main-loop step).
    GuestShutdown,
    /// QEMU exits: a SHUTDOWN from the host (a signal, `quit`: QEMU exits whatever
    /// `-no-shutdown` says).
    Exiting,
}

impl Ending {
    /// The state after `event` (QEMU's name and data).
    pub(super) fn next(self, event: &str, data: &Value) -> Ending {
        match (self, event) {
            (_, "SHUTDOWN") if data["guest"] == Value::Bool(true) => Ending::GuestShutdown,
            (_, "SHUTDOWN") => Ending::Exiting,
            // -no-shutdown: QEMU stopped in the `shutdown` state and stays.
            (Ending::GuestShutdown, "STOP") => Ending::Running,
            // Management brought the guest back (`system_reset`, `cont`).
            (_, "RESET" | "RESUME") => Ending::Running,
            (s, _) => s,
        }
    }
}

/// The VM whose QEMU is watched.
pub(super) struct Watched {
    pub name: String,
    /// The permit's user, for a VM of a permit: only a process of theirs is signalled.
    pub owner_uid: Option<u32>,
}

/// Follows `events` (subscribed when acceld attached) for as long as the task lives (the VM's
/// watch aborts it when the connection ends), and wakes a QEMU that does not exit.
pub(super) async fn watch_exit(vm: Watched, qmp: Arc<Qmp>, mut events: broadcast::Receiver<Event>) {
    // A QEMU decides how often it says SHUTDOWN: its lines are budgeted.
    let log = LogLimit::default();
    let mut ending = Ending::Running;
    let mut since: Option<Instant> = None;
    let mut kicks = 0u32;
    loop {
        let due = since.map(|t| t + EXIT_GRACE * (kicks + 1));
        tokio::select! {
            ev = events.recv() => match ev {
                Ok(ev) => {
                    let next = ending.next(&ev.name, &ev.data);
                    if next == Ending::Running {
                        since = None;
                        kicks = 0;
                    } else if ending == Ending::Running {
                        since = Some(Instant::now());
                    }
                    ending = next;
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return,
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                if qmp.is_closed() {
                    return;
                }
                kicks += 1;
                kick(&vm, &qmp, kicks, &log);
                if kicks >= KICKS {
                    return;
                }
            }
        }
    }
}

fn kick(vm: &Watched, qmp: &Qmp, n: u32, log: &LogLimit) {
    let after = EXIT_GRACE * n;
    let Some(pid) = qmp.peer_pid().filter(|p| *p > 1) else {
        if let Some(k) = log.admit() {
            warn!(vm = %vm.name, "QEMU has not exited {after:?} after its SHUTDOWN, and its process is unknown{}", suppressed(k));
        }
        return;
    };
    if let Some(uid) = vm.owner_uid {
        if qmp.peer_uid() != Some(uid) {
            if let Some(k) = log.admit() {
                warn!(vm = %vm.name, pid, "QEMU has not exited {after:?} after its SHUTDOWN; its QMP socket is not its user's ({uid}): not signalled{}", suppressed(k));
            }
            return;
        }
    }
    // SAFETY: kill(2) takes two integers and touches none of acceld's memory. `pid` made the
    // QMP socket whose connection is open: that process lives, its pid names no other.
    let r = unsafe { libc::kill(pid, libc::SIGTERM) };
    // The budget is the log's only: the signal goes whatever it says.
    let Some(k) = log.admit() else {
        return;
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        warn!(vm = %vm.name, pid, "QEMU has not exited {after:?} after its SHUTDOWN; SIGTERM failed: {e}{}", suppressed(k));
    } else {
        info!(vm = %vm.name, pid, "QEMU has not exited {after:?} after its SHUTDOWN (QEMU 10.0.2 can wait forever in its exit when its main loop ended in the middle of a QMP command): SIGTERM wakes it{}", suppressed(k));
    }
}

#[cfg(test)]
mod tests {
    use super::Ending::{self, *};
    use serde_json::json;

    /// Event sequences as QEMU 10.0.2 sends them, and the state they end in.
    #[test]
    fn what_the_events_say_about_qemus_end() {
        let guest = json!({"guest": true, "reason": "guest-shutdown"});
        let host = json!({"guest": false, "reason": "host-signal"});
        let quit = json!({"guest": false, "reason": "host-qmp-quit"});
        let none = json!({});
        type Case<'a> = (&'a str, &'a [(&'a str, &'a serde_json::Value)], Ending);
        let cases: &[Case] = &[
            ("nothing yet", &[], Running),
            (
                "other events",
                &[("STOP", &none), ("RESUME", &none)],
                Running,
            ),
            ("guest poweroff", &[("SHUTDOWN", &guest)], GuestShutdown),
            (
                "guest poweroff under -no-shutdown",
                &[("SHUTDOWN", &guest), ("STOP", &none)],
                Running,
            ),
            ("SIGTERM", &[("SHUTDOWN", &host)], Exiting),
            ("quit", &[("SHUTDOWN", &quit)], Exiting),
            (
                "a STOP does not keep a QEMU told to quit",
                &[("SHUTDOWN", &quit), ("STOP", &none)],
                Exiting,
            ),
            (
                "-no-shutdown, then libvirt's SIGTERM",
                &[("SHUTDOWN", &guest), ("STOP", &none), ("SHUTDOWN", &host)],
                Exiting,
            ),
            (
                "-no-shutdown, then system_reset and cont",
                &[
                    ("SHUTDOWN", &guest),
                    ("STOP", &none),
                    ("RESET", &none),
                    ("RESUME", &none),
                ],
                Running,
            ),
            (
                "a malformed SHUTDOWN is the host's",
                &[("SHUTDOWN", &none)],
                Exiting,
            ),
            (
                "unrelated events change nothing",
                &[("SHUTDOWN", &guest), ("BLOCK_JOB_READY", &none)],
                GuestShutdown,
            ),
        ];
        for (what, events, want) in cases {
            let got = events
                .iter()
                .fold(Running, |s, (name, data)| s.next(name, data));
            assert_eq!(got, *want, "{what}");
        }
    }
}
