//! Runs that cannot go on stop with a message saying why and what to change, and a
//! non-zero exit code, instead of training on.

use std::process::Command;

fn train(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args([
            "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "16",
        ])
        .args([
            "--out",
            &std::env::temp_dir()
                .join("train-gpt-failures")
                .to_string_lossy(),
        ])
        .args(args)
        .output()
        .expect("the train-gpt binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_diverging_run_stops_at_the_first_non_finite_loss() {
    let (ok, stderr) = train(&["--lr", "1e9", "--steps", "5"]);
    assert!(!ok, "a NaN loss must not exit 0");
    assert!(
        stderr.contains("training diverged") && stderr.contains("lower --lr"),
        "{stderr}"
    );
    // Clipping is on by default, so the message says how hard it clips.
    assert!(
        stderr.contains("clip harder (--clip-grad, now 1)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the loss is NaN") || stderr.contains("the loss is inf"),
        "{stderr}"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn the_mpi_backend_without_mpirun_says_how_to_launch() {
    let (ok, stderr) = train(&["--backend", "mpi", "--steps", "1"]);
    assert!(!ok);
    assert!(stderr.contains("mpirun -n 4"), "{stderr}");
}

#[test]
fn a_profile_on_the_cpu_is_refused() {
    let (ok, stderr) = train(&["--profile", "--steps", "2"]);
    assert!(!ok);
    assert!(
        stderr.contains("--profile counts device kernels") && stderr.contains("--device"),
        "{stderr}"
    );
}

#[test]
fn overlapping_a_parameter_gather_without_the_distributed_optimizer_is_refused() {
    let (ok, stderr) = train(&["--overlap-param-gather", "--steps", "1"]);
    assert!(!ok);
    assert!(
        stderr.contains("--overlap-param-gather") && stderr.contains("--use-distributed-optimizer"),
        "{stderr}"
    );
}

#[test]
fn zero_threads_per_rank_is_refused() {
    let (ok, stderr) = train(&["--threads", "0", "--steps", "1"]);
    assert!(!ok);
    assert!(stderr.contains("at least one thread"), "{stderr}");
}

/// Without a GPU (as in CI) `--backend nccl` stops before training, naming the driver,
/// library or device that is missing; with one, it trains.
#[test]
fn the_nccl_backend_without_a_gpu_names_what_is_missing() {
    let (ok, stderr) = train(&["--backend", "nccl", "--steps", "1"]);
    assert!(!ok && stderr.contains("pass --device cuda:N"), "{stderr}");
    let (ok, stderr) = train(&["--backend", "nccl", "--device", "cuda:0", "--steps", "1"]);
    if ok {
        println!("a GPU and NCCL are present: the run trained");
        return;
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        ["libcuda", "libnccl", "CUDA device"]
            .iter()
            .any(|missing| stderr.contains(missing)),
        "{stderr}"
    );
}
