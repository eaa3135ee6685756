//! The backend-independent collective API.

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use crate::flight_recorder::FlightRecord;
use crate::work::Work;
use std::sync::Arc;

/// A group of ranks that can run collectives together.
///
/// Every rank of a group must call the same collectives in the same order; backends
/// check this (always on `local`, in debug mode on `mpi`) and return
/// [`Error::Mismatch`](crate::Error::Mismatch) instead of hanging or corrupting data.
/// Buffers are type-erased views ([`BufRef`], [`BufMut`]); [`CommunicatorExt`] adds
/// typed methods over slices. The trait is object-safe: layers above hold
/// `Arc<dyn Communicator>` and never know which backend runs underneath.
///
/// Blocking calls and non-blocking ones ([`Communicator::start`]) issued on one
/// communicator complete in issue order.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Group name, used in error messages (e.g. `"world"`, `"tp"`).
    fn name(&self) -> &str;
    /// Backend name (`"local"`, `"mpi"`, `"nccl"`).
    fn backend(&self) -> &'static str;
    /// World rank of every member, by group rank.
    fn world_ranks(&self) -> &[usize];

    /// In-place reduction across the group; every rank ends with the result.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Copies `root`'s buffer into every other rank's buffer.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Concatenates every rank's `input` (all the same length) into `output`
    /// (`size() × input.len()` elements), in rank order.
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()>;
    /// Like `all_gather` with per-rank lengths: rank `r` contributes `counts[r]` elements
    /// and `output` holds `counts.iter().sum()`. Every rank passes the same `counts`.
    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()>;
    /// Reduces every rank's `input` (`size() × output.len()` elements) and leaves chunk
    /// `rank()` of the result in `output`.
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Like `reduce_scatter` with per-rank chunk lengths: `input` holds
    /// `counts.iter().sum()` elements and rank `r` receives the `counts[r]` elements at
    /// offset `counts[..r].sum()`. Every rank passes the same `counts`.
    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    /// Personalised exchange: this rank sends `send_counts[r]` consecutive elements of
    /// `input` to rank `r` and receives `recv_counts[r]` elements from rank `r`, placed in
    /// `output` in rank order.
    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Sends `buf` to rank `dest` (not this rank) and returns once `dest` has received
    /// it: a rendezvous on every backend, so two ranks that both send first deadlock
    /// everywhere (the local backend reports it as a timeout) instead of only at scale.
    /// Messages between a pair of ranks arrive in order.
    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()>;
    /// Receives the next message from rank `src` into `buf`, which must match the
    /// message's dtype and length: else the receiver gets
    /// [`Error::Mismatch`](crate::Error::Mismatch) (on `local` the sender too; on `mpi`
    /// the sender's call completes, as MPI only tells the receiver).
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()>;
    /// Starts every send and receive of `ops` together and returns once all of them have
    /// completed, as Megatron's `batch_isend_irecv` followed by a wait: two neighbours that
    /// each send to the other before receiving do not deadlock, whatever order their
    /// batches list the transfers in. Messages between a pair of ranks arrive in the order
    /// they were sent, within a batch in their order in `ops`; a message sent in one
    /// batch may be received in another. Each receive buffer must match its message's
    /// dtype and length, else the receiver gets [`Error::Mismatch`](crate::Error::Mismatch)
    /// (on `local` the sender too). Receive an exchange's messages with an exchange (on
    /// MPI each carries a small header; `send`/`recv` do not).
    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()>;
    /// Starts sending a copy of `buf` to `dest` and returns at once; the handle's
    /// [`wait`](P2pWork::wait) returns once `dest` has received it. Messages between a
    /// pair arrive in the order they were started, whichever of `isend`, `send` and
    /// `exchange` started them.
    fn isend(&self, buf: BufRef<'_>, dest: usize) -> Result<P2pWork>;
    /// Starts receiving the next message from `src` into `buf`, which must match its
    /// dtype and length; the handle's [`wait`](P2pWork::wait) gives `buf` back filled.
    /// Receives from one source take messages in the order they were started, whichever
    /// handle is waited on first, and a started receive takes its message even while
    /// this rank blocks in another call. A message that does not match fails the wait
    /// with `Mismatch` (on `local` the sender's too; on MPI a longer message fails it
    /// with MPI's truncation error). NCCL has neither: use `exchange` there.
    fn irecv(&self, buf: Buffer, src: usize) -> Result<P2pWork>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
    /// Splits the group like `MPI_Comm_split`: ranks passing the same `color` form a new
    /// group, ordered by `key` and then by rank in this group. A rank passing `None` opts
    /// out and gets `Ok(None)`. Every rank must call `split`; `name` names the new group
    /// in messages.
    fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
    ) -> Result<Option<Arc<dyn Communicator>>>;
    /// Starts a non-blocking operation that owns its buffers; the returned [`Work`]
    /// gives the result buffer back.
    fn start(&self, op: AsyncOp) -> Result<Work>;

    /// The flight recorder's recent calls in this group (see
    /// [`flight_recorder`](crate::flight_recorder)): every rank's on the local backend,
    /// this rank's on `mpi` and `nccl`; empty when the recorder is off.
    fn flight_record(&self) -> FlightRecord {
        FlightRecord::default()
    }
}

