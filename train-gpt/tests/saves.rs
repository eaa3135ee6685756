//! Checkpoints that survive failures: saves every N steps, each in its own directory and
//! complete before the `latest` marker names it; the newest K kept; `--resume auto`; a
//! crash at any point of a save leaves a checkpoint that resumes exactly; SIGTERM saves
//! the step in progress and exits 0.

mod common;

use common::{rows, scratch, succeeded};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

/// A model small enough for a debug build, on two rank threads (TP 1 × DP 2).
const SMALL: &[&str] = &[
    "--layers",
    "1",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq",
    "16",
    "--tp",
    "1",
    "--dp",
    "2",
    "--batch",
    "4",
    "--eval-interval",
    "0",
];

fn command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-gpt"));
    command.args(SMALL).args(args);
    command
}

fn run(args: &[&str], crash_at: Option<&str>) -> Output {
    let mut command = command(args);
    if let Some(point) = crash_at {
        command.env("FERROTRON_CRASH_AT", point);
    }
    command.output().expect("the train-gpt binary runs")
}

fn succeed(args: &[&str]) -> String {
    succeeded(&run(args, None))
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn saves_every_n_steps_keep_the_newest_and_resume_auto_continues() {
    let root = scratch("saves");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    succeed(&["--steps", "6", "--out", &dir("A")]);
    // Saves at steps 2 and 4, and at the end (5); the newest two are kept.
    let stdout = succeed(&[
        "--steps",
        "5",
        "--save",
        &dir("C"),
        "--save-interval",
        "2",
        "--save-keep",
        "2",
        "--out",
        &dir("B"),
    ]);
    assert!(
        stdout.contains("checkpoint: ") && stdout.contains("step_0000005"),
        "{stdout}"
    );
    assert_eq!(
        entries(&root.join("C")),
        ["latest", "step_0000004", "step_0000005"]
    );
    let latest = std::fs::read_to_string(root.join("C/latest")).unwrap();
    assert_eq!(latest, "step_0000005");
    // Re-submitting the same command with --resume auto continues where it stopped.
    let resubmit = |out: &str| {
        succeed(&[
            "--steps",
            "6",
            "--save",
            &dir("C"),
            "--resume",
            "auto",
            "--out",
            &dir(out),
        ])
    };
    let stdout = resubmit("B2");
    assert!(stdout.contains("step_0000005"), "{stdout}");
    assert_eq!(
        rows(&root.join("B2/loss.csv")),
        rows(&root.join("A/loss.csv"))
    );
    // The same command once more: the run is complete, which is a success (a requeued
    // job reruns its command), and nothing trains.
    let stdout = resubmit("B4");
    assert!(
        stdout.contains("the run is complete") && stdout.contains("step 6 of --steps 6"),
        "{stdout}"
    );
    assert!(!root.join("B4/loss.csv").exists(), "nothing trained");
    // With nothing saved yet, auto starts fresh.
    let stdout = succeed(&[
        "--steps",
        "2",
        "--save",
        &dir("D"),
        "--resume",
        "auto",
        "--out",
        &dir("B3"),
    ]);
    assert!(stdout.contains("starting fresh"), "{stdout}");
    std::fs::remove_dir_all(&root).ok();
}

/// A crash at each point of the second save (step 4) leaves step 2's checkpoint, which
/// `latest` still names (step 4's directory, renamed just before the crash, is complete
/// but unmarked); resuming from the directory continues exactly.
#[test]
fn a_crash_anywhere_in_a_save_leaves_a_checkpoint_that_resumes_exactly() {
    let root = scratch("crashes");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    succeed(&["--steps", "6", "--out", &dir("A")]);
    let whole = rows(&root.join("A/loss.csv"));
    let points = [
        ("before the shards", 2),
        ("after the shards", 2),
        ("before the trainer state", 2),
        ("before the rename", 2),
        ("before the marker", 2),
    ];
    for (point, newest) in points {
        let save = dir(point);
        let crash = format!("{point}@4");
        let args = ["--steps", "6", "--save", &save, "--save-interval", "2"];
        let output = run(&args, Some(&crash));
        assert_eq!(
            output.status.code(),
            Some(86),
            "{point}: the crash happened"
        );
        let out = dir(&format!("{point} out"));
        let stdout = succeed(&["--steps", "6", "--resume", &save, "--out", &out]);
        let from = format!("step_{newest:07}");
        assert!(
            stdout.contains(&from),
            "{point}: resumed from {from}:\n{stdout}"
        );
        let resumed = rows(&Path::new(&out).join("loss.csv"));
        assert_eq!(resumed, whole, "{point}: the resumed curve");
    }
    std::fs::remove_dir_all(&root).ok();
}

/// SIGTERM mid-run: the step in progress finishes, is saved, and the program exits 0
/// naming the checkpoint, which continues exactly.
#[test]
fn sigterm_saves_the_step_in_progress_and_exits_zero() {
    let root = scratch("sigterm");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    let mut child = command(&["--steps", "100000", "--save", &dir("C"), "--out", &dir("B")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A stop that does not work must fail the test, not train for 100,000 steps.
    let (pid, waited) = (
        child.id() as i32,
        std::sync::Arc::new(AtomicBool::new(false)),
    );
    let watchdog = waited.clone();
    std::thread::spawn(move || {
        for _ in 0..1200 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if watchdog.load(Ordering::SeqCst) {
                return;
            }
        }
        // SAFETY: kills the child this test started, still unwaited (so its pid is not
        // reused), after two minutes.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Signal once two steps have run.
    for line in lines.by_ref() {
        if line.unwrap().contains("step    2/") {
            break;
        }
    }
    // SAFETY: signals a child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let status = child.wait().unwrap();
    waited.store(true, Ordering::SeqCst);
    let stdout = rest.join("\n");
    assert!(status.success(), "{status}: {stdout}");
    let stopped = rest
        .iter()
        .find_map(|l| l.strip_prefix("stopped by a signal after step "))
        .unwrap_or_else(|| panic!("no stop line:\n{stdout}"));
    let step: usize = stopped.split(';').next().unwrap().parse().unwrap();
    assert!(root
        .join(format!("C/step_{step:07}/trainer_state.json"))
        .is_file());
    let (steps, next) = (step.to_string(), (step + 2).to_string());
    succeed(&["--steps", &next, "--resume", &dir("C"), "--out", &dir("B2")]);
    succeed(&["--steps", &next, "--out", &dir("A")]);
    assert_eq!(
        rows(&root.join("B2/loss.csv")),
        rows(&root.join("A/loss.csv"))
    );
    assert_eq!(
        rows(&root.join("B/loss.csv")).len(),
        step + 1,
        "{steps} rows"
    );
    std::fs::remove_dir_all(&root).ok();
}

/// `--async-save`: the same checkpoints, written beside training; a save completes when
/// the next one starts (or the run ends), so a crash while one is written leaves the one
/// before.
#[test]
fn asynchronous_saves_write_the_same_checkpoints() {
    let root = scratch("async");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    succeed(&["--steps", "6", "--out", &dir("A")]);
    let save = ["--save-interval", "2", "--async-save"];
    succeed(
        &[
            &["--steps", "5", "--save", &dir("C"), "--out", &dir("B")],
            &save[..],
        ]
        .concat(),
    );
    assert_eq!(
        entries(&root.join("C")),
        ["latest", "step_0000002", "step_0000004", "step_0000005"]
    );
    succeed(&["--steps", "6", "--resume", &dir("C"), "--out", &dir("B2")]);
    assert_eq!(
        rows(&root.join("B2/loss.csv")),
        rows(&root.join("A/loss.csv"))
    );
    // A crash while step 4's files are written: step 2 is the newest complete one.
    let crashed = dir("D");
    let args = [&["--steps", "6", "--save", &crashed], &save[..]].concat();
    let output = run(&args, Some("after the shards@4"));
    assert_eq!(output.status.code(), Some(86), "the crash happened");
    let stdout = succeed(&["--steps", "6", "--resume", &dir("D"), "--out", &dir("B3")]);
    assert!(stdout.contains("step_0000002"), "{stdout}");
    assert_eq!(
        rows(&root.join("B3/loss.csv")),
        rows(&root.join("A/loss.csv"))
    );
    std::fs::remove_dir_all(&root).ok();
}

/// Resuming from an earlier checkpoint and saving again makes that run the latest, even
/// though the abandoned run's later saves remain: `--resume auto` follows `latest`.
#[test]
fn a_rewound_run_is_the_one_auto_resumes() {
    let root = scratch("rewind");
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    let checkpoints = dir("C");
    let save = ["--save", &checkpoints, "--save-interval", "2"];
    succeed(&[&["--steps", "6", "--out", &dir("B")], &save[..]].concat());
    let rewind = format!("{checkpoints}/step_0000002");
    let args = [
        &["--steps", "4", "--resume", &rewind, "--out", &dir("B2")],
        &save[..],
    ];
    succeed(&args.concat());
    let latest = std::fs::read_to_string(root.join("C/latest")).unwrap();
    assert_eq!(latest, "step_0000004");
    assert!(
        root.join("C/step_0000006").is_dir(),
        "the abandoned save is left alone"
    );
    let args = [
        &["--steps", "5", "--resume", "auto", "--out", &dir("B3")],
        &save[..],
    ];
    let stdout = succeed(&args.concat());
    assert!(stdout.contains("step_0000004"), "{stdout}");
    std::fs::remove_dir_all(&root).ok();
}
