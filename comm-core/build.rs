//! Compiles comm-core's kernels (`src/kernels`) as C for the emulated device, with the
//! device crate's kernel language (`DEP_FERROTRON_DEVICE_INCLUDE`); with the `mpi`
//! feature, also the tiny C shim that exports `MPI_IN_PLACE` from the system's `mpi.h`
//! (the same MPI installation rsmpi links against).

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-changed=src/kernels");
    compile_kernels();
    #[cfg(feature = "mpi")]
    compile_mpi_shim();
}

fn compile_kernels() {
    let device = std::env::var("DEP_FERROTRON_DEVICE_INCLUDE")
        .expect("ferrotron-device's build script names its include directory");
    println!("cargo:rerun-if-changed={device}");
    cc::Build::new()
        .file("csrc/kernels.c")
        .include("src/kernels")
        .include(device)
        .flag_if_supported("-std=c11")
        // No contraction into FMAs: the results are the CUDA build's (products rounded on
        // their own there).
        .flag_if_supported("-ffp-contract=off")
        .warnings(true)
        .compile("ferrotron_comm_kernels");
}

#[cfg(feature = "mpi")]
fn compile_mpi_shim() {
    let library = match build_probe_mpi::probe() {
        Ok(library) => library,
        Err(errors) => panic!(
            "the `mpi` feature needs an MPI installation (Debian: apt-get install \
             libopenmpi-dev openmpi-bin libclang-dev): {errors:?}"
        ),
    };
    let mut build = cc::Build::new();
    build.file("csrc/mpi_in_place.c");
    for path in &library.include_paths {
        build.include(path);
    }
    build.compile("ferrotron_mpi_shim");
}
