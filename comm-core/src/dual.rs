//! One group reached over two communicators of the same ranks: calls on host memory go
//! to one (local or MPI), calls on device memory to the other (NCCL). This is how a
//! device backend serves a whole training stack, whose metadata (shape checks, loss
//! reports, flags) stays on the host while tensors stay on the device: Megatron pairs
//! its NCCL groups with gloo groups the same way.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::communicator::{AsyncOp, Communicator, P2p, P2pWork};
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::flight_recorder::FlightRecord;
use crate::work::Work;
use crate::Device;

/// A group whose host-memory calls run on `host` and whose device-memory calls run on
/// `device`; both must hold the same ranks in the same order. The name and the flight
/// record are the device communicator's (the host one's until a lazily opened device
/// half is open).
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
    /// The device half: given, or opened by `opening` at the first call that needs it.
    device: OnceLock<Arc<dyn Communicator>>,
    /// How the device halves of groups split from this one are opened, if lazily.
    opening: Option<Arc<Opening>>,
    /// The device half's backend, known before it is open.
    backend: &'static str,
    /// Held while the device half is being opened, so that it is opened once.
    open_lock: Mutex<()>,
    /// Why opening the device half failed: every later call fails with it, never tries
    /// again (ranks that retried at different calls would wait for each other forever).
    open_failed: OnceLock<String>,
}

/// Opens a group's device communicator over the group's host communicator (its
/// bootstrap), collectively over the group's ranks.
pub type DeviceOpener =
    dyn Fn(&Arc<dyn Communicator>) -> Result<Arc<dyn Communicator>> + Send + Sync;

/// What the groups of one lazily opening dual world share: the opener and the names of
/// the groups it has opened on this rank.
struct Opening {
    open: Box<DeviceOpener>,
    opened: Mutex<Vec<String>>,
}

impl DualCommunicator {
    /// Pairs `host` and `device`, which must have the same size and world ranks. Groups
    /// split from it split both halves at once.
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
        Ok(DualCommunicator {
            backend: device.backend(),
            host,
            device: OnceLock::from(device),
            opening: None,
            open_lock: Mutex::new(()),
            open_failed: OnceLock::new(),
        })
    }

    /// [`new`](Self::new), but groups split from it split only their host half, and open
    /// their device half with `open` when a call first needs it (as PyTorch creates a
    /// group's NCCL communicator at its first collective), so a run opens only the device
    /// communicators it uses. A group of one rank opens none: its device calls, which
    /// move nothing between ranks, go to its host half. Opening is collective over the
    /// group: every member's first call on device memory must come before it waits for
    /// another member in anything else (true of collectives; an exchange opens the
    /// device half before its host transfers, so a pipeline's neighbours meet there).
    pub fn opening(
        host: Arc<dyn Communicator>,
        device: Arc<dyn Communicator>,
        open: Box<DeviceOpener>,
    ) -> Result<DualCommunicator> {
        let opening = Opening {
            open,
            opened: Mutex::new(Vec::new()),
        };
        Ok(DualCommunicator {
            opening: Some(Arc::new(opening)),
            ..DualCommunicator::new(host, device)?
        })
    }

    /// An opener for [`opening`](Self::opening) whose device half of a group is a split of
    /// its host half: a second communicator of the same ranks on the same backend, whose
    /// own device paths then serve the group's device memory (the local backend's events
    /// on its communication streams). What the emulated device runs where a GPU would open
    /// NCCL, so the groups a run opens are the same on both.
    pub fn split_opener() -> Box<DeviceOpener> {
        Box::new(|group| {
            let rank = u32::try_from(group.rank()).map_err(|_| {
                Error::Config(format!(
                    "group '{}' has more ranks than a u32",
                    group.name()
                ))
            })?;
            group
                .split(Some(0), rank, group.name())?
                .ok_or_else(|| Error::Config("internal: a split with a color gave no group".into()))
        })
    }

    /// The groups split from this world (directly or not) whose device half this rank
    /// has opened, in the order opened; empty unless made by [`opening`](Self::opening).
    pub fn opened(&self) -> Vec<String> {
        (self.opening.as_ref()).map_or_else(Vec::new, |o| o.opened.lock().clone())
    }

    /// The communicator that serves host memory.
    pub fn host(&self) -> &Arc<dyn Communicator> {
        &self.host
    }

    /// The communicator that serves device memory, opened now if it was not yet. If
    /// opening failed, this call returned that error and every later one returns
    /// [`Error::Broken`] naming it: opening is collective, so it is tried once.
    pub fn device(&self) -> Result<&Arc<dyn Communicator>> {
        if let Some(device) = self.device.get() {
            return Ok(device);
        }
        let _opening = self.open_lock.lock();
        if let Some(device) = self.device.get() {
            return Ok(device);
        }
        if let Some(cause) = self.open_failed.get() {
            return Err(Error::Broken {
                group: self.host.name().to_string(),
                cause: cause.clone(),
            });
        }
        let opening = self.opening.as_ref().ok_or_else(|| {
            Error::Config("internal: a dual communicator without a device half".into())
        })?;
        let device = (opening.open)(&self.host).inspect_err(|error| {
            let _ =
                (self.open_failed).set(format!("opening its device communicator failed: {error}"));
        })?;
        opening.opened.lock().push(self.host.name().to_string());
        Ok(self.device.get_or_init(|| device))
    }

    /// The communicator for a call on memory of `memory`: the host half for host memory,
    /// the device half for any device's (the emulated device's too, as a GPU's would).
    fn route(&self, memory: Device) -> Result<&dyn Communicator> {
        match memory {
            Device::Cpu => Ok(self.host.as_ref()),
            _ => self.device().map(|d| d.as_ref()),
        }
    }

    fn for_ref(&self, buf: &BufRef<'_>) -> Result<&dyn Communicator> {
        self.route(buf.memory())
    }

    fn for_mut(&self, buf: &BufMut<'_>) -> Result<&dyn Communicator> {
        self.route(buf.memory())
    }
}

