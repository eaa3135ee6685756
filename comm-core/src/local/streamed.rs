//! Non-blocking collectives over the emulated device's memory, queued on the rank's
//! communication stream of the group as NCCL queues them on its own: the stream waits
//! for the buffers' streams, runs the collective in their order while the caller goes on
//! (backward's later kernels, say), and the buffers' streams wait for it only when the
//! [`Work`] is waited for, on the device, with no host wait. The ordering checker sees
//! the collective's reads and writes as the communication stream's, so a missing wait on
//! either side is a named ordering error.

use std::sync::Arc;

use ferrotron_device::{Access, Device, Stream};
use parking_lot::Mutex;

use super::RankCore;
use crate::buffer::{BufMut, BufRef, Buffer};
use crate::communicator::AsyncOp;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::work::Work;

/// One buffer of a streamed call: where it is, and whether the call writes it.
#[derive(Clone, Copy)]
struct Part {
    ptr: usize,
    len: usize,
    dtype: DType,
    write: bool,
}

impl Part {
    fn of(buffer: &Buffer, write: bool) -> Part {
        let view = buffer.as_buf_ref();
        Part {
            ptr: view.host_ptr() as usize,
            len: view.len(),
            dtype: view.dtype(),
            write,
        }
    }

    fn access(&self) -> Access {
        let bytes = self.len * self.dtype.size_in_bytes();
        match self.write {
            true => Access::write(self.ptr as u64, bytes),
            false => Access::read(self.ptr as u64, bytes),
        }
    }

    /// The buffer as the queued call reads it.
    ///
    /// # Safety
    /// The memory must be live and left alone by everything else until the call has
    /// run, which stream order guarantees (see `RankCore::start_streamed`).
    unsafe fn input(&self) -> BufRef<'static> {
        // SAFETY: as the caller guarantees.
        unsafe { BufRef::emulated(self.ptr as *const u8, self.len, self.dtype) }
    }

    /// The buffer as the queued call writes it; see [`input`](Self::input).
    unsafe fn output(&self) -> BufMut<'static> {
        // SAFETY: as the caller guarantees.
        unsafe { BufMut::emulated(self.ptr as *mut u8, self.len, self.dtype) }
    }
}

/// What the queued call runs, on views of its parts.
#[derive(Clone, Copy)]
enum Call {
    AllReduce(crate::ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(crate::ReduceOp),
}

impl RankCore {
    /// The rank's communication stream of this group on the emulated device, made on
    /// first use (a stream of the rank thread's own, as its compute stream is).
    fn comm_stream(&self) -> Result<Stream> {
        let mut slot = self.comm_stream.lock();
        if let Some(stream) = &*slot {
            return Ok(stream.clone());
        }
        let role = ferrotron_device::Role::Communication;
        let stream = match ferrotron_device::own_streams() {
            true => ferrotron_device::own_stream(Device::Emulated, role)?,
            false => Stream::with_role(Device::Emulated, role)?,
        };
        *slot = Some(stream.clone());
        Ok(stream)
    }

    /// Lets the calls queued on the communication stream run before a call that the host
    /// runs itself (they come first in the group's order). Not a host wait: on a GPU the
    /// later call would be queued behind them.
    pub(super) fn drain_comm_stream(&self) -> Result<()> {
        let stream = self.comm_stream.lock().clone();
        match stream {
            Some(stream) => Ok(stream.drain_emulated()?),
            None => Ok(()),
        }
    }

    /// Queues `op` on the communication stream when all its buffers are emulated device
    /// memory of a stream (lent tensors and buckets) and the group has peers; otherwise
    /// gives it back for the progress thread.
    pub(super) fn start_streamed(
        self: &Arc<Self>,
        op: AsyncOp,
    ) -> Result<std::result::Result<Work, AsyncOp>> {
        let (call, mut buffers) = match op {
            AsyncOp::AllReduce { buf, op } => (Call::AllReduce(op), vec![(buf, true)]),
            AsyncOp::Broadcast { buf, root } => (Call::Broadcast(root), vec![(buf, true)]),
            AsyncOp::AllGatherInto { input, output } => {
                (Call::AllGather, vec![(input, false), (output, true)])
            }
            AsyncOp::ReduceScatterInto { input, output, op } => (
                Call::ReduceScatter(op),
                vec![(input, false), (output, true)],
            ),
            other => return Ok(Err(other)),
        };
        let holders: Option<Vec<Stream>> = buffers
            .iter()
            .map(|(b, _)| {
                let view = b.as_buf_ref();
                (view.memory() == Device::Emulated)
                    .then(|| view.ordered_on().cloned())
                    .flatten()
            })
            .collect();
        let holders = match holders {
            Some(holders) if self.group.size() > 1 => dedup(holders),
            _ => return Ok(Err(rebuild(call, buffers))),
        };
        self.check_streamed(call, &mut buffers)?;
        let parts: Vec<Part> = buffers.iter().map(|(b, w)| Part::of(b, *w)).collect();
        let comm = self.comm_stream()?;
        for holder in &holders {
            comm.wait(&holder.record()?)?;
        }
        let failure = Arc::new(Mutex::new(None));
        let (core, failed) = (self.clone(), failure.clone());
        let accesses: Vec<Access> = parts.iter().map(Part::access).collect();
        ferrotron_device::timeline::charge_transfer(call.ring_bytes(&parts, self.group.size()));
        comm.queue_host_fallible(call.name(), &accesses, move || {
            // SAFETY: the buffers stay with the `Work`, whose waiting (or dropping) makes
            // their streams, which free and overwrite them, wait for this call.
            let outcome = unsafe { core.run_streamed(call, &parts) };
            outcome.map_err(|error| {
                let message = error.to_string();
                *failed.lock() = Some(error);
                message
            })
        })?;
        let done = comm.record()?;
        let mut kept: Vec<Buffer> = buffers.into_iter().map(|(b, _)| b).collect();
        Ok(Ok(Work::deferred(move || {
            for holder in &holders {
                holder.wait(&done)?;
            }
            // The result is the last buffer; an input goes back to its owner only now,
            // once its streams wait for the call.
            let result = kept.pop();
            drop(kept);
            if let Some(error) = failure.lock().take() {
                return Err(error);
            }
            result.ok_or_else(|| Error::Config("a collective without buffers".into()))
        })))
    }

