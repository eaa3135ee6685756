//! The local backend over views of raw cudarc slices (feature `cuda`; views of the device
//! layer's memory are ordered by events instead, see `streamed`): the same rendezvous and
//! checks as host memory, with the data moved by the devices.
//!
//! Every rank publishes device addresses instead of host ones. Copies between ranks are
//! `cuMemcpyAsync` (unified addressing makes one call serve the same device and peer
//! devices); reductions gather the rank's share of every peer into scratch memory on its
//! own device and reduce it there with an NVRTC kernel, so no kernel ever dereferences
//! another device's memory.
//!
//! Ordering: a rank waits for its buffers' streams before publishing (peers may read as
//! soon as everyone has arrived), queues its moves on the input's stream and waits for
//! them again before the closing barrier, after which no peer touches its memory. A call
//! therefore returns with its result complete, as on the host. A rank whose share fails
//! (a CUDA error) waits for what it queued and marks the call failed with `PeerLost`
//! before it arrives at the closing barrier: its peers must not return a result with that
//! share missing, and it must not return while they still use its buffers.

use super::moves::{Mover, Shape};
use super::{Phase, RankCore};
use crate::buffer::{BufMut, BufRef};
use crate::cuda::{self, Scratch};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Error, Result};
use cudarc::driver::CudaStream;

/// Moves queued on a cudarc stream.
pub(super) struct CudaMover<'a>(pub(super) &'a CudaStream);

impl Mover for CudaMover<'_> {
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        cuda::copy_async(dst, src, bytes, self.0)
    }

    unsafe fn reduce(
        &self,
        op: ReduceOp,
        dtype: DType,
        out: u64,
        sources: &[u64],
        count: usize,
    ) -> Result<()> {
        let bytes = count * dtype.size_in_bytes();
        // Freed on the stream after the reduction that reads it.
        let scratch = Scratch::new(self.0, sources.len() * bytes)?;
        for (row, &src) in sources.iter().enumerate() {
            cuda::copy_async(scratch.ptr() + (row * bytes) as u64, src, bytes, self.0)?;
        }
        // SAFETY: scratch holds one row of `count` elements per source; the caller
        // guarantees `out`.
        unsafe {
            crate::kernels::reduce_rows(self.0, op, dtype, out, scratch.ptr(), count, sources.len())
        }
    }
}

impl RankCore {
    /// Runs one collective over raw cudarc views: wait for the buffers' streams, publish,
    /// rendezvous, queue this rank's moves on the input's stream (the output's for
    /// in-place calls), wait for them, close.
    pub(super) fn device_call(
        &self,
        sig: CallSignature,
        shape: &Shape<'_>,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
    ) -> Result<()> {
        let own = input.as_ref().and_then(BufRef::cuda_stream);
        let stream = own
            .or_else(|| output.cuda_stream())
            .ok_or_else(|| Error::Config(format!("{:?} without a device buffer", sig.op)))?;
        cuda::bind(stream)?;
        cuda::synchronize(stream)?;
        if let (Some(_), Some(output)) = (own, output.cuda_stream()) {
            cuda::synchronize(output)?;
        }
        let recv = output.device_ptr();
        let send = input.map_or(recv, |input| input.device_ptr());
        self.call(|counters| {
            let op = sig.op;
            let seq = self.begin(counters, sig, |ex| {
                (ex.send_ptr, ex.recv_ptr) = (send as usize, recv as usize);
            })?;
            // SAFETY: every rank's buffers stay live and untouched until the closing
            // barrier, which each reaches only after its moves have run.
            let moved = unsafe { self.queue_moves(&CudaMover(stream), seq, shape) };
            if let Err(err) = moved.and_then(|()| cuda::synchronize(stream)) {
                // Copies into peers' buffers may still be queued: let them end before anyone
                // reuses the memory (a second failure changes nothing), then fail the peers,
                // and leave only once they no longer use our buffers either.
                let _ = cuda::synchronize(stream);
                self.group.fail_own(self.rank, &err);
                let _ = self.barrier_step(counters, op, seq, Phase::Close);
                return Err(err);
            }
            self.barrier_step(counters, op, seq, Phase::Close)
        })
    }
}
