//! Streams and events as values: work on a stream runs in the order it was queued; an
//! event marks a point in a stream's work that another stream can wait for on the
//! device, or the host can wait for.
//!
//! On CUDA a stream is a driver stream and an event a driver event. An emulated stream
//! runs its work on a worker thread of its own (`crate::emulated`), so the host runs ahead
//! of it as it would of a GPU; what a GPU would guarantee is also followed by the ordering
//! checker (`crate::checker`): every call, record, wait and host wait moves its clocks,
//! and an access that a GPU could run out of order is an error even on a run whose timing
//! happened to hide it.

use std::cell::RefCell;
use std::sync::Arc;

use crate::checker::{self, Access, Clock};
use crate::counters::count_host_wait;
use crate::emulated::{Progress, Work, Worker};
use crate::error::{Error, Result};
use crate::timeline::{self, Role};
use crate::Device;

thread_local! {
    /// The streams made for this thread's own work ([`own_stream`]); `None` while the
    /// thread shares the device's streams (it has not called [`use_own_streams`]).
    static OWN_STREAMS: RefCell<Option<Vec<Stream>>> = const { RefCell::new(None) };
}

/// Gives the device work this thread queues from now on streams no other thread queues
/// on, as each rank of a GPU job has its own: the launcher of ranks as threads calls it
/// on every rank thread, and the crates above (tape's compute stream, a communicator's
/// streams) then make this thread's streams with [`own_stream`] instead of sharing the
/// device's. Work that crosses threads is then ordered only by events and host waits,
/// which the emulated device's ordering checker follows.
pub fn use_own_streams() {
    OWN_STREAMS.with_borrow_mut(|own| {
        own.get_or_insert_with(Vec::new);
    });
}

/// Whether this thread's device work goes on streams of its own ([`use_own_streams`]).
pub fn own_streams() -> bool {
    OWN_STREAMS.with_borrow(|own| own.is_some())
}

/// A new stream on `device` for this thread's own work, for `role`, named `label` on the
/// modelled timeline (a communication stream by its group), kept until
/// [`finish_own_streams`] waits for it.
pub fn own_stream(device: Device, role: Role, label: &str) -> Result<Stream> {
    let owner = Some(std::thread::current().id());
    let stream = Stream::make(device, role, label, owner)?;
    OWN_STREAMS.with_borrow_mut(|own| own.get_or_insert_with(Vec::new).push(stream.clone()));
    Ok(stream)
}

/// What a thread has seen complete on the device, handed to another thread that takes
/// over its results ([`HandOff::receive`]).
#[must_use = "the receiving thread must call `receive`"]
pub struct HandOff(Clock);

impl HandOff {
    /// Orders the calling thread after everything the handing thread had seen complete:
    /// call it once the handing thread has ended (joined), which is what makes this true.
    pub fn receive(self) {
        checker::synchronize_event(&self.0);
    }
}

/// Waits on the host for every stream this thread made with [`own_stream`] (a rank
/// thread's last act, so that its results are complete when another thread takes
/// them), and returns what it has then seen complete, for the thread that joins it. The
/// first failure of a stream is returned after all were waited for.
pub fn finish_own_streams() -> Result<HandOff> {
    let streams = OWN_STREAMS.with_borrow_mut(|own| own.as_mut().map(std::mem::take));
    let mut outcome = Ok(());
    for stream in streams.unwrap_or_default() {
        let waited = stream.synchronize();
        outcome = outcome.and(waited);
    }
    outcome.map(|()| HandOff(checker::thread_clock()))
}

/// An ordered queue of device work. Cloning gives another handle on the same stream.
#[derive(Clone)]
pub struct Stream {
    device: Device,
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Emulated(Arc<EmulatedQueue>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<cudarc::driver::CudaStream>),
}

/// An emulated stream: its agent number in the ordering checker, the worker that runs
/// its calls, and what it is for.
struct EmulatedQueue {
    id: u64,
    worker: Worker,
    role: Role,
    /// What the modelled timeline calls it (`crate::timeline::Interval::label`).
    label: Arc<str>,
    /// The thread whose own stream it is ([`own_stream`]), if any.
    owner: Option<std::thread::ThreadId>,
    /// Held while a call moves the checker's clock and the worker's queue together, so
    /// that an event's clock never covers a call its position does not (threads that
    /// share a stream); it holds the modelled time at which the queued work ends
    /// (`crate::timeline`).
    order: parking_lot::Mutex<f64>,
}

