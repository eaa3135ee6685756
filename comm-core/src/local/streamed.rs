//! Collectives over the device layer's memory (a GPU's or the emulated device's),
//! queued on the rank's communication stream of the group as NCCL queues them on its
//! own, and ordered by events alone: the stream waits for the buffers' streams and
//! records that it is ready; the ranks publish their buffers and ready events and meet on
//! the host (as they would at an NCCL call's launch); each rank's stream waits for its
//! peers' ready events, queues its moves (`moves`: copies from and to peers' buffers,
//! reductions) and records that they are done; the ranks meet again to exchange those
//! events, and each stream waits for its peers' before its buffers' streams wait for it
//! (a non-blocking call's when its [`Work`] is waited for, a blocking call's at once:
//! tensor-parallel all-reduces, sequence-parallel gathers, expert all-to-alls). The host
//! waits for none of it. One discipline for both devices: on the emulated device the
//! ordering checker sees every move as the communication stream's access, so a missing
//! wait on any side is a named ordering error, and the same code orders a GPU's moves.
//! Point-to-point messages of such memory are copied on the same stream
//! (`BufRef::to_message`).

use std::sync::Arc;

use ferrotron_device::{Device, Event, Stream};

use super::moves::{Call, Mover, Shape};
use super::{Phase, RankCore};
use crate::buffer::{BufMut, BufRef, Buffer};
use crate::communicator::AsyncOp;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Error, Result};
use crate::work::Work;

impl RankCore {
    /// The rank's communication stream of this group on `device`, made on first use (a
    /// stream of the rank thread's own, as its compute stream is).
    fn comm_stream(&self, device: Device) -> Result<Stream> {
        let mut streams = self.comm_streams.lock();
        if let Some(stream) = streams.iter().find(|s| s.device() == device) {
            return Ok(stream.clone());
        }
        let role = ferrotron_device::Role::Communication;
        // Labelled by the group, so the modelled timeline tells each group's traffic apart.
        let label = self.name();
        let stream = match ferrotron_device::own_streams() {
            true => ferrotron_device::own_stream(device, role, label)?,
            false => Stream::with_label(device, role, label)?,
        };
        streams.push(stream.clone());
        Ok(stream)
    }

    /// The stream a point-to-point message of `view` is copied on: the group's
    /// communication stream for the device layer's memory, as NCCL's transfers run on its
    /// own; `None` for anything else.
    pub(super) fn message_stream(&self, view: &BufRef<'_>) -> Result<Option<Stream>> {
        match view.ordered_on() {
            Some(stream) => self.comm_stream(stream.device()).map(Some),
            None => Ok(None),
        }
    }

