//! Context parallelism in the demo: `--cp` runs match one rank (`--check`) composed with
//! tensor, data and pipeline parallelism, and a run saved at one context-parallel size
//! continues its curve at another.

mod common;

use common::{figure, fresh, rows, succeeded, words};
use std::process::Command;

fn train(flags: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(words(flags))
        .output()
        .expect("the train-gpt binary runs");
    succeeded(&output)
}

fn check(flags: &str) -> f64 {
    figure(&train(&format!("{flags} --check")), "max loss difference: ")
}

#[test]
fn context_parallel_runs_match_one_rank() {
    let out = fresh("cp-check");
    let out = out.display();
    for layout in [
        // The README's command with the flags.
        "--cp 2 --tp 2 --dp 1 --seq 32 --layers 2 --steps 10",
        "--cp 2 --tp 2 --dp 2 --seq 32 --layers 2 --steps 10",
        "--cp 2 --pp 2 --tp 1 --dp 1 --seq 32 --layers 2 --steps 10",
        "--cp 3 --tp 1 --dp 1 --seq 24 --layers 1 --steps 5 --sequence-parallel",
    ] {
        let difference = check(&format!("{layout} --out {out}"));
        assert!(difference <= 1e-4, "{layout}: {difference}");
    }
}

#[test]
fn a_run_saved_at_one_context_parallel_size_continues_at_another() {
    let dir = fresh("cp-resume");
    let d = dir.display();
    let sizes = "--tp 1 --dp 1 --batch 8 --seq 32 --layers 2 --eval-interval 0";
    train(&format!("{sizes} --cp 2 --steps 8 --out {d}/whole"));
    train(&format!(
        "{sizes} --cp 2 --steps 4 --save {d}/saved --out {d}/first"
    ));
    for cp in [1, 4] {
        train(&format!(
            "{sizes} --cp {cp} --steps 8 --resume {d}/saved --out {d}/cp{cp}"
        ));
        let (whole, resumed) = (
            rows(&dir.join("whole/loss.csv")),
            rows(&dir.join(format!("cp{cp}/loss.csv"))),
        );
        assert_eq!(whole.len(), resumed.len());
        for (a, b) in whole.iter().zip(&resumed).skip(1) {
            let value = |row: &String| -> f32 { row.split(',').nth(1).unwrap().parse().unwrap() };
            assert!((value(a) - value(b)).abs() <= 1e-4, "cp {cp}: {a} vs {b}");
        }
    }
}
