//! The switch plan: what to do with one drive, given the policy's decision and what the drive
//! is doing now. Pure: no I/O, no clock, no lock; the executor (`switch.rs`) does the work.
//!
//! ```text
//!                 decision: qemu (reasons)                 decision: direct
//!   held    ──────────────────────────────► qemu  ◄────────────────────────── held
//!   direct  ──────────────────────────────► qemu       (held ──► direct at once)
//!   qemu    ──► stay | retune throttle | re-create (export gone, throttle on/off)
//!   qemu    ──► repath: relay ⇄ NBD (QEMU's vhost-user-blk export, or its NBD export)
//!   qemu    ──── decision direct, quiet period over (or urgent) ────────────► direct
//!   direct  ──── decision direct ──► stay
//! ```

use std::time::Duration;

use accel_api::control::ThrottleLimits;
use accel_api::status::EngineKind;
use policy::{Decision, ServeSpec};

/// The quiet-period timer: started when the rules first allow direct for a drive on the qemu
/// engine; the drive moves when it has run for the whole period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quiet {
    NotRunning,
    /// Running for this long.
    Running(Duration),
}

/// Everything the plan looks at.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The policy's answer, with an operator throttle already folded in as a reason.
    pub decision: &'a Decision,
    /// Where the drive is served now.
    pub engine: EngineKind,
    /// QEMU has a vhost-user-blk-pci device on the drive's socket.
    pub has_device: bool,
    /// The throttle the operator asked for.
    pub want_throttle: Option<&'a ThrottleLimits>,
    /// The throttle QEMU has now (qemu engine only).
    pub applied_throttle: Option<&'a ThrottleLimits>,
    /// acceld's NBD export of the drive exists in QEMU.
    pub export_present: bool,
    /// The export runs in the other AioContext than the one asked for (main loop or
    /// acceld's iothread): it must be re-created.
    pub export_context_stale: bool,
    pub quiet: Quiet,
    pub quiet_period: Duration,
    /// An operator asked: skip the quiet period.
    pub urgent: bool,
    /// A migration is under way, or QEMU's state is a migration's (incoming, finishing,
    /// migrated away): no engine moves, because a move adds or removes nodes and exports,
    /// which makes the migration fail or activates the destination's nodes early.
    pub migrating: bool,
    /// On the qemu engine, the requests go through the relay (QEMU's vhost-user-blk export)
    /// now, not NBD.
    pub relayed: bool,
    /// The relay may serve the drive: the spec relays (the default), its export is up, and
    /// nothing that drains QEMU's node is under way (a management command the QMP proxy
    /// holds, a block job): QEMU 10.0.2's export aborts or hangs when its node is drained
    /// with requests in flight.
    pub relay_wanted: bool,
}

/// Why a drive goes to (or is re-created on) the qemu engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToQemu {
    /// The policy wants QEMU's block layer.
    Decision,
    /// On the qemu engine, but acceld's export is gone (someone deleted it).
    ExportGone,
    /// On the qemu engine, and a throttle was added or removed: the graph must change.
    ThrottleChanged,
    /// On the qemu engine, and the export must move between QEMU's main loop and acceld's
    /// iothread.
    ExportContext,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Nothing to do.
    Stay,
    /// Direct is allowed, but the quiet period is not over.
    WaitQuiet,
    /// Serve the image directly. `lift_throttle`: QEMU throttles the drive now; lift its
    /// limits first, or the drain waits for every request the throttle holds back.
    ToDirect {
        spec: ServeSpec,
        lift_throttle: bool,
    },
    /// Serve through QEMU's block layer (again).
    ToQemu(ToQemu),
    /// New limits on the drive's throttle group: no switch needed.
    Retune(ThrottleLimits),
    /// Stay on the qemu engine, through the relay (`true`) or over NBD (`false`): an
    /// overlapped switch between QEMU's two exports of the same node.
    Repath { relay: bool },
}

/// What the executor does to the quiet timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    Keep,
    /// Start it unless it runs.
    Start,
    Stop,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub action: Action,
    pub timer: Timer,
}

fn plan_of(action: Action, timer: Timer) -> Plan {
    Plan { action, timer }
}

