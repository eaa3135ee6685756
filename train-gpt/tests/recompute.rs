//! `--recompute-granularity full|selective`: the demo trains the same losses, bit for
//! bit, whether blocks keep their activations or recompute them (or their attention
//! cores) in backward, with dropout on, under tensor, sequence and pipeline parallelism;
//! and its measured peak shows what that saves.

mod common;

use common::{bytes_after, memory_run, rows, scratch};
use std::process::Command;

const SMALL: &str = "--layers 4 --hidden 16 --heads 2 --seq 16 --steps 4 --eval-interval 2 \
                     --hidden-dropout 0.1 --attention-dropout 0.1";

fn train(layout: &str, recompute: &str, out: &std::path::Path) {
    let args: Vec<&str> = [SMALL, layout, recompute]
        .join(" ")
        .leak()
        .split_whitespace()
        .collect();
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(&args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("the train-gpt binary runs");
    assert!(
        output.status.success(),
        "train-gpt {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn recomputed_blocks_train_the_same_losses_bit_for_bit() {
    let root = scratch("recompute");
    for (name, layout) in [
        ("tp2dp2", "--tp 2 --dp 2"),
        ("sp", "--tp 2 --dp 1 --sequence-parallel"),
        ("pp2", "--tp 1 --dp 1 --pp 2 --microbatches 2"),
    ] {
        let kept = root.join(format!("{name}-kept"));
        train(layout, "", &kept);
        for (method, flags) in [
            (
                "uniform",
                "full --recompute-method uniform --recompute-num-layers 2",
            ),
            (
                "block",
                "full --recompute-method block --recompute-num-layers 1",
            ),
            ("selective", "selective"),
        ] {
            let out = root.join(format!("{name}-{method}"));
            train(layout, &format!("--recompute-granularity {flags}"), &out);
            for file in ["loss.csv", "validation.csv"] {
                assert_eq!(
                    rows(&out.join(file)),
                    rows(&kept.join(file)),
                    "{name}, {method}: {file}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

/// `measured peak per rank` from a run with `flags`.
fn peak(flags: &str) -> usize {
    bytes_after(&memory_run(flags), "measured peak per rank: ")
}

/// What each pipeline stage held beyond its model state at its peak, from the line
/// `measured peak per pipeline stage: stage 0 P bytes (model state S), stage 1 ...`.
fn held_per_stage(stdout: &str) -> Vec<f64> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("measured peak per pipeline stage: "))
        .unwrap_or_else(|| panic!("no per-stage line: {stdout}"));
    line.split(", ")
        .map(|stage| {
            let numbers: Vec<f64> = stage
                .split([' ', ')'])
                .filter_map(|word| word.parse().ok())
                .collect();
            // [stage, peak, model state]
            numbers[1] - numbers[2]
        })
        .collect()
}

/// The measured peak shows what recomputation and the 1F1B schedule trade: recomputing
/// every block holds well under half the activations; recomputing the unfused attention
/// cores less (the fused core, the default, keeps none to recompute, and holds less than
/// the unfused one); and 1F1B's first stage holds at most two microbatches' activations
/// where GPipe's holds all eight.
#[test]
fn the_measured_peak_falls_with_recomputation_and_with_1f1b() {
    let kept = peak("--tp 1 --dp 1");
    let full = "--recompute-granularity full --recompute-method uniform";
    let recomputed = peak(&format!("--tp 1 --dp 1 {full}"));
    assert!(
        2 * recomputed < kept,
        "recomputed {recomputed}, kept {kept}"
    );
    let unfused = peak("--tp 1 --dp 1 --attention unfused");
    let selective = peak("--tp 1 --dp 1 --attention unfused --recompute-granularity selective");
    assert!(
        recomputed < selective && selective < unfused,
        "selective {selective}, unfused {unfused}"
    );
    assert!(kept < unfused, "fused {kept}, unfused {unfused}");
    let gpipe = peak("--tp 1 --dp 1 --pp 2 --microbatches 8 --schedule gpipe");
    let one_f_one_b = peak("--tp 1 --dp 1 --pp 2 --microbatches 8 --schedule 1f1b");
    assert!(2 * one_f_one_b < gpipe, "1F1B {one_f_one_b}, GPipe {gpipe}");
}

/// Each pipeline stage holds the microbatches its schedule keeps in flight. With one
/// block on each of four stages and eight microbatches, GPipe's stages hold all eight
/// and 1F1B's stage i holds 4 − i; on the middle stages (no embedding, no head) GPipe
/// therefore holds 5 and 6 microbatches more than 1F1B, in units of what 1F1B's stage 1
/// holds beyond its stage 2 (one microbatch of one block).
#[test]
fn each_pipeline_stage_holds_the_microbatches_its_schedule_keeps_in_flight() {
    let stages = |schedule: &str| {
        let flags = format!("--tp 1 --dp 1 --pp 4 --microbatches 8 --schedule {schedule}");
        held_per_stage(&memory_run(&flags))
    };
    let (gpipe, one_f_one_b) = (stages("gpipe"), stages("1f1b"));
    let microbatch = one_f_one_b[1] - one_f_one_b[2];
    for (stage, expected) in [(1, 5.0), (2, 6.0)] {
        let more = (gpipe[stage] - one_f_one_b[stage]) / microbatch;
        assert!(
            (more - expected).abs() < 0.5,
            "stage {stage}: GPipe held {more:.2} microbatches more than 1F1B, not {expected} \
             (GPipe {gpipe:?}, 1F1B {one_f_one_b:?})"
        );
    }
}
