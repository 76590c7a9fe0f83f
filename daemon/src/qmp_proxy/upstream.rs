//! Commands to QEMU over acceld's one QMP connection to the VM.

use std::time::Duration;

use serde_json::{Map, Value};

use super::message::{ErrorClass, QmpError, Reply};
use super::state::Ctx;

/// A forwarded command may take long (savevm, a big transaction): QEMU's own monitor has no
/// timeout at all.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(3600);

/// How a command goes to QEMU.
pub(super) enum Via<'a> {
    InBand,
    /// With a file descriptor attached (SCM_RIGHTS).
    Fd(&'a std::os::fd::OwnedFd),
    /// As `exec-oob`.
    OutOfBand,
}

/// Sends a command to QEMU over acceld's connection; QEMU's answer, error class and text
/// included.
pub(super) async fn upstream(
    ctx: &Ctx,
    name: &str,
    args: Option<Map<String, Value>>,
    via: Via<'_>,
) -> Reply {
    use std::os::fd::AsFd;
    let qmp = ctx
        .sup
        .vm_qmp(&ctx.vm)
        .map_err(|e| QmpError::generic(format!("acceld's QMP proxy: {}", e.chain())))?;
    let args = args.map(Value::Object);
    let r = match via {
        Via::InBand => qmp.execute_raw_timeout(name, args, FORWARD_TIMEOUT).await,
        Via::Fd(fd) => {
            qmp.execute_raw_with_fd(name, args, FORWARD_TIMEOUT, fd.as_fd())
                .await
        }
        Via::OutOfBand => qmp.execute_oob_raw(name, args, FORWARD_TIMEOUT).await,
    };
    match r {
        Ok(v) => Ok(v),
        Err(qmp_client::QmpError::Qemu { class, desc, .. }) => {
            Err(QmpError::new(ErrorClass::parse(&class), desc))
        }
        Err(e) => Err(QmpError::generic(format!(
            "acceld's QMP proxy: QEMU did not answer: {e}"
        ))),
    }
}

/// Forwards a command to QEMU as it is; QEMU's answer, error class and text included.
pub(crate) async fn forward(ctx: &Ctx, name: &str, args: Option<Map<String, Value>>) -> Reply {
    upstream(ctx, name, args, Via::InBand).await
}