impl Drop for EmulatedQueue {
    fn drop(&mut self) {
        checker::drop_stream(self.id);
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Stream {
    /// A new compute stream on `device` (the emulated device, or a CUDA device of the
    /// `cuda` feature); the host has none.
    pub fn new(device: Device) -> Result<Stream> {
        Stream::with_role(device, Role::Compute)
    }

    /// A new stream on `device` for `role` (which the emulated device's modelled
    /// timeline tells apart; a CUDA stream is a stream whatever its role).
    pub fn with_role(device: Device, role: Role) -> Result<Stream> {
        Stream::make(device, role, role.name(), None)
    }

    /// [`with_role`](Self::with_role), named `label` on the modelled timeline (a
    /// communication stream by its group: `tp`, `dp`).
    pub fn with_label(device: Device, role: Role, label: &str) -> Result<Stream> {
        Stream::make(device, role, label, None)
    }

    /// A new stream, of `owner`'s own if named.
    fn make(
        device: Device,
        role: Role,
        label: &str,
        owner: Option<std::thread::ThreadId>,
    ) -> Result<Stream> {
        let kind = match device {
            Device::Emulated => {
                let id = checker::new_stream();
                let worker = Worker::spawn(id).inspect_err(|_| checker::drop_stream(id))?;
                Kind::Emulated(Arc::new(EmulatedQueue {
                    id,
                    worker,
                    role,
                    label: label.into(),
                    owner,
                    order: parking_lot::Mutex::new(0.0),
                }))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let context = crate::cuda::context(ordinal)?;
                let stream = context
                    .new_stream()
                    .map_err(crate::cuda::driver_error("cuStreamCreate"))?;
                Kind::Cuda(stream)
            }
            _ => {
                return Err(Error::Unsupported {
                    op: "Stream::new",
                    device,
                })
            }
        };
        Ok(Stream { device, kind })
    }

    /// A handle on a cudarc stream made elsewhere (an NCCL communicator's, say).
    #[cfg(feature = "cuda")]
    pub fn from_cuda(stream: Arc<cudarc::driver::CudaStream>) -> Stream {
        Stream {
            device: Device::Cuda(stream.context().ordinal()),
            kind: Kind::Cuda(stream),
        }
    }

    /// The cudarc stream behind a CUDA stream (for cuBLAS, NCCL and raw driver calls);
    /// `None` on the emulated device.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.kind {
            Kind::Cuda(stream) => Some(stream),
            Kind::Emulated(_) => None,
        }
    }

