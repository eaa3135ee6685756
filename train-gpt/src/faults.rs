//! Fault injection for the tests of crash safety: `FERROTRON_CRASH_AT=<point>@<step>`
//! ends the process abruptly (exit status 86, nothing flushed or cleaned up) when the save
//! of that step reaches that point, as a node failing there would (without `@<step>`, the
//! first save that reaches it). Points: `before the shards`, `after the shards`,
//! `before the trainer state`, `before the rename`, `before the marker`.
//!
//! `FERROTRON_KILL_AT=<world rank>@<step>` makes that rank's process kill itself with
//! SIGKILL after that step, as a node that disappears would (with ranks as processes,
//! under MPI; with ranks as threads the whole process goes).

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

/// Kills this process with SIGKILL after `step` if `FERROTRON_KILL_AT` names this world
/// rank and step.
pub fn kill_point(rank: usize, step: usize) {
    let Ok(at) = std::env::var("FERROTRON_KILL_AT") else {
        return;
    };
    let parsed = at
        .split_once('@')
        .and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?)));
    if parsed == Some((rank, step)) {
        eprintln!("rank {rank} kills itself after step {step} (FERROTRON_KILL_AT)");
        // SAFETY: signals this process; SIGKILL cannot be caught, the process ends here.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
