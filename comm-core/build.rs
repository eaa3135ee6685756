//! With the `mpi` feature, compiles the tiny C shim that exports `MPI_IN_PLACE` from the
//! system's `mpi.h` (the same MPI installation rsmpi links against).

fn main() {
    println!("cargo:rerun-if-changed=csrc/mpi_in_place.c");
    #[cfg(feature = "mpi")]
    compile_mpi_shim();
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
