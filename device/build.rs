//! Tells crates that build cooperative kernels for the emulated device where the C header
//! of its thread context is (`DEP_FERROTRON_DEVICE_INCLUDE` in their build scripts).

fn main() {
    println!("cargo:rerun-if-changed=include/ferrotron_blocks.h");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:include={dir}/include");
}
