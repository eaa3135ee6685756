//! Streams and events as values: work on a stream runs in the order it was queued; an
//! event marks a point in a stream's work that another stream can wait for on the
//! device, or the host can wait for.
//!
//! On CUDA a stream is a driver stream and an event a driver event. The emulated device
//! runs every call to completion as it is made, so its events are complete when recorded;
//! what a GPU would guarantee is followed by the ordering checker (`crate::checker`):
//! every call, record, wait and host wait moves its clocks, and an access that a GPU could
//! run out of order is an error.

use std::sync::Arc;

use crate::checker::{self, Access, Clock};
use crate::counters::count_host_wait;
use crate::error::{Error, Result};
use crate::Device;

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

/// An emulated stream: its agent number in the ordering checker.
struct EmulatedQueue {
    id: u64,
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
    /// A new stream on `device` (the emulated device, or a CUDA device of the `cuda`
    /// feature); the host has none.
    pub fn new(device: Device) -> Result<Stream> {
        let kind = match device {
            Device::Emulated => Kind::Emulated(Arc::new(EmulatedQueue {
                id: checker::new_stream(),
            })),
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
            Kind::Emulated(queue) => EventKind::Emulated {
                stream: queue.id,
                clock: checker::record(queue.id),
            },
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
            (Kind::Emulated(queue), EventKind::Emulated { clock, .. }) => {
                checker::wait(queue.id, clock);
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
                checker::synchronize_stream(queue.id)
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

    /// Declares a call `op` queued on this stream that reads and writes `accesses`, for
    /// work this crate does not queue itself but runs in the stream's order on the
    /// emulated device (its reference GEMM, a collective of the local backend over
    /// emulated memory): the ordering checker checks and records it as it does this
    /// crate's own calls. A no-op on CUDA, whose driver orders real work.
    ///
    /// Returns [`Error::Unordered`] when an access conflicts with an earlier one that
    /// nothing orders before it, and an unordered free of memory this stream freed.
    pub fn declare(&self, op: &'static str, accesses: &[Access]) -> Result<()> {
        match &self.kind {
            Kind::Emulated(queue) => checker::queue(queue.id, op, accesses),
            #[cfg(feature = "cuda")]
            Kind::Cuda(_) => Ok(()),
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
    /// The stream it was recorded on and how far into every stream's work it is ordered.
    Emulated { stream: u64, clock: Clock },
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaEvent),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut debug = f.debug_struct("Event");
        debug.field("device", &self.device);
        match &self.kind {
            EventKind::Emulated { stream, clock } => {
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
            EventKind::Emulated { clock, .. } => {
                checker::synchronize_event(clock);
                Ok(true)
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
            EventKind::Emulated { clock, .. } => {
                checker::synchronize_event(clock);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            EventKind::Cuda(event) => event
                .synchronize()
                .map_err(crate::cuda::driver_error("cuEventSynchronize")),
        }
    }
}