    /// The device the stream's work runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether `other` is a handle on this same stream.
    pub fn same_as(&self, other: &Stream) -> bool {
        match (&self.kind, &other.kind) {
            (Kind::Emulated(a), Kind::Emulated(b)) => Arc::ptr_eq(a, b),
            #[cfg(feature = "cuda")]
            // Default streams are all null: the device tells them apart.
            (Kind::Cuda(a), Kind::Cuda(b)) => {
                self.device == other.device && a.cu_stream() == b.cu_stream()
            }
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }

    /// Makes the stream's context current on this thread, which raw driver calls need (a
    /// no-op on the emulated device).
    pub fn bind(&self) -> Result<()> {
        match &self.kind {
            Kind::Emulated(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Kind::Cuda(stream) => crate::cuda::bind(stream),
        }
    }

    /// Marks the work queued so far: the event completes when it has run.
    pub fn record(&self) -> Result<Event> {
        let kind = match &self.kind {
            Kind::Emulated(queue) => {
                let ready = queue.order.lock();
                EventKind::Emulated {
                    stream: queue.id,
                    clock: checker::record(queue.id),
                    progress: queue.worker.progress().clone(),
                    ticket: queue.worker.position(),
                    at: *ready,
                }
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(stream) => {
                self.bind()?;
                let event = stream
                    .record_event(None)
                    .map_err(crate::cuda::driver_error("cuEventRecord"))?;
                EventKind::Cuda(event)
            }
        };
        Ok(Event {
            device: self.device,
            kind,
        })
    }

    /// Makes the work queued on this stream from now on wait, on the device, until
    /// `event` has completed. The host does not wait.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.kind, &event.kind) {
            (
                Kind::Emulated(queue),
                EventKind::Emulated {
                    stream,
                    clock,
                    progress,
                    ticket,
                    at,
                },
            ) => {
                let mut ready = queue.order.lock();
                *ready = ready.max(*at);
                checker::wait(queue.id, clock);
                // A stream's own events are passed in order already.
                if *stream != queue.id {
                    let (progress, ticket) = (progress.clone(), *ticket);
                    queue.worker.queue(Work::WaitFor { progress, ticket });
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Kind::Cuda(stream), EventKind::Cuda(event)) => {
                self.bind()?;
                stream
                    .wait(event)
                    .map_err(crate::cuda::driver_error("cuStreamWaitEvent"))
            }
            #[cfg(feature = "cuda")]
            _ => Err(Error::Invalid {
                op: "Stream::wait",
                reason: format!(
                    "a stream on {} cannot wait for an event recorded on {}",
                    self.device, event.device
                ),
            }),
        }
    }

    /// Blocks the host until every call queued on the stream has completed (counted in
    /// [`host_waits`](crate::host_waits)).
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            Kind::Emulated(queue) => {
                count_host_wait(self.device);
                let (ticket, clock) = {
                    let ready = queue.order.lock();
                    timeline::host_waited(*ready);
                    (queue.worker.position(), checker::stream_clock(queue.id))
                };
                queue.worker.progress().wait(ticket)?;
                checker::synchronize_stream(queue.id, &clock)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(stream) => crate::cuda::synchronize(stream),
        }
    }

    /// The cudarc stream behind a CUDA stream, or an error naming `op` on another device.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_stream(&self, op: &'static str) -> Result<&cudarc::driver::CudaStream> {
        self.cuda().map(|s| &**s).ok_or(Error::Unsupported {
            op,
            device: self.device,
        })
    }

