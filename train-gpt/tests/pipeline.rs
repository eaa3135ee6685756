//! The demo under pipeline parallelism: every schedule trains what one rank trains, and
//! layouts that cannot work are refused before any rank starts, saying what would.

mod common;

use common::words;
use std::process::Command;

/// Runs a small model with `args` (no validation and a scratch --out unless they say);
/// returns success, stdout and stderr.
fn train(args: &[&str]) -> (bool, String, String) {
    let scratch = std::env::temp_dir().join("train-gpt-pipeline");
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-gpt"));
    command
        .args([
            "--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "16",
        ])
        .args(["--batch", "4"]);
    if !args.contains(&"--steps") {
        command.args(["--steps", "3"]);
    }
    if !args.contains(&"--eval-interval") {
        command.args(["--eval-interval", "0"]);
    }
    if !args.contains(&"--out") {
        command.arg("--out").arg(&scratch);
    }
    let output = command
        .args(args)
        .output()
        .expect("the train-gpt binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Two stages, two chunks each, interleaved.
const INTERLEAVED: &str =
    "--pp 2 --tp 1 --dp 1 --schedule interleaved --virtual-stages 2 --microbatches 2";

/// The figure of `--check`'s `max loss difference: X` line.
fn loss_difference(stdout: &str) -> f32 {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("max loss difference: "))
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no loss difference in {stdout}"))
}

#[test]
fn every_schedule_trains_what_one_rank_trains() {
    for flags in [
        "--pp 2 --tp 2 --dp 1 --microbatches 2",
        "--pp 2 --tp 1 --dp 2 --schedule gpipe --microbatches 4",
        INTERLEAVED,
        "--pp 4 --tp 1 --dp 2 --microbatches 4",
        // AdamW sharded over DP, across the chunks of an interleaved schedule.
        "--pp 2 --tp 2 --dp 2 --schedule interleaved --virtual-stages 2 --microbatches 2 \
         --use-distributed-optimizer",
        // The GPU code path: activations received from a stage go to the device.
        "--pp 2 --tp 2 --dp 1 --microbatches 2 --sequence-parallel --device emulated",
        // GPipe's last forward sends beside the first backward's receive, where the next
        // stage receives alone: device data and host headers in mixed batches.
        "--pp 2 --tp 1 --dp 1 --schedule gpipe --microbatches 2 --device emulated",
    ] {
        let layout = words(flags);
        let (ok, stdout, stderr) = train(&[&layout[..], &["--check"]].concat());
        assert!(ok, "{layout:?}: {stderr}");
        let difference = loss_difference(&stdout);
        assert!(difference < 1e-4, "{layout:?}: {difference}");
    }
}

/// The held-out loss, evaluated through the stages forward only, is the one-stage run's.
#[test]
fn validation_through_the_pipeline_matches_one_stage() {
    let validation = |layout: &[&str], out: &str| -> Vec<f32> {
        let dir = std::env::temp_dir().join(out);
        let out = dir.to_string_lossy().into_owned();
        let (ok, _, stderr) = train(&[layout, &["--eval-interval", "1", "--out", &out]].concat());
        assert!(ok, "{layout:?}: {stderr}");
        let csv = std::fs::read_to_string(dir.join("validation.csv")).unwrap();
        csv.lines()
            .skip(1)
            .map(|line| line.split(',').nth(1).unwrap().parse().unwrap())
            .collect()
    };
    let one = validation(&["--tp", "1", "--dp", "1"], "train-gpt-pipeline-pp1");
    let interleaved = validation(&words(INTERLEAVED), "train-gpt-pipeline-pp2");
    assert_eq!(one.len(), 3);
    assert_eq!(one.len(), interleaved.len());
    for (a, b) in one.iter().zip(&interleaved) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn layouts_that_cannot_work_are_refused_with_what_would() {
    let cases = [
        ("--pp 3", "valid --pp × --virtual-stages: 1, 2, 4"),
        ("--pp 2 --microbatches 3", "valid: 1, 2, 4"),
        ("--pp 2 --virtual-stages 2", "needs --schedule interleaved"),
        (
            "--pp 2 --schedule interleaved --virtual-stages 2 --microbatches 1",
            "not a multiple of 2",
        ),
    ];
    for (flags, message) in cases {
        let args = words(flags);
        let (ok, _, stderr) = train(&args);
        assert!(!ok, "{args:?} must fail");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// `--clip-grad` adds the squared gradients over tensor and pipeline ranks (and, with the
/// distributed optimizer, data-parallel shards) as one rank would: the clipped run equals
/// its one-rank check, and differs from the unclipped run.
#[test]
fn clipping_under_every_axis_trains_what_one_rank_trains() {
    // Six steps: AdamW's first updates hardly depend on a gradient's scale, so clipping
    // shows in the printed losses only once its factor has varied between steps.
    let layout = words("--pp 2 --tp 2 --dp 2 --microbatches 2 --steps 6");
    let run = |extra: &[&str], out: &str| {
        let dir = std::env::temp_dir().join(out);
        let dir = dir.to_string_lossy().into_owned();
        let (ok, stdout, stderr) = train(&[&layout[..], extra, &["--out", &dir]].concat());
        assert!(ok, "{extra:?}: {stderr}");
        stdout
    };
    let clipped = run(&["--clip-grad", "0.05", "--check"], "train-gpt-clipped");
    let difference = loss_difference(&clipped);
    assert!(difference < 1e-4, "clipped: {difference}");
    // The distributed optimizer clips its reduced shards to the same norm.
    let sharded = [
        "--clip-grad",
        "0.05",
        "--check",
        "--use-distributed-optimizer",
    ];
    let difference = loss_difference(&run(&sharded, "train-gpt-clipped-sharded"));
    assert!(
        difference < 1e-4,
        "clipped, sharded optimizer: {difference}"
    );
    // AdamW's step barely depends on a gradient's scale, so look at every digit.
    run(&[], "train-gpt-unclipped");
    let curve = |out: &str| {
        std::fs::read_to_string(std::env::temp_dir().join(out).join("loss.csv")).expect("loss.csv")
    };
    assert_ne!(
        curve("train-gpt-clipped"),
        curve("train-gpt-unclipped"),
        "--clip-grad changed nothing"
    );
}

/// Receives posted one exchange ahead (`--overlap-p2p-comm`) train the same bits, and on
/// the emulated device's modelled timeline the stage that receives activations copies
/// them beside its backward instead of after it, so a step takes less modelled time.
#[test]
fn receives_posted_ahead_train_the_same_bits_in_less_modelled_time() {
    let run = |extra: &[&str]| {
        let flags = [
            &[
                "--device", "emulated", "--pp", "2", "--tp", "1", "--dp", "1",
            ][..],
            &["--microbatches", "4"],
            extra,
        ]
        .concat();
        let (ok, stdout, stderr) = train(&flags);
        assert!(ok, "{flags:?}: {stderr}");
        let step: f64 = (stdout.lines())
            .find_map(|l| l.strip_prefix("modelled step time: ")?.strip_suffix(" µs"))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no modelled step time in\n{stdout}"));
        let losses: Vec<String> = (stdout.lines())
            .filter(|l| l.starts_with("train step"))
            .map(|l| l.split(" | ").next().unwrap_or_default().to_string())
            .collect();
        (losses, step)
    };
    let (batched, batched_step) = run(&[]);
    let (ahead, ahead_step) = run(&["--overlap-p2p-comm"]);
    assert_eq!(batched, ahead);
    assert!(batched.len() == 3, "{batched:?}");
    assert!(
        ahead_step < batched_step,
        "modelled step {ahead_step} µs with receives posted ahead, {batched_step} µs without"
    );
}
