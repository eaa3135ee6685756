//! The demo under pipeline parallelism: every schedule trains what one rank trains, and
//! layouts that cannot work are refused before any rank starts, saying what would.

use std::process::Command;

/// Runs a small model with `args`; returns success, stdout and stderr.
fn train(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args([
            "--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "16",
        ])
        .args(["--batch", "4", "--steps", "3", "--eval-interval", "0"])
        .args([
            "--out",
            &std::env::temp_dir()
                .join("train-gpt-pipeline")
                .to_string_lossy(),
        ])
        .args(args)
        .output()
        .expect("the train-gpt binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn every_schedule_trains_what_one_rank_trains() {
    for layout in [
        &["--pp", "2", "--tp", "2", "--dp", "1", "--microbatches", "2"][..],
        &[
            "--pp",
            "2",
            "--tp",
            "1",
            "--dp",
            "2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "4",
        ],
        &[
            "--pp",
            "2",
            "--tp",
            "1",
            "--dp",
            "1",
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "2",
            "--microbatches",
            "2",
        ],
        &["--pp", "4", "--tp", "1", "--dp", "2", "--microbatches", "4"],
    ] {
        let (ok, stdout, stderr) = train(&[layout, &["--check"][..]].concat());
        assert!(ok, "{layout:?}: {stderr}");
        let last = stdout.lines().last().unwrap_or_default();
        let difference: f32 = last
            .strip_prefix("max loss difference: ")
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{layout:?}: last line {last:?}"));
        assert!(difference < 1e-4, "{layout:?}: {difference}");
    }
}

#[test]
fn layouts_that_cannot_work_are_refused_with_what_would() {
    let cases: [(&[&str], &str); 5] = [
        (&["--pp", "3"], "valid --pp × --virtual-stages: 1, 2, 4"),
        (&["--pp", "2", "--microbatches", "3"], "valid: 1, 2, 4"),
        (
            &["--pp", "2", "--virtual-stages", "2"],
            "needs --schedule interleaved",
        ),
        (
            &[
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
                "--microbatches",
                "1",
            ],
            "not a multiple of 2",
        ),
        (
            &["--pp", "2", "--save", "unused"],
            "do not support --pp > 1",
        ),
    ];
    for (args, message) in cases {
        let (ok, _, stderr) = train(args);
        assert!(!ok, "{args:?} must fail");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
