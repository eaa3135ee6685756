//! The local backend over CUDA buffers (feature `cuda`): the same rendezvous and checks
//! as host memory, with the data moved by the devices.
//!
//! Every rank publishes device addresses instead of host ones. Copies between ranks are
//! `cuMemcpyAsync` (unified addressing makes one call serve the same device and peer
//! devices); reductions gather the rank's share of every peer into scratch memory on its
//! own device and reduce it there with an NVRTC kernel, so no kernel ever dereferences
//! another device's memory.
//!
//! Ordering: a rank waits for its buffers' streams before publishing (peers may read as
//! soon as everyone has arrived), queues its work on the input's stream and waits for it
//! again before the closing barrier, after which no peer touches its memory. A call
//! therefore returns with its result complete, as on the host. A rank whose share fails
//! (a CUDA error) waits for what it queued and marks the call failed with `PeerLost`
//! before it arrives at the closing barrier: its peers must not return a result with that
//! share missing, and it must not return while they still use its buffers.

use super::{chunk, group, Phase, RankCore};
use crate::buffer::{BufMut, BufRef};
use crate::calls::offsets;
use crate::cuda::{self, Scratch};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Result};
use cudarc::driver::CudaStream;

impl RankCore {
    /// Runs one device collective: publish, rendezvous, `work` (queued on `stream`),
    /// wait, close. `output`, the output buffer's stream when it has its own, is waited
    /// for before publishing too.
    fn device_call(
        &self,
        sig: CallSignature,
        stream: &CudaStream,
        output: Option<&CudaStream>,
        publish: impl FnOnce(&mut group::Exchange),
        work: impl FnOnce(u64) -> Result<()>,
    ) -> Result<()> {
        cuda::bind(stream)?;
        cuda::synchronize(stream)?;
        if let Some(output) = output {
            cuda::synchronize(output)?;
        }
        self.call(|counters| {
            let op = sig.op;
            let seq = self.begin(counters, sig, publish)?;
            if let Err(err) = work(seq).and_then(|()| cuda::synchronize(stream)) {
                // Copies into peers' buffers may still be queued: let them end before anyone
                // reuses the memory (a second failure changes nothing), then fail the peers,
                // and leave only once they no longer use our buffers either.
                let _ = cuda::synchronize(stream);
                self.group.declare_lost(op, seq, self.rank);
                let _ = self.barrier_step(counters, op, seq, Phase::Close);
                return Err(err);
            }
            self.barrier_step(counters, op, seq, Phase::Close)
        })
    }

    /// Queues `out = op over ranks of (peer address + byte_offset)[..count]`.
    #[allow(clippy::too_many_arguments)] // one call site per collective, all positional
    fn device_reduce_share(
        &self,
        stream: &CudaStream,
        seq: u64,
        peer_address: impl Fn(&group::Exchange) -> usize,
        byte_offset: usize,
        out: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let n = self.group.size();
        let bytes = count * dtype.size_in_bytes();
        let scratch = Scratch::new(stream, n * bytes)?;
        for r in 0..n {
            let src = (peer_address(self.peer(r, seq)) + byte_offset) as u64;
            cuda::copy_async(scratch.ptr() + (r * bytes) as u64, src, bytes, stream)?;
        }
        // SAFETY: scratch holds n rows of `count` elements; `out` is our own buffer with
        // room for `count` (agreed signatures).
        unsafe { cuda::reduce_rows(stream, op, dtype, out, scratch.ptr(), count, n) }
    }

    pub(super) fn device_all_reduce(
        &self,
        sig: CallSignature,
        buf: BufMut<'_>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let (len, dtype, ptr) = (buf.len(), buf.dtype(), buf.device_ptr());
        let esize = dtype.size_in_bytes();
        let n = self.group.size();
        let (start, count) = chunk(len, n, self.rank);
        // As on the host: rank r owns chunk r of every buffer during this call.
        self.device_call(
            sig,
            stream,
            None,
            |ex| ex.recv_ptr = ptr as usize,
            |seq| {
                let mine = ptr + (start * esize) as u64;
                let addr = |ex: &group::Exchange| ex.recv_ptr;
                self.device_reduce_share(stream, seq, addr, start * esize, mine, count, dtype, op)?;
                for r in (0..n).filter(|&r| r != self.rank) {
                    let theirs = (self.peer(r, seq).recv_ptr + start * esize) as u64;
                    cuda::copy_async(theirs, mine, count * esize, stream)?;
                }
                Ok(())
            },
        )
    }

    pub(super) fn device_broadcast(
        &self,
        sig: CallSignature,
        buf: BufMut<'_>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let (ptr, bytes) = (buf.device_ptr(), buf.byte_len());
        self.device_call(
            sig,
            stream,
            None,
            |ex| ex.send_ptr = ptr as usize,
            |seq| {
                if self.rank == root {
                    return Ok(());
                }
                let src = self.peer(root, seq).send_ptr as u64;
                cuda::copy_async(ptr, src, bytes, stream)
            },
        )
    }

    pub(super) fn device_all_gather(
        &self,
        sig: CallSignature,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        stream: &CudaStream,
    ) -> Result<()> {
        // Every peer sends its whole input to every rank.
        self.device_collect(sig, input, output, counts, stream, |_| 0)
    }

    pub(super) fn device_reduce_scatter(
        &self,
        sig: CallSignature,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let dtype = input.dtype();
        let (src, out) = (input.device_ptr(), output.device_ptr());
        let offset = offsets(counts)[self.rank] * dtype.size_in_bytes();
        let count = counts[self.rank];
        self.device_call(
            sig,
            stream,
            output.cuda_stream(),
            |ex| ex.send_ptr = src as usize,
            |seq| {
                let addr = |ex: &group::Exchange| ex.send_ptr;
                self.device_reduce_share(stream, seq, addr, offset, out, count, dtype, op)
            },
        )
    }

    pub(super) fn device_all_to_all_v(
        &self,
        sig: CallSignature,
        input: BufRef<'_>,
        output: BufMut<'_>,
        recv_counts: &[usize],
        stream: &CudaStream,
    ) -> Result<()> {
        let rank = self.rank;
        // A peer's block for us starts after its blocks for lower ranks.
        self.device_collect(sig, input, output, recv_counts, stream, |peer| {
            let sends = peer.sig.counts.as_deref().unwrap_or_default();
            sends[..rank].iter().sum()
        })
    }

    /// Fills block r of `output` (`recv_counts[r]` elements) from peer r's input,
    /// starting `send_offset(peer)` elements into it.
    fn device_collect(
        &self,
        sig: CallSignature,
        input: BufRef<'_>,
        output: BufMut<'_>,
        recv_counts: &[usize],
        stream: &CudaStream,
        send_offset: impl Fn(&group::Exchange) -> usize,
    ) -> Result<()> {
        let esize = input.dtype().size_in_bytes();
        let (src, out) = (input.device_ptr(), output.device_ptr());
        self.device_call(
            sig,
            stream,
            output.cuda_stream(),
            |ex| ex.send_ptr = src as usize,
            |seq| {
                for (r, recv_offset) in offsets(recv_counts).into_iter().enumerate() {
                    let peer = self.peer(r, seq);
                    cuda::copy_async(
                        out + (recv_offset * esize) as u64,
                        (peer.send_ptr + send_offset(peer) * esize) as u64,
                        recv_counts[r] * esize,
                        stream,
                    )?;
                }
                Ok(())
            },
        )
    }
}