    /// Queues `op` on the communication stream when all its buffers are the device
    /// layer's memory (lent tensors and buckets) and the group has peers; otherwise
    /// gives it back for the progress thread.
    pub(super) fn start_streamed(
        self: &Arc<Self>,
        op: AsyncOp,
    ) -> Result<std::result::Result<Work, AsyncOp>> {
        let (call, mut buffers) = match op {
            AsyncOp::AllReduce { buf, op } => (Call::AllReduce(op), vec![buf]),
            AsyncOp::Broadcast { buf, root } => (Call::Broadcast(root), vec![buf]),
            AsyncOp::AllGatherInto { input, output } => {
                (Call::AllGather(None), vec![input, output])
            }
            AsyncOp::ReduceScatterInto { input, output, op } => {
                (Call::ReduceScatter(op, None), vec![input, output])
            }
            other => return Ok(Err(other)),
        };
        let views: Vec<BufRef<'_>> = buffers.iter().map(Buffer::as_buf_ref).collect();
        let Some(holders) = self.holders(&views) else {
            return Ok(Err(rebuild(call, buffers)));
        };
        let done = match &mut buffers[..] {
            [input, output] => {
                let input = input.as_buf_ref();
                self.queue_on_comm_stream(&call, Some(&input), &output.as_buf_mut(), &holders)?
            }
            [buf] => self.queue_on_comm_stream(&call, None, &buf.as_buf_mut(), &holders)?,
            _ => {
                return Err(Error::Config(format!(
                    "{}: one or two buffers",
                    call.name()
                )))
            }
        };
        Ok(Ok(Work::deferred(move || {
            wait_for(&holders, &done)?;
            // The result is the last buffer; an input goes back to its owner only now,
            // once its streams wait for the call.
            let result = buffers.pop();
            drop(buffers);
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
        if self.run_on_comm_stream(&call, input.as_ref(), &output)? {
            return Ok(());
        }
        self.quiesce();
        if let Some(input) = &input {
            input.declare(call.name(), false)?;
        }
        output.declare(call.name(), true)?;
        host(output)
    }

    /// Queues a blocking call over `input` (none when in place) and `output` on the
    /// communication stream, as NCCL queues a blocking call: the buffers' streams wait for
    /// it at once, the host waits for nothing, and work queued after it on those streams
    /// sees the result. `false` (nothing queued) unless every buffer is the device layer's
    /// memory and the group has peers.
    pub(super) fn run_on_comm_stream(
        self: &Arc<Self>,
        call: &Call,
        input: Option<&BufRef<'_>>,
        output: &BufMut<'_>,
    ) -> Result<bool> {
        let views: Vec<BufRef<'_>> = input
            .into_iter()
            .copied()
            .chain([output.as_ref()])
            .collect();
        let Some(holders) = self.holders(&views) else {
            return Ok(false);
        };
        let done = self.queue_on_comm_stream(call, input, output, &holders)?;
        wait_for(&holders, &done)?;
        Ok(true)
    }

    /// The distinct streams `views` are ordered on, when all are the device layer's
    /// memory of one device and the group has peers; `None` for a call the host runs.
    fn holders(&self, views: &[BufRef<'_>]) -> Option<Vec<Stream>> {
        let holders: Vec<Stream> = views
            .iter()
            .map(|view| view.ordered_on().cloned())
            .collect::<Option<_>>()?;
        let device = holders.first()?.device();
        let one_device = holders.iter().all(|s| s.device() == device);
        (one_device && self.group.size() > 1).then(|| dedup(holders))
    }

    /// Queues `call` on the communication stream of the buffers' device after the work
    /// the `holders` queued so far, ordered by events with the peers' streams (see the
    /// module docs); returns the event after which this rank's buffers are free of
    /// every rank's moves. The call's own checks run first, so a bad call is its caller's
    /// typed error with nothing queued.
    fn queue_on_comm_stream(
        self: &Arc<Self>,
        call: &Call,
        input: Option<&BufRef<'_>>,
        output: &BufMut<'_>,
        holders: &[Stream],
    ) -> Result<Event> {
        let (sig, counts) = self.check_call(call, input, output)?;
        let shape = match call {
            Call::AllReduce(_) | Call::Broadcast(_) => Shape::in_place(call, output),
            _ => Shape::blocks(call, output.dtype(), &counts),
        };
        // Calls the progress thread holds come first in the group's order.
        self.queue.wait_idle();
        let comm = self.comm_stream(holders[0].device())?;
        crate::ordering::after_holders(&comm, &holders.iter().collect::<Vec<_>>())?;
        let ready = Arc::new(comm.record()?);
        // Device addresses of the device layer's memory (the emulated device's are host
        // addresses).
        let recv = output.as_ref().host_ptr() as usize;
        let send = input.map_or(recv, |input| input.host_ptr() as usize);
        let bytes = call.ring_bytes(
            input.map(BufRef::byte_len),
            output.byte_len(),
            self.group.size(),
        );
        let op = sig.op;
        self.call(|counters| {
            let seq = self.begin_uninjected(counters, sig, |ex| {
                (ex.send_ptr, ex.recv_ptr) = (send, recv);
                ex.ready = Some(ready);
                *ex.done.get_mut() = None;
            })?;
            ferrotron_device::timeline::charge_transfer(bytes);
            // SAFETY: every rank's buffers are live until its holders wait for the event
            // recorded below, which follows every rank's moves (the done events), and no
            // rank's stream touches them between its ready event and then.
            // A fault injected into the call meets it with its moves queued.
            let moved = self
                .wait_until_peers_ready(&comm, seq)
                .and_then(|()| unsafe {
                    self.queue_moves(&StreamMover(&comm, call.name()), seq, &shape)
                })
                .and_then(|()| self.group.inject(self.rank, op, seq));
            ferrotron_device::timeline::clear_charge();
            if let Err(failed) = &moved {
                // The peers must not return a result with this rank's share missing.
                self.group.fail_own(self.rank, failed);
            }
            // Published whatever happened: the peers' buffers must outlive what was queued.
            let done = comm.record().map(Arc::new);
            if let Ok(done) = &done {
                *self.peer(self.rank, seq).done.lock() = Some(done.clone());
            }
            let closed = self.barrier_step(counters, op, seq, Phase::Close);
            let peers = self.wait_until_peers_done(&comm, seq);
            let outcome = (peers.and(moved).and(closed))
                .and(done.map(drop).map_err(Error::from))
                .and_then(|()| Ok(comm.record()?));
            if outcome.is_err() {
                // The buffers go back to their owners with the error, and moves into and
                // out of them may still be queued here: their streams wait for this one
                // first, so nothing frees or reuses them under a move. If even recording
                // fails the device's context is broken: its queued work never runs, and
                // the frees that follow fail with it.
                let _ = comm
                    .record()
                    .map_err(Error::from)
                    .and_then(|after| wait_for(holders, &after));
            }
            outcome
        })
    }

    /// Makes `comm` wait for every peer's ready event of call `seq`: its buffers are then
    /// ready for this rank's moves.
    fn wait_until_peers_ready(&self, comm: &Stream, seq: u64) -> Result<()> {
        for peer in (0..self.group.size()).filter(|&r| r != self.rank) {
            if let Some(ready) = &self.peer(peer, seq).ready {
                comm.wait(ready)?;
            }
        }
        Ok(())
    }

    /// Makes `comm` wait for every peer's done event of call `seq` (those that published
    /// one): its moves into and out of this rank's buffers have then run.
    fn wait_until_peers_done(&self, comm: &Stream, seq: u64) -> Result<()> {
        for peer in (0..self.group.size()).filter(|&r| r != self.rank) {
            if let Some(done) = self.peer(peer, seq).done.lock().clone() {
                comm.wait(&done)?;
            }
        }
        Ok(())
    }

    /// The call's own checks (lengths, roots, counts): its signature, and each rank's
    /// block for the calls made of blocks.
    fn check_call(
        &self,
        call: &Call,
        input: Option<&BufRef<'_>>,
        output: &BufMut<'_>,
    ) -> Result<(CallSignature, Vec<usize>)> {
        let check = self.check();
        let missing = || Error::Config(format!("{} without an input buffer", call.name()));
        match call {
            Call::AllReduce(op) => Ok((check.all_reduce(output, *op)?, Vec::new())),
            Call::Broadcast(root) => Ok((check.broadcast(output, *root)?, Vec::new())),
            Call::AllGather(counts) => {
                check.all_gather(input.ok_or_else(missing)?, output, counts.as_deref())
            }
            Call::ReduceScatter(op, counts) => {
                check.reduce_scatter(input.ok_or_else(missing)?, output, counts.as_deref(), *op)
            }
            Call::AllToAll { send, recv } => {
                let sig = check.all_to_all_v(input.ok_or_else(missing)?, send, output, recv)?;
                Ok((sig, recv.to_vec()))
            }
        }
    }
}

/// Moves queued on a stream of the device layer, named by their collective: copies as
/// the stream's own, reductions by the reduction kernel (`kernels/reduce.cu`): on the
/// emulated device its host build over every rank's rows where they are (all host
/// memory), on a GPU over rows gathered into this device's memory.
struct StreamMover<'a>(&'a Stream, &'static str);

impl Mover for StreamMover<'_> {
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: as the caller guarantees.
        Ok(unsafe { self.0.copy_as(self.1, dst, src, bytes) }?)
    }

    unsafe fn reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        out: u64,
        sources: &[u64],
        count: usize,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.0.cuda() {
            self.0.bind()?;
            // SAFETY: as the caller guarantees.
            return unsafe {
                super::cuda::CudaMover(stream).reduce(op, dtype, out, sources, count)
            };
        }
        // SAFETY: as the caller guarantees (the emulated device's memory is host memory,
        // every rank's addressable).
        unsafe { crate::kernels::reduce(self.0, self.1, op, dtype, out, sources, count) }
    }
}

/// Makes each of `holders` wait for `done` (a collective on the communication stream).
fn wait_for(holders: &[Stream], done: &Event) -> Result<()> {
    crate::ordering::holders_after(&holders.iter().collect::<Vec<_>>(), done)
}

impl Call {
    /// The bytes each rank sends in a ring implementation of the call over `n` ranks
    /// (what NCCL's bus bandwidth is measured by), for the modelled timeline: `input`
    /// bytes (none when in place) and `output` bytes.
    fn ring_bytes(&self, input: Option<usize>, output: usize, n: usize) -> u64 {
        let (n, steps) = (n as u64, n.saturating_sub(1) as u64);
        let (input, output) = (input.unwrap_or(output) as u64, output as u64);
        match self {
            Call::AllReduce(_) => 2 * steps * output / n,
            Call::Broadcast(_) => output,
            // The gathered output, or the scattered input: the whole buffer.
            Call::AllGather(_) => steps * output / n,
            Call::ReduceScatter(..) => steps * input / n,
            // What this rank sends to the others, about all of its input.
            Call::AllToAll { .. } => steps * input / n,
        }
    }
}

/// The operation again, for the progress thread.
fn rebuild(call: Call, buffers: Vec<Buffer>) -> AsyncOp {
    let mut buffers = buffers.into_iter();
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
