//! libFuzzer target: see `accel_fuzz::nbd_reply`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| accel_fuzz::nbd_reply(data));
