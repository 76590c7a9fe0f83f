//! Holding drives on QEMU's block layer for a command that needs their nodes: one count per
//! drive, shared by every client of the VM's proxy, so that overlapping commands (two
//! clients, a VM snapshot and a job) neither release a drive early nor leave a pin behind.
//! Every hold also keeps the VM's drives off the relay (acceld's NBD export serves them
//! instead) while QEMU runs the command: QEMU 10.0.2's vhost-user-blk export aborts or hangs
//! when a command drains its node with requests in flight.

use std::collections::HashMap;

use accel_api::status::{EngineKind, PinKind};
use policy::Pin;
use tracing::warn;

use super::state::{Ctx, Entry};

/// What one command holds; give it back with [`release`].
#[must_use]
pub struct Held {
    drives: Vec<String>,
    /// The VM's relay hold ([`super::host::Host::hold_relay`]) was taken.
    relay: bool,
}

fn pin_of(p: Option<PinKind>) -> Option<Pin> {
    p.map(|p| match p {
        PinKind::Qemu => Pin::Qemu,
        PinKind::Direct => Pin::Direct,
    })
}

/// Puts the drives on the qemu engine (a temporary pin on the first hold) and keeps them
/// there until released. Fails, giving back what it took, if one cannot go; the error is
/// QEMU-shaped (class, text).
pub async fn hold(
    ctx: &Ctx,
    drives: &[String],
    why: &str,
) -> Result<Held, super::message::QmpError> {
    if let Err(e) = ctx.sup.hold_relay(&ctx.vm, true).await {
        return Err(super::message::QmpError::generic(format!(
            "acceld: cannot move the VM's drives off the relay for {why}: {}",
            e.chain()
        )));
    }
    let mut taken = Held {
        drives: Vec::new(),
        relay: true,
    };
    for drive in drives {
        if taken.drives.contains(drive) {
            continue;
        }
        let mut map = ctx.shared.holds.held.lock().await;
        if let Err(e) = take(ctx, &mut map, drive, why).await {
            drop(map);
            release(ctx, taken).await;
            return Err(e);
        }
        taken.drives.push(drive.clone());
    }
    Ok(taken)
}

/// One more holder of `drive`: the first puts it on the qemu engine (a temporary pin).
async fn take(
    ctx: &Ctx,
    map: &mut HashMap<String, Entry>,
    drive: &str,
    why: &str,
) -> Result<(), super::message::QmpError> {
    if let Some(e) = map.get_mut(drive) {
        e.holders += 1;
        return Ok(());
    }
    let status = ctx.drives().into_iter().find(|d| d.drive == drive);
    let prev = status.as_ref().and_then(|d| pin_of(d.pin));
    let prev_persistent = status.as_ref().is_some_and(|d| d.pin_persistent);
    let r = if prev == Some(Pin::Qemu) {
        Ok(None)
    } else {
        ctx.sup
            .set_pin(&ctx.vm, drive, Some(Pin::Qemu), false)
            .await
            .map_err(|e| e.chain())
            .and_then(|s| {
                // Held: acceld serves nothing and has the image closed (an incoming VM's
                // drive before its start, say, where libvirt's copy-storage exports the node
                // for the source's mirror): QEMU's node is the only user already. The pin
                // stays until the release, so a start meanwhile puts it on the qemu engine.
                if matches!(s.engine, EngineKind::Qemu | EngineKind::Held) {
                    Ok(Some((prev, prev_persistent)))
                } else {
                    Err(format!("it stayed on the {:?} engine", s.engine))
                }
            })
    };
    match r {
        Ok(changed) => {
            map.insert(
                drive.to_string(),
                Entry {
                    holders: 1,
                    restore: changed,
                },
            );
            Ok(())
        }
        Err(why_not) => {
            // Undo the pin set by the failed attempt (the caller gives back the rest).
            let _ = ctx.sup.set_pin(&ctx.vm, drive, prev, prev_persistent).await;
            Err(super::message::QmpError::generic(format!(
                "acceld: cannot move drive '{drive}' to QEMU's block layer for {why}: {why_not}"
            )))
        }
    }
}

/// Gives the drives back: the last holder restores the pin each had (the policy then decides
/// whether the drive goes back to direct: a job, an overlay or an export keep it in QEMU).
pub async fn release(ctx: &Ctx, held: Held) {
    for drive in held.drives {
        let mut map = ctx.shared.holds.held.lock().await;
        let Some(e) = map.get_mut(&drive) else {
            continue;
        };
        e.holders -= 1;
        if e.holders > 0 {
            continue;
        }
        let changed = e.restore;
        map.remove(&drive);
        if let Some((prev, persistent)) = changed {
            if let Err(e) = ctx.sup.set_pin(&ctx.vm, &drive, prev, persistent).await {
                if let Some(n) = ctx.shared.log.admit() {
                    warn!(vm = %ctx.vm, drive, "QMP proxy: cannot release the drive: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
                }
            }
        }
    }
    if held.relay {
        if let Err(e) = ctx.sup.hold_relay(&ctx.vm, false).await {
            if let Some(n) = ctx.shared.log.admit() {
                warn!(vm = %ctx.vm, "QMP proxy: cannot put the drives back on the relay: {}{}", e.chain(), accel_dataplane::util::suppressed(n));
            }
        }
    }
}
