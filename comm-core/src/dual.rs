//! One group reached over two communicators of the same ranks: calls on host memory go
//! to one (local or MPI), calls on device memory to the other (NCCL). This is how a
//! device backend serves a whole training stack, whose metadata (shape checks, loss
//! reports, flags) stays on the host while tensors stay on the device: Megatron pairs
//! its NCCL groups with gloo groups the same way.

use std::sync::Arc;

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::communicator::{AsyncOp, Communicator, P2p, P2pWork};
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::flight_recorder::FlightRecord;
use crate::work::Work;

/// A group whose host-memory calls run on `host` and whose device-memory calls run on
/// `device`; both must hold the same ranks in the same order. Rank order, names and the
/// flight record are the device communicator's.
///
/// ```
/// use std::sync::Arc;
/// use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, DualCommunicator, ReduceOp};
///
/// let sums = run_local(2, |comm| -> ferrotron_comm_core::Result<f32> {
///     let comm: Arc<dyn Communicator> = Arc::new(comm);
///     // On a GPU machine `device` would be an NcclCommunicator over `comm`.
///     let dual = DualCommunicator::new(comm.clone(), comm)?;
///     let mut x = [1.0f32];
///     dual.all_reduce_slice(&mut x, ReduceOp::Sum)?;
///     Ok(x[0])
/// })?;
/// assert_eq!(sums, [2.0, 2.0]);
/// # Ok::<(), ferrotron_comm_core::Error>(())
/// ```
pub struct DualCommunicator {
    host: Arc<dyn Communicator>,
    device: Arc<dyn Communicator>,
}

impl DualCommunicator {
    /// Pairs `host` and `device`, which must have the same size and world ranks.
    pub fn new(
        host: Arc<dyn Communicator>,
        device: Arc<dyn Communicator>,
    ) -> Result<DualCommunicator> {
        if host.world_ranks() != device.world_ranks() || host.rank() != device.rank() {
            return Err(Error::Config(format!(
                "a dual communicator pairs two communicators of the same ranks; '{}' holds \
                 world ranks {:?} (this is rank {}) and '{}' holds {:?} (rank {})",
                host.name(),
                host.world_ranks(),
                host.rank(),
                device.name(),
                device.world_ranks(),
                device.rank()
            )));
        }
        Ok(DualCommunicator { host, device })
    }

    /// The communicator that serves host memory.
    pub fn host(&self) -> &Arc<dyn Communicator> {
        &self.host
    }

    /// The communicator that serves device memory.
    pub fn device(&self) -> &Arc<dyn Communicator> {
        &self.device
    }

    /// The communicator for a call on memory that is host-addressable (`true`) or not.
    fn route(&self, on_host: bool) -> &dyn Communicator {
        if on_host {
            self.host.as_ref()
        } else {
            self.device.as_ref()
        }
    }

    fn for_ref(&self, buf: &BufRef<'_>) -> &dyn Communicator {
        self.route(buf.memory().is_host_addressable())
    }

    fn for_mut(&self, buf: &BufMut<'_>) -> &dyn Communicator {
        self.route(buf.memory().is_host_addressable())
    }
}

impl Communicator for DualCommunicator {
    fn rank(&self) -> usize {
        self.device.rank()
    }
    fn size(&self) -> usize {
        self.device.size()
    }
    fn name(&self) -> &str {
        self.device.name()
    }
    fn backend(&self) -> &'static str {
        self.device.backend()
    }
    fn world_ranks(&self) -> &[usize] {
        self.device.world_ranks()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.for_mut(&buf).all_reduce(buf, op)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.for_mut(&buf).broadcast(buf, root)
    }
    // Calls with an input and an output go by the input; the chosen backend rejects an
    // output of the other kind with its own message.
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.for_ref(&input).all_gather(input, output)
    }
    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        self.for_ref(&input).all_gather_v(input, output, counts)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.for_ref(&input).reduce_scatter(input, output, op)
    }
    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.for_ref(&input)
            .reduce_scatter_v(input, output, counts, op)
    }
    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.for_ref(&input)
            .all_to_all_v(input, send_counts, output, recv_counts)
    }
    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        self.for_ref(&buf).send(buf, dest)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        self.for_mut(&buf).recv(buf, src)
    }
    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let on_host = |op: &P2p<'_>| match op {
            P2p::Send { buf, .. } => buf.memory().is_host_addressable(),
            P2p::Recv { buf, .. } => buf.memory().is_host_addressable(),
        };
        if ops.iter().all(on_host) {
            return self.host.exchange(ops);
        }
        if !ops.iter().any(on_host) {
            return self.device.exchange(ops);
        }
        // Mixed (the pipeline's host headers beside its device tensors): the host
        // transfers first, then the device ones, one more round trip than a single
        // batch. A peer's matching batch mixes the same way, so both halves pair up in
        // the same order on every rank.
        let (mut host, mut device): (Vec<P2p<'_>>, Vec<P2p<'_>>) = (Vec::new(), Vec::new());
        for op in ops.iter_mut() {
            let part = if on_host(op) { &mut host } else { &mut device };
            part.push(match op {
                P2p::Send { buf, peer } => P2p::Send {
                    buf: *buf,
                    peer: *peer,
                },
                P2p::Recv { buf, peer } => P2p::Recv {
                    buf: buf.reborrow(),
                    peer: *peer,
                },
            });
        }
        self.host.exchange(&mut host)?;
        self.device.exchange(&mut device)
    }
    fn isend(&self, buf: BufRef<'_>, dest: usize) -> Result<P2pWork> {
        self.for_ref(&buf).isend(buf, dest)
    }
    fn irecv(&self, buf: Buffer, src: usize) -> Result<P2pWork> {
        self.route(buf.memory().is_host_addressable())
            .irecv(buf, src)
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
    ) -> Result<Option<Arc<dyn Communicator>>> {
        let host = self.host.split(color, key, name)?;
        let device = self.device.split(color, key, name)?;
        match (host, device) {
            (Some(host), Some(device)) => Ok(Some(Arc::new(DualCommunicator::new(host, device)?))),
            _ => Ok(None),
        }
    }
    fn start(&self, op: AsyncOp) -> Result<Work> {
        let buffer = match &op {
            AsyncOp::AllReduce { buf, .. } | AsyncOp::Broadcast { buf, .. } => buf,
            AsyncOp::AllGather { input }
            | AsyncOp::AllGatherInto { input, .. }
            | AsyncOp::ReduceScatter { input, .. }
            | AsyncOp::ReduceScatterInto { input, .. } => input,
        };
        self.route(buffer.memory().is_host_addressable()).start(op)
    }
    fn flight_record(&self) -> FlightRecord {
        self.device.flight_record()
    }
}

impl std::fmt::Debug for DualCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DualCommunicator")
            .field("group", &self.name())
            .field("host", &self.host.backend())
            .field("device", &self.device.backend())
            .finish()
    }
}
