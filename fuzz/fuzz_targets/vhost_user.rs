//! libFuzzer target: see `accel_fuzz::vhost_user`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| accel_fuzz::vhost_user(data));