/// A started [`isend`](Communicator::isend) or [`irecv`](Communicator::irecv).
/// Dropping it without waiting waits (the transfer still uses its buffer), and discards
/// the result.
#[must_use = "a P2pWork must be waited on to see its error (dropping it waits too)"]
pub struct P2pWork {
    finish: Option<Box<dyn FnOnce() -> Result<Option<Buffer>> + Send>>,
    /// How [`abandon`](Self::abandon) withdraws the transfer without running `finish`,
    /// for a transfer that can be withdrawn.
    withdraw: Option<Box<dyn FnOnce() + Send>>,
}

impl P2pWork {
    /// A transfer that `finish` completes: it returns the received buffer, or `None`
    /// for a send.
    pub(crate) fn new(finish: impl FnOnce() -> Result<Option<Buffer>> + Send + 'static) -> Self {
        P2pWork {
            finish: Some(Box::new(finish)),
            withdraw: None,
        }
    }

    /// As [`new`](Self::new), for a transfer that touches its buffer only inside
    /// `finish`, so that abandoning it need not wait: `withdraw` then takes it back from
    /// the backend, so that no later message is matched to it.
    pub(crate) fn withdrawable(
        finish: impl FnOnce() -> Result<Option<Buffer>> + Send + 'static,
        withdraw: impl FnOnce() + Send + 'static,
    ) -> Self {
        P2pWork {
            finish: Some(Box::new(finish)),
            withdraw: Some(Box::new(withdraw)),
        }
    }

    /// Gives the transfer up, for a caller that is failing anyway: its peer may never
    /// come (it may be waiting for this caller). A transfer that has not touched its
    /// buffer yet is withdrawn at once (the local backend's receives: the peer's message
    /// then waits for this rank's next receive, and its sender is not told it was
    /// delivered); any other is waited for, as dropping it does, because the backend may
    /// still be writing.
    pub fn abandon(mut self) {
        if let Some(withdraw) = self.withdraw.take() {
            self.finish = None;
            withdraw();
        }
    }

    /// Waits for the transfer: a receive's filled buffer, `None` for a send. Ends, like
    /// a collective, with an error when the peer is lost or times out.
    pub fn wait(mut self) -> Result<Option<Buffer>> {
        match self.finish.take() {
            Some(finish) => finish(),
            None => Ok(None),
        }
    }
}

impl Drop for P2pWork {
    fn drop(&mut self) {
        if let Some(finish) = self.finish.take() {
            let _ = finish();
        }
    }
}

impl std::fmt::Debug for P2pWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pWork")
            .field("done", &self.finish.is_none())
            .finish()
    }
}

/// One transfer of a batched point-to-point [`Communicator::exchange`].
pub enum P2p<'a> {
    /// Sends `buf` to rank `peer`.
    Send {
        /// The data.
        buf: BufRef<'a>,
        /// The destination rank (not this rank).
        peer: usize,
    },
    /// Receives the next message from rank `peer` into `buf`.
    Recv {
        /// Where the message goes; its dtype and length must match the message's.
        buf: BufMut<'a>,
        /// The source rank (not this rank).
        peer: usize,
    },
}

impl P2p<'_> {
    /// The other rank of this transfer.
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }
}

/// A non-blocking operation: it owns its buffers until [`Work::wait`] hands the result
/// back.
#[derive(Debug)]
pub enum AsyncOp {
    /// In-place all-reduce; the result is `buf`.
    AllReduce {
        /// Data to reduce.
        buf: Buffer,
        /// Reduction operator.
        op: ReduceOp,
    },
    /// Broadcast from `root`; the result is `buf`.
    Broadcast {
        /// Data (significant on the root).
        buf: Buffer,
        /// Root rank.
        root: usize,
    },
    /// All-gather with equal counts; the result is a new buffer of `size × len`.
    AllGather {
        /// This rank's contribution.
        input: Buffer,
    },
    /// All-gather into memory the caller provides (`size × len` elements of the input's
    /// dtype, in the same kind of memory: lent device memory, say); the result is
    /// `output`, and `input` is released when the operation ends.
    AllGatherInto {
        /// This rank's contribution.
        input: Buffer,
        /// Where every rank's contribution goes, in rank order.
        output: Buffer,
    },
    /// Reduce-scatter with equal counts; the result is a new buffer of `len / size`.
    ReduceScatter {
        /// This rank's full input.
        input: Buffer,
        /// Reduction operator.
        op: ReduceOp,
    },
    /// Reduce-scatter into memory the caller provides (`len / size` elements of the
    /// input's dtype, in the same kind of memory: lent device memory, say); the result is
    /// `output`, and `input` is released when the operation ends.
    ReduceScatterInto {
        /// This rank's full input.
        input: Buffer,
        /// Where this rank's reduced chunk goes.
        output: Buffer,
        /// Reduction operator.
        op: ReduceOp,
    },
}

