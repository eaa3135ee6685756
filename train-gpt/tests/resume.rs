//! The demo's checkpoints: a run saved at step k and resumed to step N writes the same
//! `loss.csv` rows as the uninterrupted run, bit for bit at the same layout, and closely
//! at another tensor-parallel size; mistakes in resuming are clear errors.

mod common;

use common::{rows, scratch};
use std::path::Path;
use std::process::{Command, Output};

/// A model small enough for a debug build: one block, hidden 16, 16-byte context.
const SMALL: &[&str] = &[
    "--layers",
    "1",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq",
    "16",
    "--eval-interval",
    "3",
];

/// Runs the demo with [`SMALL`]'s sizes, except those `args` set.
fn train(args: &[&str]) -> Output {
    let defaults = SMALL
        .chunks(2)
        .filter(|pair| !args.contains(&pair[0]))
        .flatten();
    Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(defaults)
        .args(args)
        .output()
        .expect("the train-gpt binary runs")
}

fn succeed(args: &[&str]) {
    let output = train(args);
    assert!(
        output.status.success(),
        "train-gpt {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn losses(path: &Path) -> Vec<f32> {
    rows(path)[1..]
        .iter()
        .map(|row| {
            row.split(',')
                .nth(1)
                .and_then(|l| l.parse().ok())
                .expect("step,loss")
        })
        .collect()
}

#[test]
fn a_resumed_run_writes_the_uninterrupted_runs_losses() {
    let root = scratch("resume");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    succeed(&["--steps", "6", "--out", &dir("A")]);
    succeed(&["--steps", "3", "--save", &dir("C"), "--out", &dir("B")]);
    succeed(&["--steps", "6", "--resume", &dir("C"), "--out", &dir("B2")]);

    let (whole, resumed) = (
        rows(&root.join("A/loss.csv")),
        rows(&root.join("B2/loss.csv")),
    );
    assert_eq!(whole.len(), 7, "a header and 6 steps: {whole:?}");
    assert_eq!(resumed, whole, "same layout: bit-identical rows");
    assert_eq!(
        rows(&root.join("B2/validation.csv")),
        rows(&root.join("A/validation.csv")),
        "validation at steps 3 and 6"
    );

    // Another tensor-parallel size (the same global batch of 16) continues from the same
    // weights and optimizer state: the same curve up to f32 rounding.
    succeed(&[
        "--steps",
        "6",
        "--tp",
        "1",
        "--dp",
        "4",
        "--batch",
        "4",
        "--resume",
        &dir("C"),
        "--out",
        &dir("T1"),
    ]);
    let (reference, other) = (
        losses(&root.join("A/loss.csv")),
        losses(&root.join("T1/loss.csv")),
    );
    assert_eq!(other[..3], reference[..3], "the saved history");
    for (step, (a, b)) in reference.iter().zip(&other).enumerate().skip(3) {
        assert!((a - b).abs() < 1e-4, "step {}: {a} vs {b}", step + 1);
    }
    std::fs::remove_dir_all(&root).ok();
}

/// The distributed optimizer saves the whole AdamW state: its run resumes at another
/// data-parallel size, sharded or not, on the curve of the uninterrupted plain run.
#[test]
fn a_distributed_optimizer_run_resumes_at_another_dp_size_and_unsharded() {
    let root = scratch("zero");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    let zero = "--use-distributed-optimizer";
    succeed(&["--steps", "6", "--out", &dir("A")]);
    succeed(&[
        "--steps",
        "3",
        zero,
        "--save",
        &dir("C"),
        "--out",
        &dir("B"),
    ]);
    // The global batch stays 16: 4 ranks of 4, then 1 rank of 16.
    let dp4 = ["--dp", "4", "--batch", "4"];
    succeed(
        &[
            &dp4[..],
            &[
                "--steps",
                "6",
                zero,
                "--resume",
                &dir("C"),
                "--out",
                &dir("D4"),
            ],
        ]
        .concat(),
    );
    let dp1 = ["--dp", "1", "--batch", "16"];
    succeed(
        &[
            &dp1[..],
            &["--steps", "6", "--resume", &dir("C"), "--out", &dir("D1")],
        ]
        .concat(),
    );
    let reference = losses(&root.join("A/loss.csv"));
    for run in ["B", "D4", "D1"] {
        let curve = losses(&root.join(run).join("loss.csv"));
        assert_eq!(curve.len(), if run == "B" { 3 } else { 6 }, "{run}");
        for (step, (a, b)) in reference.iter().zip(&curve).enumerate() {
            assert!((a - b).abs() < 1e-4, "{run} step {}: {a} vs {b}", step + 1);
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Under pipeline parallelism each stage saves and restores its own chunks: the resumed
/// interleaved run is the uninterrupted one, row for row; at another --pp it is refused.
#[test]
fn a_pipelined_run_resumes_exactly_at_its_layout_and_closely_at_any_other() {
    let root = scratch("resume-pp");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    let (a, b, b2, c) = (dir("A"), dir("B"), dir("B2"), dir("C"));
    // TP 2 × PP 2 × DP 2, ZeRO, interleaved with two chunks per stage: 8 ranks.
    let saved_layout = "--pp 2 --tp 2 --dp 2 --batch 4 --schedule interleaved \
                        --virtual-stages 2 --microbatches 2 --use-distributed-optimizer";
    let run = |layout: &str, extra: &[&str]| {
        let layout: Vec<&str> = layout.split_whitespace().collect();
        succeed(&[&["--layers", "4", "--heads", "4"], &layout[..], extra].concat())
    };
    run(saved_layout, &["--steps", "6", "--out", &a]);
    run(saved_layout, &["--steps", "3", "--save", &c, "--out", &b]);
    run(
        saved_layout,
        &["--steps", "6", "--resume", &c, "--out", &b2],
    );
    assert_eq!(
        rows(&root.join("B2/loss.csv")),
        rows(&root.join("A/loss.csv"))
    );
    assert_eq!(
        rows(&root.join("B2/validation.csv")),
        rows(&root.join("A/validation.csv"))
    );
    // The same global batch (8 sequences) at other layouts: layers re-cut over the new
    // stages, shards over the new TP size, optimizer state over the new DP size.
    let reference = losses(&root.join("A/loss.csv"));
    for (name, layout) in [
        ("pp4", "--tp 1 --pp 4 --dp 2 --batch 4 --microbatches 4"),
        ("tp4", "--tp 4 --pp 1 --dp 2 --batch 4"),
        ("dp8", "--tp 1 --pp 1 --dp 8 --batch 1"),
    ] {
        let out = dir(name);
        run(layout, &["--steps", "6", "--resume", &c, "--out", &out]);
        let curve = losses(&Path::new(&out).join("loss.csv"));
        assert_eq!(curve[..3], reference[..3], "{name}: the saved steps");
        for (step, (x, y)) in curve.iter().zip(&reference).enumerate().skip(3) {
            assert!(
                (x - y).abs() <= 1e-4,
                "{name}, step {}: {x} against {y}",
                step + 1
            );
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn resume_mistakes_are_reported() {
    let root = scratch("mistakes");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    succeed(&["--steps", "2", "--save", &dir("C"), "--out", &dir("B")]);
    let checkpoint = dir("C");
    let cases: [(&[&str], &str); 3] = [
        (&["--steps", "2"], "already at step 2"),
        (&["--steps", "4", "--batch", "3"], "global batches of 16"),
        (&["--steps", "4", "--hidden", "32"], "--hidden 16"),
    ];
    for (args, expected) in cases {
        let mut args = args.to_vec();
        args.extend(["--resume", &checkpoint]);
        let output = train(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    let empty = dir("empty");
    std::fs::create_dir_all(&empty).ok();
    let output = train(&["--steps", "4", "--resume", &empty]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("no complete checkpoint"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&root).ok();
}
