//! Mixtures of experts in the demo: `--num-experts` runs with expert parallelism match one
//! rank (`--check`, which runs each data-parallel rank's rows as a microbatch of their own,
//! as the experts route them) composed with tensor (and sequence), data, pipeline and
//! context parallelism, top-1 and top-2, the load-balancing and z-losses, a capacity factor and
//! bf16, clipped, with the distributed optimizer and a shared expert; each step reports the routing; a run
//! saved at one expert-parallel size continues at others (and sharded); a dense GPT-2
//! checkpoint upcycles into experts computing the same loss; bad sizes are refused.

mod common;

use common::{figure, fresh, words};
use std::process::Command;

fn run(flags: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(words(flags))
        .output()
        .expect("the train-gpt binary runs")
}

fn succeed(flags: &str) -> String {
    let output = run(flags);
    common::succeeded(&output)
}

/// Runs `flags`, which must fail with a message containing `needle`.
fn refused(flags: &str, needle: &str) {
    let output = run(flags);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{flags} ran");
    assert!(stderr.contains(needle), "{flags}: {stderr}");
}

#[test]
fn expert_parallel_runs_match_one_rank() {
    let out = fresh("experts-check");
    let out = out.display();
    for (layout, tolerance) in [
        // The README's command with the flags.
        ("--num-experts 4 --expert-parallel 2 --moe-top-k 2 --tp 1 --dp 2 --layers 2 --steps 10", 1e-4),
        ("--num-experts 4 --expert-parallel 2 --tp 2 --dp 2 --layers 2 --steps 10 \
          --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001", 1e-4),
        ("--num-experts 4 --expert-parallel 4 --moe-top-k 1 --tp 1 --dp 4 --layers 2 --steps 6", 1e-4),
        ("--num-experts 4 --expert-parallel 2 --tp 1 --dp 2 --pp 2 --microbatches 2 --layers 2 \
          --steps 6 --moe-capacity-factor 1 --moe-aux-loss-coeff 0.01", 1e-4),
        ("--num-experts 2 --expert-parallel 2 --tp 1 --dp 1 --cp 2 --seq 32 --layers 2 --steps 6 \
          --moe-layer-freq 2 --moe-router-pre-softmax", 1e-4),
        ("--num-experts 4 --expert-parallel 2 --tp 1 --dp 2 --layers 2 --steps 6 --precision bf16", 1e-3),
        // fp16's dynamic loss scale seeds the auxiliary losses too.
        ("--num-experts 4 --expert-parallel 2 --tp 1 --dp 2 --layers 2 --steps 6 --precision fp16 \
          --moe-aux-loss-coeff 0.01", 1e-3),
        // Clipping counts every expert once (its squares summed over expert parallelism).
        ("--num-experts 4 --expert-parallel 2 --tp 2 --dp 4 --pp 2 --microbatches 2 --layers 2 \
          --steps 6 --clip-grad 0.05", 1e-4),
        // The distributed optimizer: experts' state split over expert-data parallelism;
        // sequence parallelism gathers the tokens before routing; a shared expert.
        ("--num-experts 4 --expert-parallel 2 --tp 2 --dp 2 --sequence-parallel --layers 2 \
          --steps 6 --clip-grad 0.05 --moe-capacity-factor 1 --use-distributed-optimizer \
          --moe-shared-expert-intermediate-size 96", 1e-4),
        ("--num-experts 4 --expert-parallel 2 --tp 1 --dp 4 --layers 2 --steps 6 --precision bf16 \
          --moe-aux-loss-coeff 0.01 --use-distributed-optimizer", 1e-3),
    ] {
        let stdout = succeed(&format!("{layout} --check --eval-interval 0 --out {out}"));
        let difference = figure(&stdout, "max loss difference: ");
        assert!(difference <= tolerance, "{layout}: {difference}");
    }
}

#[test]
fn every_step_reports_the_routing() {
    let out = fresh("experts-routing");
    let stdout = succeed(&format!(
        "--num-experts 4 --expert-parallel 2 --tp 1 --dp 2 --layers 2 --seq 16 --batch 4 \
         --steps 3 --moe-capacity-factor 0.5 --eval-interval 0 --out {}",
        out.display()
    ));
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("  experts: "))
        .collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for line in lines {
        // 4 × 2 sequences of 16 tokens, top-2, two MoE blocks: 512 slots a step.
        let slots: f64 = line["  experts: token slots ".len()..]
            .split(" | ")
            .next()
            .unwrap()
            .split(' ')
            .map(|n| n.parse::<f64>().unwrap())
            .sum();
        assert_eq!(slots, 512.0, "{line}");
        let dropped = figure(
            line.split(" | ").nth(1).unwrap().trim_end_matches('%'),
            "dropped ",
        );
        assert!(dropped > 0.0, "capacity 0.5 drops: {line}");
    }
}

#[test]
fn bad_expert_settings_are_refused() {
    for (flags, needle) in [
        (
            "--num-experts 3 --expert-parallel 2 --dp 2",
            "valid --expert-parallel: 1, 3",
        ),
        ("--num-experts 4 --expert-parallel 4 --dp 2", "divides 2"),
        ("--expert-parallel 2 --dp 2", "pass --num-experts"),
        ("--moe-shared-expert-intermediate-size 8", "needs experts"),
        ("--num-experts 4 --moe-top-k 5", "--moe-top-k 5"),
        (
            "--num-experts 4 --moe-shared-expert-intermediate-size 0",
            "at least 1",
        ),
        (
            "--num-experts 4 --moe-shared-expert-intermediate-size 8 --init-from x",
            "shared expert",
        ),
    ] {
        refused(&format!("{flags} --steps 1"), needle);
    }
}

