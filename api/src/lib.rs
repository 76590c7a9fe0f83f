//! accel's public API: the control-socket protocol of `acceld run` ([`control`]) and the typed
//! status it reports ([`status`]). Shared by acceld, accelctl and the libvirt hook, so none of
//! them links the daemon to speak to it.

pub mod control;
pub mod convert;
pub mod fdpass;
pub mod status;

/// An error and its sources on one line ("a: b: c"), as errors are printed at the top.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}
