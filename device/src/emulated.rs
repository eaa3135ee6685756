//! The emulated device's streams run as a GPU's do: each has a worker thread that runs
//! its queued work in order while the host goes on, so a host that reads memory before
//! the work writing it has run reads stale bytes, as it would on a GPU. Host waits block
//! until the work is done; a stream waiting for another's event blocks its worker, not
//! the host.
//!
//! `FERROTRON_EMULATED_JITTER=<seed>` delays queued work at random (a quarter of the
//! calls sleep up to 200 µs), so an ordering the program forgot shows up as wrong numbers
//! or a checker error on some runs even where the worker would usually keep up.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// Words of a kernel's argument kept in the queue itself: a launch of a kernel whose
/// argument fits allocates nothing (tape's argument block takes 48).
pub(crate) const ARG_WORDS: usize = 64;

/// The most words a kernel's argument may take: CUDA's classic 4 KiB of parameters
/// (a multi-tensor kernel's list of addresses).
pub(crate) const MAX_ARG_WORDS: usize = 512;

/// A kernel's argument as the queue keeps it: inline when it fits, else on the heap.
#[allow(clippy::large_enum_variant)] // inline on purpose: most launches then allocate nothing
pub(crate) enum ArgCopy {
    Inline([u64; ARG_WORDS]),
    Boxed(Box<[u64]>),
}

impl ArgCopy {
    fn as_ptr(&self) -> *const std::ffi::c_void {
        match self {
            ArgCopy::Inline(words) => words.as_ptr().cast(),
            ArgCopy::Boxed(words) => words.as_ptr().cast(),
        }
    }
}

/// Work queued on a stream, run by its worker.
#[allow(clippy::large_enum_variant)] // inline on purpose: a boxed argument would allocate
pub(crate) enum Work {
    /// A host build of a kernel and a copy of its argument.
    Kernel {
        /// `module::HostKernel` (spelt out: this module is below `module`).
        kernel: unsafe extern "C" fn(*const std::ffi::c_void),
        arg: ArgCopy,
    },
    /// A host build of a cooperative kernel, its argument and grid.
    Blocks {
        kernel: crate::blocks::BlockKernel,
        arg: ArgCopy,
        grid: crate::blocks::Grid,
        name: &'static str,
    },
    /// Another stream's calls up to `ticket`, which this stream waits for; if that
    /// stream is broken, this one breaks too (its later calls may read what the other
    /// never wrote).
    WaitFor {
        progress: Arc<Progress>,
        ticket: u64,
    },
    /// Anything else.
    Call(Box<dyn FnOnce() + Send>),
    /// Anything else that can fail; its error breaks the stream.
    Try(Box<dyn FnOnce() -> std::result::Result<(), String> + Send>),
}

impl Work {
    /// Runs the call (a cooperative kernel's blocks and threads in an order drawn from
    /// `jitter`, if set); `Err` breaks the stream.
    fn run(self, jitter: &mut Option<u64>) -> std::result::Result<(), String> {
        match self {
            // SAFETY: whoever queued the launch guaranteed the argument and the memory
            // it names until the kernel has run (`Stream::launch`).
            Work::Kernel { kernel, arg } => unsafe { kernel(arg.as_ptr()) },
            // SAFETY: as above (`Stream::launch_blocks`).
            Work::Blocks {
                kernel,
                arg,
                grid,
                name,
            } => return unsafe { crate::blocks::run(kernel, arg.as_ptr(), grid, name, jitter) },
            Work::WaitFor { progress, ticket } => {
                return progress
                    .wait(ticket)
                    .map_err(|e| format!("waited for: {e}"))
            }
            Work::Call(call) => call(),
            Work::Try(call) => return call(),
        }
        Ok(())
    }
}

/// A stream's queue and how far its worker has got: calls are numbered from 1 in the
/// order queued.
pub(crate) struct Progress {
    state: Mutex<State>,
    /// Signalled when a call has run (for host waits and other streams' workers).
    advanced: Condvar,
    /// Signalled when a call is queued or the stream is dropped (for the worker).
    queued: Condvar,
}

struct State {
    /// Calls not yet taken by the worker (a ring that keeps its capacity, so queuing a
    /// kernel allocates nothing in the steady state, which memory counts would see).
    waiting: VecDeque<Work>,
    queued: u64,
    done: u64,
    /// The first call that panicked: the stream is broken from then on.
    panicked: Option<String>,
    /// The stream is gone: the worker runs what is left and exits.
    closed: bool,
    /// The worker's thread, which must never wait for its own later calls.
    worker: Option<std::thread::ThreadId>,
}

impl Progress {
    /// Whether the calls up to `ticket` have run (an error once one has panicked).
    pub(crate) fn reached(&self, ticket: u64) -> Result<bool> {
        let state = self.state.lock();
        failure(&state)?;
        Ok(state.done >= ticket)
    }

