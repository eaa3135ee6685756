//! Compiles the device kernels as C for the emulator device (no CUDA needed).

fn main() {
    println!("cargo:rerun-if-changed=csrc/emulator.c");
    println!("cargo:rerun-if-changed=src/gpu/kernels");
    // The emulated thread of cooperative kernels (`ferrotron_blocks.h`), from the device
    // crate's `links` metadata.
    let device = std::env::var("DEP_FERROTRON_DEVICE_INCLUDE")
        .expect("ferrotron-device's build script names its include directory");
    println!("cargo:rerun-if-changed={device}");
    cc::Build::new()
        .file("csrc/emulator.c")
        .include("src/gpu/kernels")
        .include(device)
        .flag_if_supported("-std=c11")
        // No contraction into FMAs: results stay comparable with the CPU path's.
        .flag_if_supported("-ffp-contract=off")
        .warnings(true)
        .compile("ferrotron_gpu_emulator");
}
