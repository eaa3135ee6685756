//! SIGTERM and SIGINT as a long run needs them: the first asks the run to stop after the
//! step in progress (the ranks agree on which after every step, save with `--save`, and
//! the program exits 0 naming the checkpoint); a second ends the process at once, as a
//! job scheduler's follow-up signal or a second Ctrl-C expects.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first signal. Per process, as signals are.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(signal: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; the second signal ends the run now.
        unsafe { libc::_exit(128 + signal) }
    }
    let note = b"\nstop requested: finishing this step and saving (a second signal ends the run at once)\n";
    // SAFETY: `write` is async-signal-safe; the buffer is static. A failed note changes
    // nothing.
    unsafe { libc::write(2, note.as_ptr().cast(), note.len()) };
}

/// Gives SIGINT and SIGTERM back their default action (ending the program), once
/// nothing watches the flag any more.
pub fn uninstall() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: restores the default disposition.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

/// Installs the handlers and returns the flag the training loop watches.
pub fn install() -> &'static AtomicBool {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only touches an atomic and calls async-signal-safe
        // functions.
        unsafe { libc::signal(signal, handler) };
    }
    &STOP
}
