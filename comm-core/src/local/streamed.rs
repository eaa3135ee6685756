//! Collectives over the emulated device's memory, queued on the rank's communication
//! stream of the group as NCCL queues them on its own: the stream waits for the buffers'
//! streams, runs the collective in their order while the caller goes on (backward's
//! later kernels, say), and the buffers' streams wait for it on the device, with no host
//! wait: a non-blocking call's when its [`Work`] is waited for, a blocking call's at once
//! (tensor-parallel all-reduces, sequence-parallel gathers, expert all-to-alls).
//! Point-to-point messages of such memory are copied on the same stream
//! (`BufRef::to_message`). The ordering checker sees the collective's reads and writes as
//! the communication stream's, so a missing wait on either side is a named ordering
//! error.

use std::sync::Arc;

use ferrotron_device::{Access, Device, Event, Stream};
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
#[derive(Clone)]
pub(super) enum Call {
    AllReduce(crate::ReduceOp),
    Broadcast(usize),
    /// Per-rank counts for the `_v` variant.
    AllGather(Option<Arc<[usize]>>),
    ReduceScatter(crate::ReduceOp, Option<Arc<[usize]>>),
    AllToAll {
        send: Arc<[usize]>,
        recv: Arc<[usize]>,
    },
}

/// Where a queued call's error goes, for the `Work` that reports it.
type Failure = Arc<Mutex<Option<Error>>>;

impl RankCore {
    /// The rank's communication stream of this group on the emulated device, made on
    /// first use (a stream of the rank thread's own, as its compute stream is).
    fn comm_stream(&self) -> Result<Stream> {
        let mut slot = self.comm_stream.lock();
        if let Some(stream) = &*slot {
            return Ok(stream.clone());
        }
        let role = ferrotron_device::Role::Communication;
        // Labelled by the group, so the modelled timeline tells each group's traffic apart.
        let label = self.name();
        let stream = match ferrotron_device::own_streams() {
            true => ferrotron_device::own_stream(Device::Emulated, role, label)?,
            false => Stream::with_label(Device::Emulated, role, label)?,
        };
        *slot = Some(stream.clone());
        Ok(stream)
    }