/// The plan for one drive.
pub fn plan(i: &PlanInput<'_>) -> Plan {
    if !i.has_device || i.migrating {
        // Nothing uses the socket: no QEMU node to move to or from. Or a migration: every
        // drive keeps its engine until it ends.
        return plan_of(Action::Stay, Timer::Keep);
    }
    match (i.decision, i.engine) {
        (Decision::Accelerate(_), EngineKind::Direct) => plan_of(Action::Stay, Timer::Stop),
        (Decision::Accelerate(spec), EngineKind::Held) => plan_of(
            Action::ToDirect {
                spec: spec.clone(),
                lift_throttle: false,
            },
            Timer::Keep,
        ),
        (Decision::Accelerate(spec), EngineKind::Qemu) => {
            let elapsed = match i.quiet {
                Quiet::NotRunning => Duration::ZERO,
                Quiet::Running(d) => d,
            };
            if !i.urgent && elapsed < i.quiet_period {
                return plan_of(Action::WaitQuiet, Timer::Start);
            }
            plan_of(
                Action::ToDirect {
                    spec: spec.clone(),
                    lift_throttle: i.applied_throttle.is_some(),
                },
                Timer::Start,
            )
        }
        (Decision::Qemu(_), EngineKind::Direct | EngineKind::Held) => {
            plan_of(Action::ToQemu(ToQemu::Decision), Timer::Stop)
        }
        (Decision::Qemu(_), EngineKind::Qemu) => {
            let action = if !i.export_present {
                Action::ToQemu(ToQemu::ExportGone)
            } else if i.export_context_stale {
                Action::ToQemu(ToQemu::ExportContext)
            } else {
                match (i.want_throttle, i.applied_throttle) {
                    (Some(w), Some(h)) if w != h => Action::Retune(w.clone()),
                    (Some(_), None) | (None, Some(_)) => Action::ToQemu(ToQemu::ThrottleChanged),
                    _ if i.relayed != i.relay_wanted => Action::Repath {
                        relay: i.relay_wanted,
                    },
                    _ => Action::Stay,
                }
            };
            plan_of(action, Timer::Stop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy::Reason;

    fn spec() -> ServeSpec {
        ServeSpec {
            image: "/img".into(),
            read_only: false,
            direct: true,
            discard: "unmap".into(),
            logical_block_size: 512,
            queues: 1,
            serial: None,
            block_device: false,
        }
    }

    fn lim(iops: u64) -> ThrottleLimits {
        ThrottleLimits {
            iops_total: Some(iops),
            ..Default::default()
        }
    }

    const Q: Duration = Duration::from_secs(1);

    struct Case {
        name: &'static str,
        accel: bool,
        engine: EngineKind,
        device: bool,
        want: Option<u64>,
        have: Option<u64>,
        export: bool,
        quiet: Quiet,
        urgent: bool,
        migrating: bool,
        relayed: bool,
        relay_wanted: bool,
        action: &'static str,
        timer: Timer,
    }

    fn run(c: &Case) -> Plan {
        let dec = if c.accel {
            Decision::Accelerate(spec())
        } else {
            Decision::Qemu(vec![Reason::Throttle])
        };
        let want = c.want.map(lim);
        let have = c.have.map(lim);
        plan(&PlanInput {
            decision: &dec,
            engine: c.engine,
            has_device: c.device,
            want_throttle: want.as_ref(),
            applied_throttle: have.as_ref(),
            export_present: c.export,
            export_context_stale: false,
            quiet: c.quiet,
            quiet_period: Q,
            urgent: c.urgent,
            migrating: c.migrating,
            relayed: c.relayed,
            relay_wanted: c.relay_wanted,
        })
    }

    fn name(a: &Action) -> String {
        match a {
            Action::Stay => "stay".into(),
            Action::WaitQuiet => "wait-quiet".into(),
            Action::ToDirect { lift_throttle, .. } => {
                format!("direct{}", if *lift_throttle { "+lift" } else { "" })
            }
            Action::ToQemu(ToQemu::Decision) => "qemu".into(),
            Action::ToQemu(ToQemu::ExportGone) => "qemu:export-gone".into(),
            Action::ToQemu(ToQemu::ThrottleChanged) => "qemu:throttle".into(),
            Action::ToQemu(ToQemu::ExportContext) => "qemu:context".into(),
            Action::Retune(l) => format!("retune:{}", l.iops_total.unwrap_or(0)),
            Action::Repath { relay: true } => "relay".into(),
            Action::Repath { relay: false } => "nbd".into(),
        }
    }

    use EngineKind::{Direct, Held, Qemu};
    use Quiet::{NotRunning, Running};
    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[rustfmt::skip]
    fn cases() -> Vec<Case> {
        let c = |name, accel, engine, device, want, have, export, quiet, urgent, action, timer| Case {
            name, accel, engine, device, want, have, export, quiet, urgent, migrating: false,
            relayed: false, relay_wanted: false, action, timer,
        };
        let m = |name, accel, engine, want, have, export, urgent| Case {
            name, accel, engine, device: true, want, have, export, quiet: NotRunning, urgent,
            migrating: true, relayed: true, relay_wanted: false, action: "stay", timer: Timer::Keep,
        };
        vec![
            // name                                  accel  engine device want     have     export quiet              urgent action              timer
            c("no device: nothing to move",          true,  Held,   false, None,    None,    false, NotRunning,        false, "stay",             Timer::Keep),
            c("no device, qemu wanted",              false, Direct, false, Some(5), None,    false, NotRunning,        true,  "stay",             Timer::Keep),
            c("direct and allowed",                  true,  Direct, true,  None,    None,    false, NotRunning,        false, "stay",             Timer::Stop),
            c("direct, a stale timer is stopped",    true,  Direct, true,  None,    None,    false, Running(MS(5)),    false, "stay",             Timer::Stop),
            c("held, allowed: direct at once",       true,  Held,   true,  None,    None,    false, NotRunning,        false, "direct",           Timer::Keep),
            c("qemu, allowed, quiet just started",   true,  Qemu,   true,  None,    None,    true,  NotRunning,        false, "wait-quiet",       Timer::Start),
            c("qemu, allowed, quiet running",        true,  Qemu,   true,  None,    None,    true,  Running(MS(999)),  false, "wait-quiet",       Timer::Start),
            c("qemu, allowed, quiet over",           true,  Qemu,   true,  None,    None,    true,  Running(MS(1000)), false, "direct",           Timer::Start),
            c("qemu, allowed, urgent",               true,  Qemu,   true,  None,    None,    true,  NotRunning,        true,  "direct",           Timer::Start),
            c("qemu, cleared throttle still on",     true,  Qemu,   true,  None,    Some(5), true,  Running(MS(2000)), false, "direct+lift",      Timer::Start),
            c("qemu, allowed, export gone: direct",  true,  Qemu,   true,  None,    None,    false, Running(MS(2000)), false, "direct",           Timer::Start),
            c("direct, qemu wanted",                 false, Direct, true,  None,    None,    false, NotRunning,        false, "qemu",             Timer::Stop),
            c("direct, throttle asked",              false, Direct, true,  Some(5), None,    false, NotRunning,        true,  "qemu",             Timer::Stop),
            c("held, qemu wanted",                   false, Held,   true,  None,    None,    false, NotRunning,        false, "qemu",             Timer::Stop),
            c("qemu, as wanted",                     false, Qemu,   true,  None,    None,    true,  NotRunning,        false, "stay",             Timer::Stop),
            c("qemu, quiet timer stopped",           false, Qemu,   true,  None,    None,    true,  Running(MS(500)),  false, "stay",             Timer::Stop),
            c("qemu, export deleted by someone",     false, Qemu,   true,  None,    None,    false, NotRunning,        false, "qemu:export-gone", Timer::Stop),
            c("qemu, export gone beats retune",      false, Qemu,   true,  Some(9), Some(5), false, NotRunning,        false, "qemu:export-gone", Timer::Stop),
            c("qemu, same throttle",                 false, Qemu,   true,  Some(5), Some(5), true,  NotRunning,        false, "stay",             Timer::Stop),
            c("qemu, new limits",                    false, Qemu,   true,  Some(9), Some(5), true,  NotRunning,        true,  "retune:9",         Timer::Stop),
            c("qemu, throttle added",                false, Qemu,   true,  Some(5), None,    true,  NotRunning,        true,  "qemu:throttle",    Timer::Stop),
            c("qemu, throttle removed, qcow2 stays", false, Qemu,   true,  None,    Some(5), true,  NotRunning,        false, "qemu:throttle",    Timer::Stop),
            // A migration freezes every drive where it is (each of these would move otherwise).
            // name                                  accel  engine want     have     export urgent
            m("migrating: direct stays direct",      false, Direct, Some(5), None,    false, true),
            m("migrating: held stays held",          true,  Held,   None,    None,    false, true),
            m("migrating: incoming, held for qemu",  false, Held,   None,    None,    false, false),
            m("migrating: qemu stays qemu",          true,  Qemu,   None,    Some(5), true,  true),
            m("migrating: export gone, no re-create",false, Qemu,   None,    None,    false, false),
            m("migrating: no retune",                false, Qemu,   Some(9), Some(5), true,  false),
        ]
    }

    #[test]
    fn table() {
        for c in cases() {
            let p = run(&c);
            assert_eq!(name(&p.action), c.action, "{}", c.name);
            assert_eq!(p.timer, c.timer, "{}", c.name);
        }
    }

    /// Every combination of the inputs: the rules that must hold whatever the case.
    #[test]
    fn every_combination_keeps_the_invariants() {
        let mut n = 0;
        for accel in [true, false] {
            for engine in [Held, Direct, Qemu] {
                for device in [true, false] {
                    for want in [None, Some(5), Some(9)] {
                        for have in [None, Some(5), Some(9)] {
                            for export in [true, false] {
                                for quiet in [NotRunning, Running(MS(10)), Running(MS(5000))] {
                                    for (urgent, migrating, relayed, relay_wanted) in
                                        [(true, false), (false, false), (true, true), (false, true)]
                                            .into_iter()
                                            .flat_map(|(u, m)| {
                                                [
                                                    (false, false),
                                                    (false, true),
                                                    (true, false),
                                                    (true, true),
                                                ]
                                                .map(|(r, w)| (u, m, r, w))
                                            })
                                    {
                                        let c = Case {
                                            name: "",
                                            accel,
                                            engine,
                                            device,
                                            want,
                                            have,
                                            export,
                                            quiet,
                                            urgent,
                                            migrating,
                                            relayed,
                                            relay_wanted,
                                            action: "",
                                            timer: Timer::Keep,
                                        };
                                        let p = run(&c);
                                        n += 1;
                                        let a = &p.action;
                                        if !device || migrating {
                                            assert_eq!(*a, Action::Stay);
                                            assert_eq!(p.timer, Timer::Keep);
                                            continue;
                                        }
                                        // Never direct against the rules, never QEMU when
                                        // direct is allowed.
                                        if !accel {
                                            assert!(!matches!(
                                                a,
                                                Action::ToDirect { .. } | Action::WaitQuiet
                                            ));
                                        } else {
                                            assert!(!matches!(
                                                a,
                                                Action::ToQemu(_) | Action::Retune(_)
                                            ));
                                        }
                                        // Retune and re-creation only on the qemu engine.
                                        if engine != Qemu {
                                            assert!(!matches!(
                                                a,
                                                Action::Retune(_)
                                                    | Action::ToQemu(
                                                        ToQemu::ExportGone
                                                            | ToQemu::ThrottleChanged
                                                    )
                                            ));
                                        }
                                        // A drive already where it belongs does nothing.
                                        if accel && engine == Direct {
                                            assert_eq!(*a, Action::Stay);
                                        }
                                        // Leaving the qemu engine waits for the quiet period
                                        // unless urgent.
                                        if accel && engine == Qemu {
                                            let over = quiet == Running(MS(5000));
                                            assert_eq!(
                                                matches!(a, Action::ToDirect { .. }),
                                                urgent || over
                                            );
                                        }
                                        if let Action::Retune(l) = a {
                                            assert_eq!(Some(l.clone()), want.map(lim));
                                            assert_ne!(want, have);
                                        }
                                        // A repath only on the qemu engine kept there, towards
                                        // what is wanted, and whenever nothing else is to do.
                                        if let Action::Repath { relay } = a {
                                            assert!(!accel && engine == Qemu);
                                            assert_eq!(*relay, relay_wanted);
                                            assert_ne!(relayed, relay_wanted);
                                        }
                                        if !accel && engine == Qemu && export && want == have {
                                            assert_eq!(
                                                matches!(a, Action::Repath { .. }),
                                                relayed != relay_wanted
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(n, 2 * 3 * 2 * 3 * 3 * 2 * 3 * 4 * 4);
    }

    #[test]
    fn export_in_the_wrong_context_is_re_created_on_the_qemu_engine_only() {
        let dec = Decision::Qemu(vec![Reason::BlockJob("backup".into())]);
        let input = |engine, export_present, stale, migrating| PlanInput {
            decision: &dec,
            engine,
            has_device: true,
            want_throttle: None,
            applied_throttle: None,
            export_present,
            export_context_stale: stale,
            quiet: Quiet::NotRunning,
            quiet_period: Q,
            urgent: false,
            migrating,
            relayed: false,
            relay_wanted: false,
        };
        let a = |i: PlanInput<'_>| name(&plan(&i).action);
        assert_eq!(a(input(Qemu, true, true, false)), "qemu:context");
        assert_eq!(a(input(Qemu, true, false, false)), "stay");
        // A missing export is re-created anyway (in the context asked for).
        assert_eq!(a(input(Qemu, false, true, false)), "qemu:export-gone");
        // Going to QEMU creates the export in the right context: nothing special.
        assert_eq!(a(input(Direct, false, true, false)), "qemu");
        // A migration moves nothing.
        assert_eq!(a(input(Qemu, true, true, true)), "stay");
    }

    /// Between the relay and NBD: only on the qemu engine, after any re-creation or throttle
    /// change (those bring the engine up again, on the path the executor then allows), never
    /// in a migration.
    #[test]
    fn the_qemu_engine_repaths_between_the_relay_and_nbd() {
        let dec = Decision::Qemu(vec![Reason::Format("qcow2".into())]);
        let five = lim(5);
        let nine = lim(9);
        type Row<'a> = (
            &'a str,
            EngineKind,
            bool,
            Option<&'a ThrottleLimits>,
            Option<&'a ThrottleLimits>,
            bool,
            bool,
            bool,
            &'a str,
        );
        #[rustfmt::skip]
        let cases: &[Row<'_>] = &[
            // name                                   engine  export want         have         migr   relayed wanted action
            ("relayed, a hold or a job: off to NBD",  Qemu,   true,  None,        None,        false, true,  false, "nbd"),
            ("on NBD, nothing drains: to the relay",  Qemu,   true,  None,        None,        false, false, true,  "relay"),
            ("relayed and wanted",                    Qemu,   true,  None,        None,        false, true,  true,  "stay"),
            ("on NBD, the relay not wanted",          Qemu,   true,  None,        None,        false, false, false, "stay"),
            ("throttled, same limits: repath",        Qemu,   true,  Some(&five), Some(&five), false, true,  false, "nbd"),
            ("export gone beats the repath",          Qemu,   false, None,        None,        false, true,  false, "qemu:export-gone"),
            ("a throttle change beats it",            Qemu,   true,  Some(&five), None,        false, true,  false, "qemu:throttle"),
            ("new limits first, repath next time",    Qemu,   true,  Some(&five), Some(&nine), false, false, true,  "retune:5"),
            ("a migration: the path stays",           Qemu,   true,  None,        None,        true,  true,  false, "stay"),
            ("direct: to the qemu engine first",      Direct, false, None,        None,        false, false, true,  "qemu"),
        ];
        for &(what, engine, export, want_t, have, migrating, relayed, relay_wanted, want) in cases {
            let got = plan(&PlanInput {
                decision: &dec,
                engine,
                has_device: true,
                want_throttle: want_t,
                applied_throttle: have,
                export_present: export,
                export_context_stale: false,
                quiet: Quiet::NotRunning,
                quiet_period: Q,
                urgent: false,
                migrating,
                relayed,
                relay_wanted,
            });
            assert_eq!(name(&got.action), want, "{what}");
        }
    }
}
