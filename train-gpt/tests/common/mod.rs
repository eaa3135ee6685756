//! What the demo's test files share.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

/// An empty scratch directory for `name`, unique to this test process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("train-gpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// [`scratch`], created.
pub fn fresh(name: &str) -> PathBuf {
    let dir = scratch(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A finished command's standard output; it must have succeeded.
pub fn succeeded(output: &std::process::Output) -> String {
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    text
}

/// The number after `prefix` on stdout's line that starts with it.
pub fn figure(stdout: &str, prefix: &str) -> f64 {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no '{prefix}' line in\n{stdout}"))
        .parse()
        .unwrap()
}

/// Command-line flags written as one string, split into arguments.
pub fn words(flags: &str) -> Vec<&str> {
    flags.split_whitespace().collect()
}

/// The lines of a file the demo wrote (a `loss.csv`, say).
pub fn rows(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::to_string)
        .collect()
}

/// The sizes of the memory tests' runs: four blocks of hidden 64 over 64 tokens, eight
/// sequences a step, two steps.
pub const MEMORY_RUN: &str =
    "--layers 4 --hidden 64 --heads 4 --seq 64 --batch 8 --steps 2 --eval-interval 0";

/// The standard output of the demo run with [`MEMORY_RUN`] and `flags`, which must succeed.
pub fn memory_run(flags: &str) -> String {
    demo_stdout(&format!("{MEMORY_RUN} {flags}"))
}

/// The standard output of the demo run with `flags`, which must succeed.
pub fn demo_stdout(flags: &str) -> String {
    let out = scratch(&format!("run-{:x}", fingerprint(flags)));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_train-gpt"))
        .args(flags.split_whitespace())
        .arg("--out")
        .arg(&out)
        .output()
        .expect("the train-gpt binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{flags}: {stdout}{stderr}");
    std::fs::remove_dir_all(&out).ok();
    stdout
}

/// The number of bytes on the line of `stdout` that starts with `prefix` (`... N bytes`).
pub fn bytes_after(stdout: &str, prefix: &str) -> usize {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|l| l.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no line {prefix:?}: {stdout}"))
}

fn fingerprint(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}