    /// The stream a point-to-point message of `view` is copied on: the group's
    /// communication stream for emulated device memory of a stream, as NCCL's transfers
    /// run on its own; `None` for anything else.
    pub(super) fn message_stream(&self, view: &BufRef<'_>) -> Result<Option<Stream>> {
        match (view.memory(), view.ordered_on()) {
            (Device::Emulated, Some(_)) => self.comm_stream().map(Some),
            _ => Ok(None),
        }
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
                (Call::AllGather(None), vec![(input, false), (output, true)])
            }
            AsyncOp::ReduceScatterInto { input, output, op } => (
                Call::ReduceScatter(op, None),
                vec![(input, false), (output, true)],
            ),
            other => return Ok(Err(other)),
        };
        let views: Vec<BufRef<'_>> = buffers.iter().map(|(b, _)| b.as_buf_ref()).collect();
        let Some(holders) = self.holders(&views) else {
            return Ok(Err(rebuild(call, buffers)));
        };
        match &mut buffers[..] {
            [(input, _), (output, _)] => {
                self.check_call(&call, Some(&input.as_buf_ref()), &output.as_buf_mut())?
            }
            [(buf, _)] => self.check_call(&call, None, &buf.as_buf_mut())?,
            _ => {
                return Err(Error::Config(format!(
                    "{}: one or two buffers",
                    call.name()
                )))
            }
        }
        let parts: Vec<Part> = buffers.iter().map(|(b, w)| Part::of(b, *w)).collect();
        let (done, failure) = self.queue_on_comm_stream(call, parts, &holders)?;
        let mut kept: Vec<Buffer> = buffers.into_iter().map(|(b, _)| b).collect();
        Ok(Ok(Work::deferred(move || {
            wait_for(&holders, &done)?;
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

    /// Runs a blocking call: on the communication stream when it can
    /// ([`run_on_comm_stream`](Self::run_on_comm_stream)), else `host` on this thread once
    /// the calls queued before it have run and the buffers' streams are declared to the
    /// ordering checker.
    pub(super) fn blocking(
        self: &Arc<Self>,
        call: Call,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        host: impl FnOnce(BufMut<'_>) -> Result<()>,
    ) -> Result<()> {
        if self.run_on_comm_stream(call.clone(), input.as_ref(), &output)? {
            return Ok(());
        }
        self.quiesce()?;
        if let Some(input) = &input {
            input.declare(call.name(), false)?;
        }
        output.declare(call.name(), true)?;
        host(output)
    }

    /// Queues a blocking call over `input` (none when in place) and `output` on the
    /// communication stream, as NCCL queues a blocking call: the buffers' streams wait for
    /// it at once, the host waits for nothing, and work queued after it on those streams
    /// sees the result. `false` (nothing queued) unless every buffer is emulated device
    /// memory of a stream and the group has peers. An error the call meets on the stream
    /// (a peer that disagrees, a timeout) breaks the stream and every stream that waits
    /// for it; the next wait on the host reports it.
    pub(super) fn run_on_comm_stream(
        self: &Arc<Self>,
        call: Call,
        input: Option<&BufRef<'_>>,
        output: &BufMut<'_>,
    ) -> Result<bool> {
        let out = output.as_ref();
        let views: Vec<BufRef<'_>> = input.into_iter().copied().chain([out]).collect();
        let Some(holders) = self.holders(&views) else {
            return Ok(false);
        };
        self.check_call(&call, input, output)?;
        // Calls the progress thread holds come first in the group's order.
        self.queue.wait_idle();
        let part = |view: &BufRef<'_>, write| Part {
            ptr: view.host_ptr() as usize,
            len: view.len(),
            dtype: view.dtype(),
            write,
        };
        let parts = match input {
            Some(input) => vec![part(input, false), part(&out, true)],
            None => vec![part(&out, true)],
        };
        let (done, _failure) = self.queue_on_comm_stream(call, parts, &holders)?;
        wait_for(&holders, &done)?;
        Ok(true)
    }

    /// The distinct streams `views` are ordered on, when all are emulated device memory
    /// of a stream and the group has peers; `None` for a call the host runs.
    fn holders(&self, views: &[BufRef<'_>]) -> Option<Vec<Stream>> {
        let holders: Option<Vec<Stream>> = views
            .iter()
            .map(|view| {
                (view.memory() == Device::Emulated)
                    .then(|| view.ordered_on().cloned())
                    .flatten()
            })
            .collect();
        holders.filter(|_| self.group.size() > 1).map(dedup)
    }

    /// Queues `call` over `parts` on the communication stream after the `holders`' work
    /// queued so far; returns the event of its completion and where its error goes.
    fn queue_on_comm_stream(
        self: &Arc<Self>,
        call: Call,
        parts: Vec<Part>,
        holders: &[Stream],
    ) -> Result<(Event, Failure)> {
        let comm = self.comm_stream()?;
        for holder in holders {
            comm.wait(&holder.record()?)?;
        }
        let failure = Failure::default();
        let (core, failed) = (self.clone(), failure.clone());
        let accesses: Vec<Access> = parts.iter().map(Part::access).collect();
        ferrotron_device::timeline::charge_transfer(call.ring_bytes(&parts, self.group.size()));
        comm.queue_host_fallible(call.name(), &accesses, move || {
            // SAFETY: the buffers' streams, which free and overwrite them, wait for this
            // call before anything they queue later.
            let outcome = unsafe { core.run_streamed(&call, &parts) };
            outcome.map_err(|error| {
                let message = error.to_string();
                *failed.lock() = Some(error);
                message
            })
        })?;
        Ok((comm.record()?, failure))
    }

    /// The call's own checks (lengths, roots, counts), on the host before anything is
    /// queued, so a bad call is its caller's typed error.
    fn check_call(
        &self,
        call: &Call,
        input: Option<&BufRef<'_>>,
        output: &BufMut<'_>,
    ) -> Result<()> {
        let check = self.check();
        let missing = || Error::Config(format!("{} without an input buffer", call.name()));
        match call {
            Call::AllReduce(op) => check.all_reduce(output, *op).map(drop),
            Call::Broadcast(root) => check.broadcast(output, *root).map(drop),
            Call::AllGather(counts) => check
                .all_gather(input.ok_or_else(missing)?, output, counts.as_deref())
                .map(drop),
            Call::ReduceScatter(op, counts) => check
                .reduce_scatter(input.ok_or_else(missing)?, output, counts.as_deref(), *op)
                .map(drop),
            Call::AllToAll { send, recv } => check
                .all_to_all_v(input.ok_or_else(missing)?, send, output, recv)
                .map(drop),
        }
    }

    /// Runs the collective on the communication stream's worker.
    ///
    /// # Safety
    /// As [`Part::input`].
    unsafe fn run_streamed(&self, call: &Call, parts: &[Part]) -> Result<()> {
        // SAFETY: as the caller guarantees.
        unsafe {
            match call {
                Call::AllReduce(op) => self.all_reduce(parts[0].output(), *op),
                Call::Broadcast(root) => self.broadcast(parts[0].output(), *root),
                Call::AllGather(counts) => {
                    self.all_gather(parts[0].input(), parts[1].output(), counts.as_deref())
                }
                Call::ReduceScatter(op, counts) => {
                    self.reduce_scatter(parts[0].input(), parts[1].output(), counts.as_deref(), *op)
                }
                Call::AllToAll { send, recv } => {
                    self.all_to_all_v(parts[0].input(), send, parts[1].output(), recv)
                }
            }
        }
    }
}

/// Makes each of `holders` wait for `done` (a collective on the communication stream).
fn wait_for(holders: &[Stream], done: &Event) -> Result<()> {
    for holder in holders {
        holder.wait(done)?;
    }
    Ok(())
}

impl Call {
    /// The bytes each rank sends in a ring implementation of the call over `n` ranks
    /// (what NCCL's bus bandwidth is measured by), for the modelled timeline.
    fn ring_bytes(&self, parts: &[Part], n: usize) -> u64 {
        let bytes = |p: &Part| (p.len * p.dtype.size_in_bytes()) as u64;
        let (n, steps) = (n as u64, n.saturating_sub(1) as u64);
        match self {
            Call::AllReduce(_) => 2 * steps * bytes(&parts[0]) / n,
            Call::Broadcast(_) => bytes(&parts[0]),
            // The gathered output, or the scattered input: the whole buffer.
            Call::AllGather(_) => steps * bytes(&parts[1]) / n,
            Call::ReduceScatter(..) => steps * bytes(&parts[0]) / n,
            // What this rank sends to the others, about all of its input.
            Call::AllToAll { .. } => steps * bytes(&parts[0]) / n,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Call::AllReduce(_) => "all_reduce",
            Call::Broadcast(_) => "broadcast",
            Call::AllGather(None) => "all_gather",
            Call::AllGather(Some(_)) => "all_gather_v",
            Call::ReduceScatter(_, None) => "reduce_scatter",
            Call::ReduceScatter(_, Some(_)) => "reduce_scatter_v",
            Call::AllToAll { .. } => "all_to_all_v",
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
        Call::AllGather(_) => AsyncOp::AllGatherInto {
            input: next(),
            output: next(),
        },
        Call::ReduceScatter(op, _) => AsyncOp::ReduceScatterInto {
            input: next(),
            output: next(),
            op,
        },
        // Not an asynchronous operation; `start_streamed` makes none.
        Call::AllToAll { .. } => unreachable!("all_to_all_v has no asynchronous form"),
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