    /// Declares a call `op` on this stream that reads and writes `accesses` and that the
    /// caller runs on the host as soon as this returns, for work that stands in for a
    /// queued call on the emulated device (a collective of the local backend over
    /// emulated memory, which NCCL would queue): the ordering checker checks and records
    /// it as it does this crate's own calls, and the host waits for the work queued on
    /// the stream before it (not counted as a host wait: on a GPU the call would be
    /// queued). A no-op on CUDA, whose driver orders real work.
    ///
    /// Returns [`Error::Unordered`] when an access conflicts with an earlier one that
    /// nothing orders before it, and an unordered free of memory this stream freed.
    pub fn declare(&self, op: &'static str, accesses: &[Access]) -> Result<()> {
        match &self.kind {
            Kind::Emulated(queue) => {
                let ticket = {
                    let ready = queue.order.lock();
                    checker::queue(queue.id, op, accesses)?;
                    timeline::host_waited(*ready);
                    queue.worker.position()
                };
                queue.worker.progress().wait(ticket)
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => Ok(()),
        }
    }

    /// On the emulated device, blocks until the calls queued so far have run, for host
    /// code that reads or writes the stream's memory in its place (a host view of
    /// emulated memory): not counted as a host wait, and not seen by the ordering checker
    /// (declare the access with [`declare`](Self::declare) for that). A no-op on CUDA.
    pub fn drain_emulated(&self) -> Result<()> {
        match &self.kind {
            Kind::Emulated(queue) => {
                timeline::host_waited(*queue.order.lock());
                queue.worker.drain()
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => Ok(()),
        }
    }

    /// Queues `work`, a call `op` that reads and writes `accesses`, to run on the host in
    /// this stream's order on the emulated device (its reference GEMM, say): checked by
    /// the ordering checker as this crate's own calls are, and run by the stream's worker
    /// after the work queued before it. [`Error::Unsupported`] on CUDA, whose work runs
    /// on the GPU.
    pub fn queue_host(
        &self,
        op: &'static str,
        accesses: &[Access],
        work: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let work = crate::counters::bookkeeping(|| Box::new(work));
        self.queue_emulated(op, accesses, Work::Call(work))
    }

    /// [`queue_host`](Self::queue_host) of work that can fail: its error breaks the
    /// stream (its later calls are skipped, and the next wait for it returns the error,
    /// as does every stream that waits for it).
    pub fn queue_host_fallible(
        &self,
        op: &'static str,
        accesses: &[Access],
        work: impl FnOnce() -> std::result::Result<(), String> + Send + 'static,
    ) -> Result<()> {
        let work = crate::counters::bookkeeping(|| Box::new(work));
        self.queue_emulated(op, accesses, Work::Try(work))
    }

    /// Whether this is another thread's own stream ([`own_stream`]): that thread's
    /// work may wait for what this thread has not queued yet (a collective's other half),
    /// so this thread must not wait for it on the host.
    pub(crate) fn owned_elsewhere(&self) -> bool {
        match &self.kind {
            Kind::Emulated(queue) => queue
                .owner
                .is_some_and(|owner| owner != std::thread::current().id()),
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => false,
        }
    }

    /// Queues `work` on the emulated stream's worker with no access to check (memory
    /// the checker already saw freed).
    pub(crate) fn queue_unchecked(&self, work: Box<dyn FnOnce() + Send>) {
        match &self.kind {
            Kind::Emulated(queue) => {
                let _order = queue.order.lock();
                queue.worker.queue(Work::Call(work));
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => {}
        }
    }

    /// Checks `work`'s accesses and queues it on the emulated stream's worker.
    pub(crate) fn queue_emulated(
        &self,
        op: &'static str,
        accesses: &[Access],
        work: Work,
    ) -> Result<()> {
        match &self.kind {
            Kind::Emulated(queue) => {
                let mut ready = queue.order.lock();
                checker::queue(queue.id, op, accesses).inspect_err(|_| timeline::clear_charge())?;
                let bytes = accesses.iter().map(Access::known_bytes).sum();
                let stream = (queue.id, queue.role, &queue.label);
                timeline::queued(stream, &mut ready, op, bytes);
                queue.worker.queue(work);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => Err(Error::Unsupported {
                op: "Stream::queue_host",
                device: self.device,
            }),
        }
    }

    /// An emulated stream's worker, for this crate's own calls (which check their accesses
    /// first); `None` on CUDA.
    pub(crate) fn emulated_worker(&self) -> Option<&Worker> {
        match &self.kind {
            Kind::Emulated(queue) => Some(&queue.worker),
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => None,
        }
    }

    /// The stream's agent number in the ordering checker (emulated streams only).
    pub(crate) fn agent(&self) -> Option<u64> {
        match &self.kind {
            Kind::Emulated(queue) => Some(queue.id),
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => None,
        }
    }
}

/// A point in a stream's work, recorded by [`Stream::record`].
pub struct Event {
    device: Device,
    kind: EventKind,
}

enum EventKind {
    /// The stream it was recorded on, how far into every stream's work it is ordered, and
    /// the stream's call it completes with.
    Emulated {
        stream: u64,
        clock: Clock,
        progress: Arc<Progress>,
        ticket: u64,
        /// The modelled time at which the work before it ends (`crate::timeline`).
        at: f64,
    },
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaEvent),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("Event");
        debug.field("device", &self.device);
        match &self.kind {
            EventKind::Emulated { stream, clock, .. } => {
                let position = clock.get(*stream);
                debug.field("stream", stream).field("position", &position);
            }
            #[cfg(feature = "cuda")]
            EventKind::Cuda(_) => {}
        }
        debug.finish_non_exhaustive()
    }
}

impl Event {
    /// The device of the stream it was recorded on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the work before it has completed, without waiting. Finding it complete
    /// orders the host after that work, as waiting would.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.kind {
            EventKind::Emulated {
                clock,
                progress,
                ticket,
                ..
            } => {
                let complete = progress.reached(*ticket)?;
                if complete {
                    checker::synchronize_event(clock);
                }
                Ok(complete)
            }
            #[cfg(feature = "cuda")]
            EventKind::Cuda(event) => event
                .try_is_complete()
                .map_err(crate::cuda::driver_error("cuEventQuery")),
        }
    }

    /// Blocks the host until the work before the event has completed (counted in
    /// [`host_waits`](crate::host_waits)).
    pub fn synchronize(&self) -> Result<()> {
        count_host_wait(self.device);
        match &self.kind {
            EventKind::Emulated {
                clock,
                progress,
                ticket,
                at,
                ..
            } => {
                progress.wait(*ticket)?;
                checker::synchronize_event(clock);
                timeline::host_waited(*at);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            EventKind::Cuda(event) => event
                .synchronize()
                .map_err(crate::cuda::driver_error("cuEventSynchronize")),
        }
    }
}