    /// Blocks until the calls up to `ticket` have run (a broken stream skips the rest, so
    /// this returns once nothing queued before `ticket` can still touch memory). Called
    /// from the stream's own worker (a queued call that frees memory or waits), the calls
    /// before the running one have run already; waiting for the running one or later
    /// would never end, and is an error.
    pub(crate) fn wait(&self, ticket: u64) -> Result<()> {
        let mut state = self.state.lock();
        if state.worker == Some(std::thread::current().id()) {
            // The running call is number `done + 1`.
            return match ticket <= state.done {
                true => failure(&state),
                false => Err(Error::Invalid {
                    op: "emulated stream",
                    reason: "a call queued on a stream waits for that stream's own later \
                             work, which would never end; wait on another stream, or from \
                             the host"
                        .into(),
                }),
            };
        }
        while state.done < ticket {
            self.advanced.wait(&mut state);
        }
        failure(&state)
    }
}

fn failure(state: &State) -> Result<()> {
    match &state.panicked {
        Some(message) => Err(Error::Driver {
            call: "emulated stream work".into(),
            message: format!("a call queued on the stream failed: {message}"),
        }),
        None => Ok(()),
    }
}

/// A stream's queue and the thread that runs it. Dropping it lets the worker finish what
/// is queued and exit.
pub(crate) struct Worker {
    progress: Arc<Progress>,
}

impl Worker {
    /// A worker for stream `id` (named after it, for debuggers).
    pub(crate) fn spawn(id: u64) -> Result<Worker> {
        // Odd, so xorshift never sticks at zero.
        let jitter = jitter()?.map(|seed| (seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1);
        let waiting = crate::counters::bookkeeping(|| VecDeque::with_capacity(64));
        let progress = Arc::new(Progress {
            state: Mutex::new(State {
                waiting,
                queued: 0,
                done: 0,
                panicked: None,
                closed: false,
                worker: None,
            }),
            advanced: Condvar::new(),
            queued: Condvar::new(),
        });
        let shared = progress.clone();
        std::thread::Builder::new()
            .name(format!("emulated-stream-{id}"))
            .spawn(move || run(&shared, jitter))
            .map_err(|e| Error::Driver {
                call: "emulated stream start".into(),
                message: e.to_string(),
            })?;
        Ok(Worker { progress })
    }

    /// Queues `work`; returns its number. The queue's growth is bookkeeping
    /// ([`allocating_bookkeeping`](crate::allocating_bookkeeping)): how far it grows
    /// follows how far the worker lags.
    pub(crate) fn queue(&self, work: Work) -> u64 {
        crate::counters::bookkeeping(|| {
            let mut state = self.progress.state.lock();
            state.waiting.push_back(work);
            state.queued += 1;
            self.progress.queued.notify_one();
            state.queued
        })
    }

    /// The number of the last call queued.
    pub(crate) fn position(&self) -> u64 {
        self.progress.state.lock().queued
    }

    /// Blocks until everything queued so far has run.
    pub(crate) fn drain(&self) -> Result<()> {
        let ticket = self.position();
        self.progress.wait(ticket)
    }

    /// Whether this thread is the worker itself (running a queued call).
    pub(crate) fn is_current(&self) -> bool {
        self.progress.state.lock().worker == Some(std::thread::current().id())
    }

    pub(crate) fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.progress.state.lock().closed = true;
        self.progress.queued.notify_one();
    }
}

fn run(progress: &Progress, mut jitter: Option<u64>) {
    progress.state.lock().worker = Some(std::thread::current().id());
    loop {
        let work = {
            let mut state = progress.state.lock();
            loop {
                // A broken stream's later calls are dropped unrun: their inputs may be
                // wrong, and their memory may be freed once the host sees the error.
                while state.panicked.is_some() && state.waiting.pop_front().is_some() {
                    state.done += 1;
                    progress.advanced.notify_all();
                }
                if let Some(work) = state.waiting.pop_front() {
                    break work;
                }
                if state.closed {
                    return;
                }
                progress.queued.wait(&mut state);
            }
        };
        if let Some(state) = &mut jitter {
            delay(state);
        }
        // A panic must not leave the host waiting forever: it breaks the stream instead.
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work.run(&mut jitter)));
        let failed = match outcome {
            Ok(result) => result.err(),
            Err(payload) => Some(
                (payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into()),
            ),
        };
        let mut state = progress.state.lock();
        state.done += 1;
        if let Some(message) = failed {
            state.panicked.get_or_insert(message);
        }
        progress.advanced.notify_all();
    }
}

/// Sleeps before a quarter of the calls, up to 200 µs (xorshift on the stream's seed).
fn delay(state: &mut u64) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    if (*state).is_multiple_of(4) {
        std::thread::sleep(Duration::from_micros((*state >> 8) % 200));
    }
}

/// The seed of `FERROTRON_EMULATED_JITTER` (read at each new stream); `None` when unset.
fn jitter() -> Result<Option<u64>> {
    let Ok(text) = std::env::var("FERROTRON_EMULATED_JITTER") else {
        return Ok(None);
    };
    text.trim()
        .parse::<u64>()
        .map(Some)
        .map_err(|_| Error::Invalid {
            op: "Stream::new",
            reason: format!(
                "FERROTRON_EMULATED_JITTER={text:?} is not a seed: set it to an unsigned \
             integer (e.g. 7), or unset it to run the emulated device without delays"
            ),
        })
}
