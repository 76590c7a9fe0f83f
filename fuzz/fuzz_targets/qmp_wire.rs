//! libFuzzer target: see `accel_fuzz::qmp_wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| accel_fuzz::qmp_wire(data));
