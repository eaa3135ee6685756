//! A collective that fails mid-run (`FERROTRON_FAIL_COLLECTIVE`, the local backend's
//! injected faults) ends the run with an error that names the rank, the group and the
//! call, within the group timeout; no checkpoint of that step or later is committed or
//! marked `latest`; no device stream reports an unordered access as the ranks end; and
//! `--resume auto` from what remains gives the uninterrupted run's losses bit for bit.
//! Swept over the demo's layouts (TP × DP with the distributed optimizer and overlapped
//! parameter gathers, overlapped gradient reduction, TP × PP with receives posted ahead,
//! context and expert parallelism), on the CPU and the emulated device, at steps that
//! end in a save and steps between saves.

mod common;

use common::{rows, scratch, succeeded, words};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Small enough for a debug build: two blocks, four steps, a save every two.
const BASE: &str =
    "--layers 2 --hidden 16 --heads 2 --seq 16 --batch 4 --steps 4 --eval-interval 0";

/// The group timeout of the failing runs: each must end well within it.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A layout, and the call that fails: `<world rank>@<step>:<group>[:<call>]`.
const CASES: [(&str, &str); 6] = [
    // The last step's overlapped parameter gather: evaluation and the final save read
    // the parameters it was to set.
    (
        "--tp 2 --dp 2 --use-distributed-optimizer --overlap-param-gather",
        "1@4:dp:all_gather",
    ),
    // A gradient bucket reduced while backward runs, between two saves.
    ("--tp 2 --dp 2", "2@3:dp:all_reduce"),
    ("--tp 2 --dp 2", "0@2:tp"),
    // A pipeline receive posted ahead, in a step that ends in a save.
    (
        "--tp 2 --pp 2 --dp 1 --microbatches 2 --overlap-p2p-comm",
        "3@2:pp",
    ),
    ("--tp 1 --cp 2 --dp 1", "1@2:cp"),
    (
        "--tp 1 --dp 2 --num-experts 2 --expert-parallel 2",
        "0@4:ep:all_to_all_v",
    ),
];

fn train(flags: &str, out: &Path, fail: Option<&str>) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-gpt"));
    command
        .args(words(BASE))
        .args(words(flags))
        .arg("--out")
        .arg(out);
    command.env("FERROTRON_TIMEOUT_SECS", TIMEOUT.as_secs().to_string());
    if let Some(at) = fail {
        command.env("FERROTRON_FAIL_COLLECTIVE", at);
    }
    command.output().expect("the train-gpt binary runs")
}

/// The steps of the checkpoints under `root`, and the one `latest` names.
fn saved(root: &Path) -> (Vec<usize>, Option<usize>) {
    let step = |name: &str| name.strip_prefix("step_").and_then(|n| n.parse().ok());
    let steps = (std::fs::read_dir(root).into_iter().flatten())
        .filter_map(|entry| step(&entry.ok()?.file_name().to_string_lossy()))
        .collect();
    let latest = std::fs::read_to_string(root.join("latest")).ok();
    (steps, latest.and_then(|name| step(name.trim())))
}

fn fails_cleanly_and_resumes(device: &str, layout: &str, at: &str) {
    let case = format!("{layout} --device {device}, {at}");
    let dir = scratch(&format!("{device}-{:x}", fingerprint(&case)));
    let whole = train(&format!("{layout} --device {device}"), &dir.join("A"), None);
    succeeded(&whole);

    let saves = format!(
        "{layout} --device {device} --save {} --save-interval 2",
        dir.join("ck").display()
    );
    let started = Instant::now();
    let failed = train(&saves, &dir.join("B"), Some(at));
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(
        !failed.status.success(),
        "{case}: the run succeeded\n{stderr}"
    );
    assert!(
        took < TIMEOUT,
        "{case}: took {took:?}, the group timeout is {TIMEOUT:?}"
    );
    let (rank, rest) = at.split_once('@').unwrap();
    let mut parts = rest.split(':');
    let (step, group, call): (usize, _, _) = (
        parts.next().unwrap().parse().unwrap(),
        parts.next().unwrap(),
        parts.next(),
    );
    let error = stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        error.contains(&format!("injected failure in group '{group}'"))
            && error.contains(&format!("(world rank {rank})"))
            && call.is_none_or(|call| error.contains(call)),
        "{case}: the error does not name the rank, group and call:\n{stderr}"
    );
    assert!(
        !stderr.contains("device streams failed") && !stderr.contains("unordered accesses"),
        "{case}: a device stream reported an unordered access:\n{stderr}"
    );
    let (steps, latest) = saved(&dir.join("ck"));
    assert!(
        steps.iter().chain(&latest).all(|&s| s < step),
        "{case}: checkpoints {steps:?} (latest {latest:?}) of the failed step or later"
    );

    let resumed = train(&format!("{saves} --resume auto"), &dir.join("B"), None);
    succeeded(&resumed);
    assert_eq!(
        rows(&dir.join("B/loss.csv")),
        rows(&dir.join("A/loss.csv")),
        "{case}: resumed from {latest:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A name for a case's scratch directory.
fn fingerprint(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

#[test]
fn a_failed_collective_on_the_cpu_ends_the_run_and_leaves_a_checkpoint_that_resumes() {
    for (layout, at) in CASES {
        fails_cleanly_and_resumes("cpu", layout, at);
    }
}

#[test]
fn a_failed_collective_on_the_emulated_device_ends_the_run_and_leaves_a_checkpoint_that_resumes() {
    for (layout, at) in CASES {
        fails_cleanly_and_resumes("emulated", layout, at);
    }
}

/// A malformed request, or one the backend cannot inject, is refused before training.
#[test]
fn a_malformed_or_unsupported_failure_is_refused() {
    let out = scratch("refused");
    for (at, flags, says) in [
        ("1@0", "--tp 2 --dp 1", "a step from 1"),
        ("5@1", "--tp 2 --dp 1", "a rank below 2"),
        ("1@1:tensor", "--tp 2 --dp 1", "a group of"),
        (
            "1@1:tp:all_reduce_twice",
            "--tp 2 --dp 1",
            "give <world rank>@<step>",
        ),
    ] {
        let output = train(flags, &out, Some(at));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && stderr.contains(says),
            "{at}: {stderr}"
        );
        assert!(!stderr.contains("train step"), "{at}: it trained\n{stderr}");
    }
}
