//! Mixtures of experts in the demo: `--num-experts` runs with expert parallelism match one
//! rank (`--check`, which runs each data-parallel rank's rows as a microbatch of their own,
//! as the experts route them) composed with tensor, data, pipeline and context
//! parallelism, top-1 and top-2, the load-balancing and z-losses, a capacity factor and
//! bf16; each step reports the routing; what is not supported yet is refused.

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
fn what_experts_do_not_support_yet_is_refused() {
    for (flags, needle) in [
        (
            "--num-experts 3 --expert-parallel 2 --dp 2",
            "valid --expert-parallel: 1, 3",
        ),
        ("--num-experts 4 --expert-parallel 4 --dp 2", "divides 2"),
        ("--expert-parallel 2 --dp 2", "pass --num-experts"),
        ("--num-experts 4 --moe-top-k 5", "--moe-top-k 5"),
        (
            "--num-experts 4 --expert-parallel 2 --dp 2 --clip-grad 1",
            "--clip-grad",
        ),
        (
            "--num-experts 4 --expert-parallel 2 --dp 2 --use-distributed-optimizer",
            "distributed",
        ),
        ("--num-experts 4 --dp 2 --save /tmp/never", "--save"),
    ] {
        let output = run(&format!("{flags} --steps 1"));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags} ran");
        assert!(stderr.contains(needle), "{flags}: {stderr}");
    }
}