    /// The call's own checks (lengths, roots), on the host before anything is queued,
    /// so a bad call is its caller's typed error.
    fn check_streamed(&self, call: Call, buffers: &mut [(Buffer, bool)]) -> Result<()> {
        let check = self.check();
        let (first, rest) = buffers.split_at_mut(1);
        let input = first[0].0.as_buf_ref();
        let mut output = rest.first_mut().map(|(b, _)| b.as_buf_mut());
        match (call, output.as_mut()) {
            (Call::AllReduce(op), _) => check.all_reduce(&first[0].0.as_buf_mut(), op).map(drop),
            (Call::Broadcast(root), _) => check.broadcast(&first[0].0.as_buf_mut(), root).map(drop),
            (Call::AllGather, Some(output)) => check.all_gather(&input, output, None).map(drop),
            (Call::ReduceScatter(op), Some(output)) => {
                check.reduce_scatter(&input, output, None, op).map(drop)
            }
            _ => Err(Error::Config(format!(
                "{} without an output buffer",
                call.name()
            ))),
        }
    }

    /// Runs the collective on the communication stream's worker.
    ///
    /// # Safety
    /// As [`Part::input`].
    unsafe fn run_streamed(&self, call: Call, parts: &[Part]) -> Result<()> {
        // SAFETY: as the caller guarantees.
        unsafe {
            match call {
                Call::AllReduce(op) => self.all_reduce(parts[0].output(), op),
                Call::Broadcast(root) => self.broadcast(parts[0].output(), root),
                Call::AllGather => self.all_gather(parts[0].input(), parts[1].output(), None),
                Call::ReduceScatter(op) => {
                    self.reduce_scatter(parts[0].input(), parts[1].output(), None, op)
                }
            }
        }
    }
}

impl Call {
    /// The bytes each rank sends in a ring implementation of the call over `n` ranks
    /// (what NCCL's bus bandwidth is measured by), for the modelled timeline.
    fn ring_bytes(self, parts: &[Part], n: usize) -> u64 {
        let bytes = |p: &Part| (p.len * p.dtype.size_in_bytes()) as u64;
        let (n, steps) = (n as u64, n.saturating_sub(1) as u64);
        match self {
            Call::AllReduce(_) => 2 * steps * bytes(&parts[0]) / n,
            Call::Broadcast(_) => bytes(&parts[0]),
            // The gathered output, or the scattered input: the whole buffer.
            Call::AllGather => steps * bytes(&parts[1]) / n,
            Call::ReduceScatter(_) => steps * bytes(&parts[0]) / n,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Call::AllReduce(_) => "all_reduce",
            Call::Broadcast(_) => "broadcast",
            Call::AllGather => "all_gather",
            Call::ReduceScatter(_) => "reduce_scatter",
        }
    }
}

/// The operation again, for the progress thread.
fn rebuild(call: Call, buffers: Vec<(Buffer, bool)>) -> AsyncOp {
    let mut buffers = buffers.into_iter().map(|(b, _)| b);
    // Invariant, not input: `start_streamed` built `buffers` from this very call, one
    // buffer per slot taken here.
    let mut next = || buffers.next().expect("built from this call's buffers");
    match call {
        Call::AllReduce(op) => AsyncOp::AllReduce { buf: next(), op },
        Call::Broadcast(root) => AsyncOp::Broadcast { buf: next(), root },
        Call::AllGather => AsyncOp::AllGatherInto {
            input: next(),
            output: next(),
        },
        Call::ReduceScatter(op) => AsyncOp::ReduceScatterInto {
            input: next(),
            output: next(),
            op,
        },
    }
}

/// Each stream once.
fn dedup(streams: Vec<Stream>) -> Vec<Stream> {
    let mut distinct: Vec<Stream> = Vec::with_capacity(streams.len());
    for stream in streams {
        if !distinct.iter().any(|s| s.same_as(&stream)) {
            distinct.push(stream);
        }
    }
    distinct
}
