//! Tells crates that build kernels for the emulated device where the kernel language's C
//! headers are (`ferrotron_kernels.h`, and the thread context of cooperative kernels):
//! `DEP_FERROTRON_DEVICE_INCLUDE` in their build scripts.

fn main() {
    println!("cargo:rerun-if-changed=include");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:include={dir}/include");
}
