//! The stream discipline of every collective queued on a communication stream, written
//! once for the NCCL backend (cudarc's streams) and the local backend over the device
//! layer's memory (a GPU's or the emulated device's streams): the communication stream
//! waits for the work the buffers' streams queued before the call, and the buffers'
//! streams wait for the call before the work they queue after it. On the emulated device
//! the ordering checker names either wait when it is missing, so these lines are
//! checked without a GPU (`scripts/ordering-mutations.sh`).

use crate::error::Result;

/// A stream that can mark its queued work and wait, on the device, for another's mark.
pub(crate) trait Ordered {
    type Event;

    /// Marks the work queued so far.
    fn mark(&self) -> Result<Self::Event>;

    /// Makes the work queued from now on wait, on the device, for `event`.
    fn wait_for(&self, event: &Self::Event) -> Result<()>;

    /// Whether `other` is this same stream.
    fn same(&self, other: &Self) -> bool;
}

/// Makes `comm` wait for the work each of `holders` (the streams a call's buffers are
/// ordered on) queued so far: the call queued next on `comm` reads and writes the
/// buffers after it. Each stream once.
pub(crate) fn after_holders<S: Ordered>(comm: &S, holders: &[&S]) -> Result<()> {
    for (i, holder) in holders.iter().enumerate() {
        if holders[..i].iter().any(|earlier| earlier.same(holder)) {
            continue;
        }
        comm.wait_for(&holder.mark()?)?;
    }
    Ok(())
}

/// Makes each of `holders` wait for `done` (recorded after the call): the work they queue
/// next, freeing or overwriting a buffer included, follows the call.
pub(crate) fn holders_after<S: Ordered>(holders: &[&S], done: &S::Event) -> Result<()> {
    for holder in holders {
        holder.wait_for(done)?;
    }
    Ok(())
}

impl Ordered for ferrotron_device::Stream {
    type Event = ferrotron_device::Event;

    fn mark(&self) -> Result<Self::Event> {
        Ok(self.record()?)
    }

    fn wait_for(&self, event: &Self::Event) -> Result<()> {
        Ok(self.wait(event)?)
    }

    fn same(&self, other: &Self) -> bool {
        self.same_as(other)
    }
}

#[cfg(feature = "cuda")]
impl Ordered for cudarc::driver::CudaStream {
    type Event = cudarc::driver::CudaEvent;

    fn mark(&self) -> Result<Self::Event> {
        self.record_event(None)
            .map_err(crate::cuda::driver_error("cuEventRecord"))
    }

    fn wait_for(&self, event: &Self::Event) -> Result<()> {
        self.wait(event)
            .map_err(crate::cuda::driver_error("cuStreamWaitEvent"))
    }

    fn same(&self, other: &Self) -> bool {
        self.cu_stream() == other.cu_stream()
    }
}
