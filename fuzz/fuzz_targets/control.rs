//! libFuzzer target: see `accel_fuzz::control`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| accel_fuzz::control(data));
