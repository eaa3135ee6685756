//! What one rank moves in a collective over device memory once every rank of the group
//! has published its buffers' addresses (`send_ptr`: the input, `recv_ptr`: the output,
//! the same buffer for in-place calls): copies between its buffers and its peers', and
//! reductions of the peers' shares of its chunk. Written once for both ways such a call
//! is ordered: by events on the rank's communication stream (`streamed`, the device
//! layer's memory on a GPU or the emulated device) and by host waits on the buffer's own
//! stream (`cuda`, views of raw cudarc slices). A [`Mover`] queues the moves on one
//! stream.
//!
//! Every algorithm splits the work so that no two ranks write the same bytes and no rank
//! writes bytes another reads in the same call, so the moves of different ranks need no
//! order among themselves: only each rank's buffers' earlier and later work does, which
//! the caller's discipline provides.

use super::{chunk, RankCore};
use crate::buffer::BufMut;
use crate::calls::offsets;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use std::sync::Arc;

/// A collective of the local backend, by kind (and, for the ordered moves, shape).
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

impl Call {
    /// The collective's name, as its flight record and the ordering checker say it.
    pub(super) fn name(&self) -> &'static str {
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

/// Queues the device work of one rank's moves on one stream.
pub(super) trait Mover {
    /// Queues a copy of `bytes` bytes between two device addresses (this rank's or a
    /// peer's).
    ///
    /// # Safety
    /// Both ranges must be valid for `bytes` bytes until the copy has run.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;

    /// Queues `out[i] = op over the sources of source[i]`, `count` elements of `dtype`
    /// each. `out` may be one of the sources.
    ///
    /// # Safety
    /// As [`copy`](Self::copy), for every source and `out`.
    unsafe fn reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        out: u64,
        sources: &[u64],
        count: usize,
    ) -> Result<()>;
}

/// One device collective's shape, as this rank called it (agreed with its peers by their
/// signatures before any move).
pub(super) struct Shape<'a> {
    pub(super) call: &'a Call,
    pub(super) dtype: DType,
    /// The in-place buffer's length (all-reduce, broadcast).
    pub(super) len: usize,
    /// Each rank's block (all-gather, reduce-scatter; the receive counts of an
    /// all-to-all).
    pub(super) counts: &'a [usize],
}

impl<'a> Shape<'a> {
    /// An in-place call over `buf` (all-reduce, broadcast).
    pub(super) fn in_place(call: &'a Call, buf: &BufMut<'_>) -> Shape<'a> {
        Shape {
            call,
            dtype: buf.dtype(),
            len: buf.len(),
            counts: &[],
        }
    }

    /// A call of per-rank blocks of `dtype` (all-gather, reduce-scatter, all-to-all).
    pub(super) fn blocks(call: &'a Call, dtype: DType, counts: &'a [usize]) -> Shape<'a> {
        Shape {
            call,
            dtype,
            len: 0,
            counts,
        }
    }
}

impl RankCore {
    /// Queues this rank's moves of call `seq` (every peer has published) through `mover`.
    ///
    /// # Safety
    /// Every published address must be live for the call's lengths until the moves have
    /// run, and the peers' buffers left alone meanwhile by their own work (the caller's
    /// ordering, on the device or the host).
    pub(super) unsafe fn queue_moves(
        &self,
        mover: &impl Mover,
        seq: u64,
        shape: &Shape<'_>,
    ) -> Result<()> {
        let esize = shape.dtype.size_in_bytes();
        let (me, n) = (self.rank, self.group.size());
        let send = |r: usize| self.peer(r, seq).send_ptr as u64;
        let recv = |r: usize| self.peer(r, seq).recv_ptr as u64;
        let bytes = |count: usize| count * esize;
        let at = |base: u64, elements: usize| base + bytes(elements) as u64;
        // SAFETY (of every move below): as the caller guarantees, with lengths from the
        // agreed signatures.
        unsafe {
            match shape.call {
                // Rank r reduces chunk r of every buffer into its own and writes the
                // result into chunk r of every peer's: each chunk is one rank's alone.
                Call::AllReduce(op) => {
                    let (start, count) = chunk(shape.len, n, me);
                    let chunks: Vec<u64> = (0..n).map(|r| at(recv(r), start)).collect();
                    if count > 0 {
                        mover.reduce(*op, shape.dtype, chunks[me], &chunks, count)?;
                    }
                    for (_, &theirs) in chunks.iter().enumerate().filter(|&(r, _)| r != me) {
                        mover.copy(theirs, chunks[me], bytes(count))?;
                    }
                }
                Call::Broadcast(root) if *root != me => {
                    mover.copy(recv(me), send(*root), bytes(shape.len))?
                }
                Call::Broadcast(_) => {}
                Call::AllGather(_) => {
                    for (r, offset) in offsets(shape.counts).into_iter().enumerate() {
                        mover.copy(at(recv(me), offset), send(r), bytes(shape.counts[r]))?;
                    }
                }
                Call::ReduceScatter(op, _) => {
                    let (offset, count) = (offsets(shape.counts)[me], shape.counts[me]);
                    let shares: Vec<u64> = (0..n).map(|r| at(send(r), offset)).collect();
                    if count > 0 {
                        mover.reduce(*op, shape.dtype, recv(me), &shares, count)?;
                    }
                }
                // A peer's block for us starts after its blocks for lower ranks.
                Call::AllToAll { recv: counts, .. } => {
                    for (r, offset) in offsets(counts).into_iter().enumerate() {
                        let sends = self.peer(r, seq).sig.counts.as_deref().unwrap_or_default();
                        let theirs = at(send(r), sends[..me].iter().sum());
                        mover.copy(at(recv(me), offset), theirs, bytes(counts[r]))?;
                    }
                }
            }
        }
        Ok(())
    }
}