#[test]
fn a_run_saved_at_one_expert_parallel_size_continues_at_another() {
    let dir = fresh("experts-resume");
    let d = dir.display();
    let sizes = "--num-experts 4 --layers 2 --seq 32 --eval-interval 0 --moe-aux-loss-coeff 0.01";
    succeed(&format!(
        "{sizes} --tp 1 --dp 2 --expert-parallel 2 --steps 8 --out {d}/whole"
    ));
    succeed(&format!(
        "{sizes} --tp 1 --dp 2 --expert-parallel 2 --steps 4 --save {d}/saved --out {d}/first"
    ));
    let whole = common::rows(&dir.join("whole/loss.csv"));
    for (i, layout) in [
        "--tp 1 --dp 2 --expert-parallel 2",
        "--tp 1 --dp 2 --expert-parallel 1",
        "--tp 2 --dp 2 --expert-parallel 2",
        "--tp 1 --dp 4 --batch 4 --expert-parallel 4",
        // Into the distributed optimizer, whose experts' state is split over 2 ranks.
        "--tp 1 --dp 4 --batch 4 --expert-parallel 2 --use-distributed-optimizer",
    ]
    .iter()
    .enumerate()
    {
        succeed(&format!(
            "{sizes} {layout} --steps 8 --resume {d}/saved --out {d}/r{i}"
        ));
        assert_continues(&whole, &dir.join(format!("r{i}/loss.csv")), layout);
    }
    // The same layout resumes bit for bit.
    assert_eq!(whole, common::rows(&dir.join("r0/loss.csv")));
    // Saved from the distributed optimizer (its experts' state gathered over
    // expert-data parallelism), continued replicated at another layout.
    succeed(&format!(
        "{sizes} --tp 1 --dp 4 --batch 4 --expert-parallel 2 --use-distributed-optimizer \
         --steps 4 --save {d}/sharded --out {d}/sharded-first"
    ));
    succeed(&format!(
        "{sizes} --tp 2 --dp 2 --expert-parallel 1 --steps 8 --resume {d}/sharded --out {d}/s"
    ));
    assert_continues(
        &whole,
        &dir.join("s/loss.csv"),
        "from the distributed optimizer",
    );
    // The shared expert is part of the model a checkpoint holds: resuming without it
    // is refused, naming it.
    let shared = "--moe-shared-expert-intermediate-size 32";
    succeed(&format!(
        "{sizes} {shared} --tp 1 --dp 2 --expert-parallel 2 --steps 2 --save {d}/shared \
         --out {d}/shared-first"
    ));
    refused(
        &format!("{sizes} --tp 1 --dp 2 --expert-parallel 2 --steps 3 --resume {d}/shared"),
        "a shared expert 32 wide",
    );
    succeed(&format!(
        "{sizes} {shared} --tp 2 --dp 2 --expert-parallel 1 --steps 3 --resume {d}/shared \
         --out {d}/shared-again"
    ));
}

/// The resumed run's loss curve (`csv`) is `whole`'s within 1e-4.
fn assert_continues(whole: &[String], csv: &std::path::Path, what: &str) {
    let resumed = common::rows(csv);
    assert_eq!(whole.len(), resumed.len(), "{what}");
    let value = |row: &String| -> f32 { row.split(',').nth(1).unwrap().parse().unwrap() };
    for (a, b) in whole.iter().zip(&resumed).skip(1) {
        assert!((value(a) - value(b)).abs() <= 1e-4, "{what}: {a} vs {b}");
    }
}

#[test]
fn a_dense_checkpoint_upcycles_into_experts_that_compute_the_same_loss() {
    let dir = fresh("experts-upcycle");
    let d = dir.display();
    let model = "--layers 2 --hidden 32 --heads 4 --seq 16 --eval-interval 0";
    succeed(&format!(
        "{model} --batch 4 --steps 3 --save {d}/dense --out {d}/o"
    ));
    succeed(&format!("export-hf --from {d}/dense --out {d}/hf"));
    let first_loss = |out: &str| -> f32 {
        let rows = common::rows(&dir.join(out).join("loss.csv"));
        rows[1].split(',').nth(1).unwrap().parse().unwrap()
    };
    succeed(&format!(
        "{model} --batch 2 --dp 2 --tp 2 --steps 1 --init-from {d}/hf --out {d}/again"
    ));
    // Every expert a copy of the block's MLP, the router's weights adding up to 1 per
    // token: the same function, whichever experts the fresh router picks.
    succeed(&format!(
        "{model} --batch 2 --dp 2 --tp 2 --steps 1 --num-experts 4 --expert-parallel 2 \
         --init-from {d}/hf --out {d}/experts"
    ));
    let (dense, experts) = (first_loss("again"), first_loss("experts"));
    assert!((dense - experts).abs() <= 1e-5, "{dense} vs {experts}");
    refused(
        &format!("{model} --num-experts 4 --moe-ffn-hidden-size 64 --steps 1 --init-from {d}/hf"),
        "--moe-ffn-hidden-size 128",
    );
}
