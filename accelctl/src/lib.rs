//! accelctl's library: the libvirt integration (emulator wrapper, hook, domain conversion),
//! shared by the `accelctl` and `accel-qemu` binaries.

pub mod libvirt;
