//! libFuzzer target: see `accel_fuzz::virtio_blk`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| accel_fuzz::virtio_blk(data));
