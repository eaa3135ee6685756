//! Fault injection for the tests of crash safety: `FERROTRON_CRASH_AT=<point>@<step>`
//! ends the process abruptly (exit status 86, nothing flushed or cleaned up) when the save
//! of that step reaches that point, as a node failing there would (without `@<step>`, the
//! first save that reaches it). Points: `before the shards`, `after the shards`,
//! `before the trainer state`, `before the rename`, `before the marker`.

/// The status a crash at an injected point exits with.
pub const CRASH_STATUS: i32 = 86;

/// Crashes here, in the save of `step`, if `FERROTRON_CRASH_AT` names this point.
pub fn point(point: &str, step: usize) {
    let Ok(at) = std::env::var("FERROTRON_CRASH_AT") else {
        return;
    };
    let (name, at_step) = match at.split_once('@') {
        Some((name, step)) => (name, step.parse().ok()),
        None => (at.as_str(), None),
    };
    if name == point && at_step.is_none_or(|s: usize| s == step) {
        eprintln!("crash injected {point} of the save of step {step} (FERROTRON_CRASH_AT)");
        std::process::exit(CRASH_STATUS);
    }
}
