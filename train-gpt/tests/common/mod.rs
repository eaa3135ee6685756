//! What the demo's test files share.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

/// An empty scratch directory for `name`, unique to this test process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("train-gpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
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