impl AsyncOp {
    /// Runs the operation synchronously on `comm` (what every backend's progress thread
    /// does) and returns the result buffer.
    pub fn run_blocking(self, comm: &dyn Communicator) -> Result<Buffer> {
        match self {
            AsyncOp::AllReduce { mut buf, op } => {
                comm.all_reduce(buf.as_buf_mut(), op)?;
                Ok(buf)
            }
            AsyncOp::Broadcast { mut buf, root } => {
                comm.broadcast(buf.as_buf_mut(), root)?;
                Ok(buf)
            }
            AsyncOp::AllGather { input } => {
                let mut out = Buffer::zeros(input.dtype(), input.len() * comm.size());
                comm.all_gather(input.as_buf_ref(), out.as_buf_mut())?;
                Ok(out)
            }
            AsyncOp::AllGatherInto { input, mut output } => {
                comm.all_gather(input.as_buf_ref(), output.as_buf_mut())?;
                Ok(output)
            }
            AsyncOp::ReduceScatter { input, op } => {
                // A length the group does not divide gets a wrong-size output, which the
                // collective rejects with a message naming both lengths.
                let mut out = Buffer::zeros(input.dtype(), input.len() / comm.size().max(1));
                comm.reduce_scatter(input.as_buf_ref(), out.as_buf_mut(), op)?;
                Ok(out)
            }
            AsyncOp::ReduceScatterInto {
                input,
                mut output,
                op,
            } => {
                comm.reduce_scatter(input.as_buf_ref(), output.as_buf_mut(), op)?;
                Ok(output)
            }
        }
    }
}

/// Typed conveniences over slices, available on every communicator (including
/// `dyn Communicator`).
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce`] over a typed slice.
    fn all_reduce_slice<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(BufMut::from(buf), op)
    }
    /// [`Communicator::broadcast`] over a typed slice.
    fn broadcast_slice<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(BufMut::from(buf), root)
    }
    /// [`Communicator::all_gather`] returning a new vector.
    fn all_gather_vec<T: Element>(&self, input: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::default(); input.len() * self.size()];
        self.all_gather(BufRef::from(input), BufMut::from(out.as_mut_slice()))?;
        Ok(out)
    }
    /// [`Communicator::all_gather_v`] returning a new vector.
    fn all_gather_v_vec<T: Element>(&self, input: &[T], counts: &[usize]) -> Result<Vec<T>> {
        let mut out = vec![T::default(); counts.iter().sum()];
        self.all_gather_v(
            BufRef::from(input),
            BufMut::from(out.as_mut_slice()),
            counts,
        )?;
        Ok(out)
    }
    /// [`Communicator::reduce_scatter`] returning a new vector of `input.len() / size()`.
    fn reduce_scatter_vec<T: Element>(&self, input: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut out = vec![T::default(); input.len() / self.size().max(1)];
        self.reduce_scatter(BufRef::from(input), BufMut::from(out.as_mut_slice()), op)?;
        Ok(out)
    }
    /// [`Communicator::reduce_scatter_v`] returning this rank's chunk.
    fn reduce_scatter_v_vec<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); counts.get(self.rank()).copied().unwrap_or(0)];
        self.reduce_scatter_v(
            BufRef::from(input),
            BufMut::from(out.as_mut_slice()),
            counts,
            op,
        )?;
        Ok(out)
    }
    /// [`Communicator::all_to_all_v`] returning a new vector.
    fn all_to_all_v_vec<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); recv_counts.iter().sum()];
        self.all_to_all_v(
            BufRef::from(input),
            send_counts,
            BufMut::from(out.as_mut_slice()),
            recv_counts,
        )?;
        Ok(out)
    }
    /// [`Communicator::send`] of a typed slice.
    fn send_slice<T: Element>(&self, buf: &[T], dest: usize) -> Result<()> {
        self.send(BufRef::from(buf), dest)
    }
    /// [`Communicator::recv`] into a typed slice.
    fn recv_slice<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.recv(BufMut::from(buf), src)
    }
    /// Non-blocking all-reduce of an owned vector.
    fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Work> {
        self.start(AsyncOp::AllReduce {
            buf: Buffer::from_vec(buf),
            op,
        })
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