impl Communicator for DualCommunicator {
    // Both halves hold the same ranks in the same order (checked when paired; a lazily
    // opened half is opened over the host half).
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn name(&self) -> &str {
        // The device half's when paired with one (a lazily opened half has the host's).
        self.device
            .get()
            .map_or(self.host.name(), |device| device.name())
    }
    fn backend(&self) -> &'static str {
        self.backend
    }
    fn world_ranks(&self) -> &[usize] {
        self.host.world_ranks()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.for_mut(&buf)?.all_reduce(buf, op)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.for_mut(&buf)?.broadcast(buf, root)
    }
    // Calls with an input and an output go by the input; the chosen backend rejects an
    // output of the other kind with its own message.
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.for_ref(&input)?.all_gather(input, output)
    }
    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        self.for_ref(&input)?.all_gather_v(input, output, counts)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.for_ref(&input)?.reduce_scatter(input, output, op)
    }
    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.for_ref(&input)?
            .reduce_scatter_v(input, output, counts, op)
    }
    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.for_ref(&input)?
            .all_to_all_v(input, send_counts, output, recv_counts)
    }
    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        self.for_ref(&buf)?.send(buf, dest)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        self.for_mut(&buf)?.recv(buf, src)
    }
    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let on_host = |op: &P2p<'_>| match op {
            P2p::Send { buf, .. } => buf.memory() == Device::Cpu,
            P2p::Recv { buf, .. } => buf.memory() == Device::Cpu,
        };
        if ops.iter().all(on_host) {
            return self.host.exchange(ops);
        }
        // Opened before the host transfers, whose peers may be opening it too.
        let opened = self.device()?;
        if !ops.iter().any(on_host) {
            return opened.exchange(ops);
        }
        // Mixed (the pipeline's host headers beside its device tensors). Every send of
        // both halves is posted before anything waits, as one batch's sends are: a
        // peer's matching transfers may sit in batches of another shape (GPipe's last
        // forward sends its activation beside the first backward's receive, while the
        // next stage receives that activation alone), so a host batch that waited for
        // its receives before the device sends went out would wait forever. The host
        // sends are started, the device batch sends and receives, then the host
        // receives are taken and the host sends finished; after a failure the rest still
        // runs, so that the peers' batches complete too, and the first error is returned.
        let (mut sent, mut host, mut device) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_error = None;
        for op in ops.iter_mut() {
            match op {
                P2p::Send { buf, peer } if buf.memory() == Device::Cpu => {
                    match self.host.isend(*buf, *peer) {
                        Ok(work) => sent.push(work),
                        Err(error) => {
                            first_error.get_or_insert(error);
                        }
                    }
                }
                P2p::Send { buf, peer } => device.push(P2p::Send {
                    buf: *buf,
                    peer: *peer,
                }),
                P2p::Recv { buf, peer } => {
                    let part = if buf.memory() == Device::Cpu {
                        &mut host
                    } else {
                        &mut device
                    };
                    part.push(P2p::Recv {
                        buf: buf.reborrow(),
                        peer: *peer,
                    });
                }
            }
        }
        let outcomes = [opened.exchange(&mut device), self.host.exchange(&mut host)];
        let finished = sent.into_iter().map(|work| work.wait().map(drop));
        for outcome in outcomes.into_iter().chain(finished) {
            if let Err(error) = outcome {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
    fn isend(&self, buf: BufRef<'_>, dest: usize) -> Result<P2pWork> {
        self.for_ref(&buf)?.isend(buf, dest)
    }
    fn irecv(&self, buf: Buffer, src: usize) -> Result<P2pWork> {
        self.route(buf.memory())?.irecv(buf, src)
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
        let Some(opening) = &self.opening else {
            let device = self.device()?.split(color, key, name)?;
            return match (host, device) {
                (Some(host), Some(device)) => {
                    Ok(Some(Arc::new(DualCommunicator::new(host, device)?)))
                }
                _ => Ok(None),
            };
        };
        let Some(host) = host else {
            return Ok(None);
        };
        // A group of one rank: its host half serves its device calls too.
        let device = OnceLock::new();
        if host.size() == 1 {
            let _ = device.set(host.clone());
        }
        Ok(Some(Arc::new(DualCommunicator {
            host,
            device,
            opening: Some(opening.clone()),
            backend: self.backend,
            open_lock: Mutex::new(()),
            open_failed: OnceLock::new(),
        })))
    }
    fn start(&self, op: AsyncOp) -> Result<Work> {
        let buffer = match &op {
            AsyncOp::AllReduce { buf, .. } | AsyncOp::Broadcast { buf, .. } => buf,
            AsyncOp::AllGather { input }
            | AsyncOp::AllGatherInto { input, .. }
            | AsyncOp::ReduceScatter { input, .. }
            | AsyncOp::ReduceScatterInto { input, .. } => input,
        };
        self.route(buffer.memory())?.start(op)
    }
    fn flight_record(&self) -> FlightRecord {
        match self.device.get() {
            Some(device) => device.flight_record(),
            None => self.host.flight_record(),
        }
    }
}

impl std::fmt::Debug for DualCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DualCommunicator")
            .field("group", &self.name())
            .field("host", &self.host.backend())
            .field("device", &self.backend)
            .finish()
    }
}
