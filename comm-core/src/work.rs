//! Handles for non-blocking operations, and the in-order progress queue that backends
//! run them on.

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

/// A started non-blocking operation. [`Work::wait`] returns its result buffer; dropping
/// a `Work` without waiting lets the operation finish and discards the result (for an
/// operation queued on a device, dropping waits for it there).
#[must_use = "a Work must be waited on to get its buffer back and see its error"]
pub struct Work {
    state: WorkState,
}

enum WorkState {
    /// Run by a progress thread, which fills the slot.
    Queued(Arc<Completion>),
    /// Already queued where it runs (a device stream); the closure waits for it (on the
    /// host, or making the buffer's streams wait on the device) and gives the buffer
    /// back. `None` once run.
    Deferred(Option<Finish>),
}

type Finish = Box<dyn FnOnce() -> Result<Buffer> + Send>;

struct Completion {
    result: Mutex<Option<Result<Buffer>>>,
    done: Condvar,
}

impl Work {
    fn new() -> (Work, Arc<Completion>) {
        let slot = Arc::new(Completion {
            result: Mutex::new(None),
            done: Condvar::new(),
        });
        (
            Work {
                state: WorkState::Queued(slot.clone()),
            },
            slot,
        )
    }

    /// An operation already queued elsewhere (on a device stream) that `finish` waits
    /// for (with the backend's watchdog, or by ordering the buffer's streams after it),
    /// and whose buffer it then gives back.
    pub(crate) fn deferred(finish: impl FnOnce() -> Result<Buffer> + Send + 'static) -> Work {
        Work {
            state: WorkState::Deferred(Some(Box::new(finish))),
        }
    }

    /// Whether the operation is known to have finished (successfully or not); an
    /// operation queued on a device reports `false` until waited for.
    pub fn is_done(&self) -> bool {
        match &self.state {
            WorkState::Queued(slot) => slot.result.lock().is_some(),
            WorkState::Deferred(finish) => finish.is_none(),
        }
    }

    /// Blocks until the operation finishes and returns its result buffer or error.
    /// Operations always finish: a lost peer or a timeout ends them with an error.
    pub fn wait(mut self) -> Result<Buffer> {
        match &mut self.state {
            WorkState::Queued(slot) => {
                let mut guard = slot.result.lock();
                loop {
                    if let Some(result) = guard.take() {
                        return result;
                    }
                    slot.done.wait(&mut guard);
                }
            }
            WorkState::Deferred(finish) => match finish.take() {
                Some(finish) => finish(),
                None => unreachable!("a deferred operation runs once, in wait or drop"),
            },
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // The buffer must outlive the device's use of it.
        if let WorkState::Deferred(finish) = &mut self.state {
            if let Some(finish) = finish.take() {
                let _ = finish();
            }
        }
    }
}

impl Completion {
    fn complete(&self, result: Result<Buffer>) {
        *self.result.lock() = Some(result);
        self.done.notify_all();
    }
}

type Job = Box<dyn FnOnce() -> Result<Buffer> + Send>;

/// A lazily started thread that runs a communicator's non-blocking operations one after
/// another, in submission order.
pub(crate) struct ProgressQueue {
    state: Arc<QueueState>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_name: String,
    /// The progress thread's id once started: calls it makes itself must not wait for
    /// the queue to drain (the job making them is in it).
    worker: std::sync::OnceLock<std::thread::ThreadId>,
}

struct QueueState {
    inner: Mutex<QueueInner>,
    changed: Condvar,
}

struct QueueInner {
    jobs: VecDeque<(Job, Arc<Completion>)>,
    /// Jobs submitted and not yet finished (queued or running).
    pending: usize,
    shutdown: bool,
}

impl ProgressQueue {
    pub(crate) fn new(thread_name: String) -> ProgressQueue {
        ProgressQueue {
            state: Arc::new(QueueState {
                inner: Mutex::new(QueueInner {
                    jobs: VecDeque::new(),
                    pending: 0,
                    shutdown: false,
                }),
                changed: Condvar::new(),
            }),
            thread: Mutex::new(None),
            thread_name,
            worker: std::sync::OnceLock::new(),
        }
    }

    /// Queues `job` behind every earlier one.
    pub(crate) fn submit(&self, job: Job) -> Result<Work> {
        let (work, completion) = Work::new();
        {
            let mut thread = self.thread.lock();
            if thread.is_none() {
                let state = self.state.clone();
                let handle = std::thread::Builder::new()
                    .name(self.thread_name.clone())
                    .spawn(move || run_queue(&state))
                    .map_err(|e| Error::Config(format!("cannot start a progress thread: {e}")))?;
                let _ = self.worker.set(handle.thread().id());
                *thread = Some(handle);
            }
        }
        let mut inner = self.state.inner.lock();
        inner.jobs.push_back((job, completion));
        inner.pending += 1;
        self.state.changed.notify_all();
        Ok(work)
    }

    /// Blocks until every submitted job has finished, so that a blocking call issued now
    /// runs after them.
    /// Whether the caller is this queue's progress thread.
    pub(crate) fn is_current_thread(&self) -> bool {
        self.worker.get() == Some(&std::thread::current().id())
    }

    pub(crate) fn wait_idle(&self) {
        if self.is_current_thread() {
            return;
        }
        let mut inner = self.state.inner.lock();
        while inner.pending > 0 {
            self.state.changed.wait(&mut inner);
        }
    }

    /// Lets queued jobs finish, then stops the thread.
    pub(crate) fn shutdown(&self) {
        self.state.inner.lock().shutdown = true;
        self.state.changed.notify_all();
        if let Some(handle) = self.thread.lock().take() {
            // A job never panics out of the queue (see `run_queue`); nothing to report.
            let _ = handle.join();
        }
    }
}

fn run_queue(state: &QueueState) {
    loop {
        let (job, completion) = {
            let mut inner = state.inner.lock();
            loop {
                if let Some(next) = inner.jobs.pop_front() {
                    break next;
                }
                if inner.shutdown {
                    return;
                }
                state.changed.wait(&mut inner);
            }
        };
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).unwrap_or_else(|panic| {
                Err(Error::Config(format!(
                    "a non-blocking operation panicked: {}",
                    crate::error::panic_message(panic.as_ref())
                )))
            });
        completion.complete(result);
        let mut inner = state.inner.lock();
        inner.pending -= 1;
        state.changed.notify_all();
    }
}
