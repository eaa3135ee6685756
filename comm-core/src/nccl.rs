//! The `nccl` backend (cargo feature `cuda`): NVIDIA's NCCL moves device memory between
//! GPUs, and another communicator (MPI across processes, or `local` threads) bootstraps
//! it.
//!
//! ```no_run
//! use ferrotron_comm_core::nccl::NcclCommunicator;
//! use ferrotron_comm_core::{cuda, run_local, BufMut, Communicator, ReduceOp};
//! use std::sync::Arc;
//!
//! // Two ranks as threads, one GPU each; under `mpirun` the bootstrap is an MPI world.
//! let sums = run_local(2, |comm| -> ferrotron_comm_core::Result<Vec<f32>> {
//!     let device = comm.rank();
//!     let nccl = NcclCommunicator::new(Arc::new(comm), device)?;
//!     let stream = cuda::context(device)?.default_stream();
//!     let mut x = stream.clone_htod(&[1.0f32; 4]).map_err(cuda::driver_error("clone_htod"))?;
//!     nccl.all_reduce(BufMut::cuda(&mut x, &stream)?, ReduceOp::Sum)?;
//!     stream.clone_dtoh(&x).map_err(cuda::driver_error("clone_dtoh"))
//! })?;
//! assert_eq!(sums[0], vec![2.0; 4]);
//! # Ok::<(), ferrotron_comm_core::Error>(())
//! ```
//!
//! # Bootstrap
//! [`NcclCommunicator::new`] is collective over a bootstrap communicator. Every rank first
//! checks on its own that libnccl and its device are usable; then the ranks tell each
//! other over the bootstrap, so that a failure anywhere is an error on every rank at once
//! instead of a hang: the failing rank returns its own error, the others
//! [`Error::Broken`] naming it and quoting its error. Only then does rank 0 create NCCL's
//! unique id and broadcast it over the bootstrap, and every rank joins the NCCL
//! communicator; failures of those steps are shared the same way.
//! [`split`](Communicator::split) splits the bootstrap and builds one NCCL communicator
//! per new group.
//!
//! # Buffers and stream ordering
//! Buffers are device views ([`BufRef::cuda`], [`BufMut::cuda`]) on the communicator's
//! device; host memory or another device is [`Error::InvalidBuffer`]. NCCL runs on a
//! stream of the communicator's own: a call makes it wait (on the GPU) for the work already
//! queued on the buffers' streams, queues the NCCL kernels behind that, and blocks the
//! calling thread until they finish. A blocking call therefore returns with its result in
//! place, as on every backend, and the caller's streams never wait on NCCL.
//!
//! # Watchdog
//! NCCL itself waits forever for a peer that never arrives. While a call waits, it polls
//! the completion of its kernels and NCCL's asynchronous error: a failure NCCL reports (a
//! peer's connection lost, say) is [`Error::Nccl`] with NCCL's message; past the timeout
//! ([`TIMEOUT_ENV`](crate::local::TIMEOUT_ENV), default 300 s, or
//! [`NcclCommunicator::with_timeout`]) the call is [`Error::Timeout`], which names no
//! missing rank because NCCL cannot tell which one is late. Either way the NCCL
//! communicator is aborted (NCCL's kernels stop) and every later call returns
//! [`Error::Broken`]. The error names the file this rank's last calls were written to
//! (the [flight recorder](crate::flight_recorder)): collect every rank's file to see which
//! one stopped where.
//!
//! # Signature check (opt-in)
//! Each call checks its own arguments (lengths, counts, roots, `Avg` on integers) before
//! communicating. By default ranks do not compare their calls, as NCCL does not: ranks
//! issuing different collectives get wrong results or a timeout. With [`CHECK_ENV`]`=1`
//! (or [`NcclCommunicator::new_with_check`]), as with PyTorch's
//! `TORCH_DISTRIBUTED_DEBUG=DETAIL`, every collective first all-gathers its encoded
//! [`CallSignature`] on the device (a few dozen bytes per rank, one `ncclAllGather` on the
//! communicator's stream, waited for under the watchdog) and compares them on the host
//! with the rule of the other backends: a disagreement is [`Error::Mismatch`] on every
//! rank, naming op, group, sequence number and each rank's arguments, and the
//! communicator stays usable. Zero-element calls are checked too. The check makes every
//! call wait on the host for that all-gather (so the `*_async` calls return only once all
//! ranks have issued the call) and costs one more small NCCL collective per call. Sends
//! and receives pair two ranks, not the group, and are not compared. Every rank must use
//! the same setting: creation compares it and fails on every rank when it differs.
//!
//! # Limits
//! * Without the signature check, a call rejected on some ranks only leaves the others
//!   waiting until their watchdog fires.
//! * f16 and bf16 are reduced by NCCL in its own precision, not in f32 with one rounding as
//!   on the other backends; sums of many values can differ in the last bits.
//! * Non-blocking operations on device buffers are the `*_async` methods
//!   ([`NcclCommunicator::all_reduce_async`], `all_gather_async`, `reduce_scatter_async`):
//!   the returned [`NcclWork`] orders a compute stream after the collective with an event
//!   (`wait_on`) and waits on the host under the watchdog (`wait`, or on drop).
//!   [`Communicator::start`] runs an all-reduce on lent device memory, or a
//!   reduce-scatter from such memory into more of it
//!   ([`Buffer::lent`](crate::Buffer::lent), e.g. a DDP bucket): queued at once, waited
//!   for under the watchdog when its [`Work`] is waited for or dropped. Other operations,
//!   and host buffers, are [`Error::InvalidBuffer`].
//! * Zero-element calls, and the empty blocks of the `_v` calls, return without calling
//!   NCCL (every rank skips the same ones).
//! * NCCL ≤ 2.29 refuses two ranks on one GPU ("Duplicate GPU detected", an error on every
//!   rank); NCCL ≥ 2.30 allows it with `NCCL_MULTI_RANK_GPU_ENABLE=1`.
//! * Joining (`ncclCommInitRank`) and dropping a healthy communicator (`ncclCommDestroy`)
//!   have no timeout: NCCL synchronises them with the other ranks, so create and drop
//!   communicators on all ranks together. A broken communicator was already aborted.

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::calls::{offsets, CallCheck};
use crate::communicator::{AsyncOp, Communicator, CommunicatorExt, P2p, P2pWork};
use crate::cuda::{self, Library};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Error, OpKind, Result};
use crate::flight_recorder::{self, CallRecord, Dump, FlightRecord, Recorder, Ticket};
use crate::signature;
use crate::work::Work;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::result::{self as nccl, NcclError, NcclStatus};
use cudarc::nccl::sys;
use ferrotron_device::Device;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Environment variable that turns on the cross-rank signature check (`1`; off by
/// default, see the module docs).
pub const CHECK_ENV: &str = "FERROTRON_NCCL_CHECK";

/// One rank's handle on an NCCL communicator over the GPUs of a group.
pub struct NcclCommunicator {
    /// Shared with the non-blocking operations in flight, which wait for their NCCL work
    /// under this communicator's watchdog when their [`Work`] is waited for.
    shared: Arc<Shared>,
}

impl std::ops::Deref for NcclCommunicator {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.shared
    }
}

/// What a communicator's handles share.
pub struct Shared {
    /// The group NCCL was bootstrapped over; `split` splits it.
    bootstrap: Arc<dyn Communicator>,
    device: usize,
    rank: usize,
    size: usize,
    name: String,
    world_ranks: Vec<usize>,
    /// The watchdog's limit, in nanoseconds.
    timeout_nanos: std::sync::atomic::AtomicU64,
    /// The stream every NCCL call of this communicator runs on (it holds the context).
    stream: Arc<CudaStream>,
    /// One element that `barrier` all-reduces.
    barrier_buf: CudaSlice<f32>,
    state: Mutex<State>,
    /// This rank's last calls; written under `state`'s lock.
    recorder: Recorder,
}

/// What calls change, behind one lock: NCCL forbids using a communicator from two threads
/// at once, and calls must reach NCCL in one order.
struct State {
    /// The live NCCL communicator, or why it was aborted.
    comm: std::result::Result<RawComm, String>,
    /// Calls issued so far; numbers calls in errors.
    seq: u64,
    /// The signature check's device buffers, when the check is on.
    check: Option<CheckBuffers>,
}

/// Device memory for the signature check's all-gather: this rank's encoded signature and
/// every rank's.
struct CheckBuffers {
    send: CudaSlice<i64>,
    recv: CudaSlice<i64>,
}

/// An `ncclComm_t`, used only under [`NcclCommunicator::state`]'s lock or in drop.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator is not tied to the thread that created it; NCCL only
// requires that calls on it never overlap, which the lock around `State` guarantees.
unsafe impl Send for RawComm {}

/// What each rank sets up on its own before any rank talks to NCCL.
struct Local {
    stream: Arc<CudaStream>,
    barrier_buf: CudaSlice<f32>,
    timeout: Duration,
    flight_recorder: usize,
    check: Option<CheckBuffers>,
    nranks: c_int,
    rank: c_int,
}

impl NcclCommunicator {
    /// Creates this rank's NCCL communicator on CUDA device `device`, over the ranks of
    /// `bootstrap` (same ranks, same order, same name). Every rank of `bootstrap` must
    /// call it; a failure on any rank is an error on all of them (see the module docs).
    /// Collectives compare their signatures across ranks when [`CHECK_ENV`] is `1`.
    pub fn new(bootstrap: Arc<dyn Communicator>, device: usize) -> Result<NcclCommunicator> {
        NcclCommunicator::open(bootstrap, device, None)
    }

    /// [`new`](Self::new) with the cross-rank signature check on or off, whatever
    /// [`CHECK_ENV`] says; every rank must pass the same `check`.
    pub fn new_with_check(
        bootstrap: Arc<dyn Communicator>,
        device: usize,
        check: bool,
    ) -> Result<NcclCommunicator> {
        NcclCommunicator::open(bootstrap, device, Some(check))
    }

    /// Creates the communicator; `check` `None` reads [`CHECK_ENV`].
    fn open(
        bootstrap: Arc<dyn Communicator>,
        device: usize,
        check: Option<bool>,
    ) -> Result<NcclCommunicator> {
        let boot = &*bootstrap;
        let local = open_locally(boot, device, check);
        let agreed = agree(boot, "open its CUDA device and NCCL", local.as_ref().err());
        let local = local?;
        agreed?;
        same_check(boot, local.check.is_some())?;

        // Only now: the id starts a listener on rank 0 that waits for every rank, and it
        // would wait forever for a peer that already gave up.
        let id = (boot.rank() == 0).then(|| {
            nccl::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", boot.name(), &e))
        });
        let agreed = agree(
            boot,
            "create the NCCL unique id",
            id.as_ref().and_then(|id| id.as_ref().err()),
        );
        let id = id.transpose()?;
        agreed?;
        let mut bytes = id.map_or([0u8; 128], |id| id.internal.map(|c| c.to_ne_bytes()[0]));
        boot.broadcast_slice(&mut bytes[..], 0)?;
        let id = sys::ncclUniqueId {
            internal: bytes.map(|b| c_char::from_ne_bytes([b])),
        };

        let comm = init_rank(&local, id, boot.name());
        let agreed = agree(boot, "join the NCCL communicator", comm.as_ref().err());
        let comm = comm?;
        if let Err(e) = agreed {
            // SAFETY: we own this fresh communicator and nothing else uses it. Abort, not
            // destroy: destroying synchronises with peers that gave up.
            let _ = unsafe { nccl::comm_abort(comm.0) };
            return Err(e);
        }
        Ok(NcclCommunicator {
            shared: Arc::new(Shared {
                device,
                rank: boot.rank(),
                size: boot.size(),
                name: boot.name().to_string(),
                world_ranks: boot.world_ranks().to_vec(),
                timeout_nanos: nanos(local.timeout).into(),
                stream: local.stream,
                barrier_buf: local.barrier_buf,
                state: Mutex::new(State {
                    comm: Ok(comm),
                    seq: 0,
                    check: local.check,
                }),
                recorder: Recorder::new(local.flight_recorder),
                bootstrap,
            }),
        })
    }

    /// The same communicator with another collective timeout (the default comes from
    /// [`TIMEOUT_ENV`](crate::local::TIMEOUT_ENV)); groups made by `split` inherit it.
    pub fn with_timeout(self, timeout: Duration) -> NcclCommunicator {
        self.timeout_nanos
            .store(nanos(timeout), std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// How long a call waits for NCCL before aborting the communicator.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(
            self.timeout_nanos
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Whether collectives compare their signatures across ranks first (see the module
    /// docs); groups made by `split` inherit it.
    pub fn checks_signatures(&self) -> bool {
        self.state.lock().check.is_some()
    }

    /// The CUDA device this rank's buffers must live on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Opens groups' NCCL communicators as this one is (same device, signature check and
    /// timeout), for [`DualCommunicator::opening`](crate::DualCommunicator::opening): over a
    /// split of each group's host communicator, so that NCCL's setup never mixes with the
    /// group's own host calls.
    pub fn opener(&self) -> Box<crate::dual::DeviceOpener> {
        let (device, check, timeout) = (self.device, self.checks_signatures(), self.timeout());
        let split = crate::DualCommunicator::split_opener();
        Box::new(move |group| {
            let bootstrap = split(group)?;
            let comm = NcclCommunicator::open(bootstrap, device, Some(check))?;
            Ok(Arc::new(comm.with_timeout(timeout)) as Arc<dyn Communicator>)
        })
    }

    /// NCCL runs a rank's transfers one after another on its stream, so a send started
    /// alone would wait for its receiver before a later receive could start.
    fn no_single_transfers(&self, op: OpKind) -> Error {
        Error::InvalidArgument {
            op,
            group: self.name.clone(),
            detail: "NCCL cannot run a lone non-blocking send or receive without risking a \
                     deadlock; start sends and receives together with `exchange`"
                .into(),
        }
    }

    fn check(&self) -> CallCheck<'_> {
        CallCheck {
            group: &self.name,
            rank: self.rank,
            size: self.size,
        }
    }

    /// The stream a buffer is ordered on, if it is device memory on our device.
    fn stream_of<'v>(
        &self,
        op: OpKind,
        role: &str,
        memory: Device,
        stream: Option<&'v CudaStream>,
    ) -> Result<&'v CudaStream> {
        let device = self.device;
        let detail = match (memory, stream) {
            (Device::Cuda(d), Some(stream)) if d == device => return Ok(stream),
            (Device::Cuda(d), _) => format!(
                "the {role} lives on CUDA device {d}, but this communicator uses device \
                 {device}; pass a buffer on cuda:{device}"
            ),
            (Device::Cpu | Device::Emulated, _) => format!(
                "the {role} is {} memory, and NCCL moves CUDA memory only; pass a view \
                 of device memory on cuda:{device} (`BufRef::cuda` / `BufMut::cuda`), or \
                 use the local or mpi backend for host buffers",
                if memory == Device::Cpu {
                    "host"
                } else {
                    "emulated-device"
                }
            ),
        };
        Err(Error::InvalidBuffer {
            op,
            group: self.name.clone(),
            detail,
        })
    }

    /// The streams of a call's input and output, both checked to be device memory here.
    fn io_streams<'v>(
        &self,
        op: OpKind,
        input: &BufRef<'v>,
        output: &BufMut<'v>,
    ) -> Result<[&'v CudaStream; 2]> {
        Ok([
            self.stream_of(op, "input", input.memory(), input.cuda_stream())?,
            self.stream_of(op, "output", output.memory(), output.cuda_stream())?,
        ])
    }

    /// Runs one call and waits for it (see [`start`](Self::start)).
    fn run(
        &self,
        call: (&CallSignature, Option<usize>),
        streams: &[&CudaStream],
        count: usize,
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Queued,
    ) -> Result<()> {
        self.start(call, streams, count, enqueue)?.wait()
    }

    /// Queues one call (its signature, and the peer of a send or receive) behind the
    /// work on `streams` and returns without waiting. `count` is the number of elements
    /// this rank moves (0: nothing to do). Any failure once the call is under way aborts
    /// the communicator: this rank could no longer pair its later calls with its peers'.
    fn start<'a>(
        &'a self,
        (sig, peer): (&CallSignature, Option<usize>),
        streams: &[&CudaStream],
        count: usize,
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Queued,
    ) -> Result<NcclWork<'a>> {
        let op = sig.op;
        let mut state = self.state.lock();
        let seq = state.seq;
        let record = self.recorder.start(&CallRecord {
            peer,
            ..CallRecord::collective(seq, sig)
        });
        let comm = self
            .live(&state)
            .inspect_err(|_| self.recorder.end(record, false))?;
        state.seq += 1;
        self.cross_check(&mut state, comm, sig, seq)
            .inspect_err(|_| self.recorder.end(record, false))?;
        let done = if count == 0 {
            self.recorder.end(record, true);
            None
        } else {
            let issued = self.issue(comm, streams, enqueue).inspect_err(|_| {
                self.recorder.end(record, false);
            });
            Some(issued.map_err(|e| self.abort(&mut state, e))?)
        };
        Ok(NcclWork {
            communicator: self,
            pending: Pending {
                op,
                seq,
                done,
                record,
                started: Instant::now(),
            },
            _buffers: std::marker::PhantomData,
        })
    }

    /// With the signature check on, all-gathers every rank's encoded signature on the
    /// device and compares them (see [`signature::agree`]): a disagreement is
    /// [`Error::Mismatch`] on every rank and leaves the communicator usable, a failure of
    /// the all-gather itself aborts it. Sends, receives and exchanges pair ranks, not the
    /// group, and are not compared.
    fn cross_check(
        &self,
        state: &mut State,
        comm: sys::ncclComm_t,
        sig: &CallSignature,
        seq: u64,
    ) -> Result<()> {
        let Some(buffers) = state.check.as_mut() else {
            return Ok(());
        };
        if matches!(sig.op, OpKind::Send | OpKind::Recv | OpKind::Exchange) {
            return Ok(());
        }
        let started = Instant::now();
        let checked = signature::agree(&self.name, seq, self.size, sig, &[], |mine, all| {
            self.all_gather_words(comm, buffers, mine, all, (sig.op, seq, started))
        });
        match checked {
            Ok(_) => Ok(()),
            Err(mismatch @ Error::Mismatch { .. }) => Err(mismatch),
            Err(e) => Err(self.abort(state, e)),
        }
    }

    /// The check's all-gather: `mine` to the device, `ncclAllGather` on our stream (behind
    /// what it already runs), waited for under the watchdog as call `seq` started at
    /// `started`, and every rank's words back into `all`.
    fn all_gather_words(
        &self,
        comm: sys::ncclComm_t,
        buffers: &mut CheckBuffers,
        mine: &[i64],
        all: &mut [i64],
        (op, seq, started): (OpKind, u64, Instant),
    ) -> Result<()> {
        self.stream
            .memcpy_htod(mine, &mut buffers.send)
            .map_err(cuda::driver_error("cuMemcpyHtoDAsync"))?;
        let done = {
            let (send, _read) = buffers.send.device_ptr(&self.stream);
            let (recv, _write) = buffers.recv.device_ptr_mut(&self.stream);
            let count = mine.len();
            self.issue(comm, &[], |comm, s| {
                // SAFETY: `send` holds `count` words of our device memory and `recv`
                // `size` times as many (both sized at creation for this group); only our
                // stream uses them, and `watch` below waits for the all-gather before
                // they are read back or reused.
                let r = unsafe {
                    nccl::all_gather(
                        src(send),
                        dst(recv),
                        count,
                        sys::ncclDataType_t::ncclInt64,
                        comm,
                        s,
                    )
                };
                queued("ncclAllGather (signature check)", r)
            })?
        };
        self.watch(comm, &done, op, seq, started)?;
        self.stream
            .memcpy_dtoh(&buffers.recv, all)
            .map_err(cuda::driver_error("cuMemcpyDtoHAsync"))?;
        ferrotron_device::cuda::synchronize(&self.stream).map_err(Error::from)
    }

    /// Aborts the communicator because of `error` (see [`abort_comm`]), then waits, at most
    /// another timeout, for the work NCCL had queued on our stream to end, so that the
    /// caller's buffers are not released while NCCL kernels may still touch them. The
    /// error names the file this rank's flight record was written to: a stuck peer
    /// cannot be asked, so the user collects every rank's file.
    fn abort(&self, state: &mut State, error: Error) -> Error {
        let error = abort_comm(state, error);
        if let Ok(drained) = self.stream.record_event(None) {
            let device = Device::Cuda(self.device);
            let _ = ferrotron_device::cuda::wait_polling(&drained, device, |waited, _| {
                if waited < self.timeout() {
                    Ok(())
                } else {
                    Err(ferrotron_device::Error::Invalid {
                        op: "abort",
                        reason: "NCCL's queued work did not end within the timeout".into(),
                    })
                }
            });
        }
        self.dump().attach(error)
    }

    fn dump(&self) -> Dump<'_> {
        Dump {
            backend: "nccl",
            group: &self.name,
            rank: self.rank,
            size: self.size,
            world_rank: self
                .world_ranks
                .get(self.rank)
                .copied()
                .unwrap_or(self.rank),
            recorder: &self.recorder,
        }
    }

    /// The live NCCL communicator, or `Error::Broken` with why it was aborted.
    fn live(&self, state: &State) -> Result<sys::ncclComm_t> {
        match &state.comm {
            Ok(comm) => Ok(comm.0),
            Err(cause) => Err(Error::Broken {
                group: self.name.clone(),
                cause: cause.clone(),
            }),
        }
    }

    /// Queues the NCCL work on our stream behind `streams`; returns an event recorded
    /// after it.
    fn issue(
        &self,
        comm: sys::ncclComm_t,
        streams: &[&CudaStream],
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Queued,
    ) -> Result<CudaEvent> {
        crate::ordering::after_holders(&*self.stream, streams)?;
        // NCCL queues on the device current on this thread.
        cuda::bind(&self.stream)?;
        enqueue(comm, self.stream.cu_stream().cast())
            .map_err(|(call, e)| nccl_error(call, &self.name, &e))?;
        self.stream
            .record_event(None)
            .map_err(cuda::driver_error("cuEventRecord"))
    }

    /// Waits for `done`, polling NCCL's asynchronous error and the clock (one host wait
    /// in the device layer's count).
    fn watch(
        &self,
        comm: sys::ncclComm_t,
        done: &CudaEvent,
        op: OpKind,
        seq: u64,
        started: Instant,
    ) -> Result<()> {
        ferrotron_device::cuda::wait_polling(done, Device::Cuda(self.device), |_, finished| {
            // Checked after completion too: kernels that NCCL stopped on an error end.
            self.async_error(comm)?;
            let waited = started.elapsed();
            if finished || waited < self.timeout() {
                return Ok(());
            }
            Err(Error::Timeout {
                group: self.name.clone(),
                op,
                seq,
                missing: Vec::new(),
                missing_world: Vec::new(),
                waited,
                // Filled by `abort`: this rank's record and the file it went to.
                history: Box::default(),
            })
        })
    }

    fn async_error(&self, comm: sys::ncclComm_t) -> Result<()> {
        let mut code = sys::ncclResult_t::ncclSuccess;
        let error = |e: NcclError| nccl_error("ncclCommGetAsyncError", &self.name, &e);
        // SAFETY: a live communicator (we hold the lock) and a valid out-pointer.
        unsafe { sys::ncclCommGetAsyncError(comm, &mut code) }
            .result()
            .map_err(error)?;
        code.result().map(drop).map_err(error)
    }
}

/// A collective in flight on an NCCL communicator, from its `*_async` methods: the call's
/// buffers stay borrowed until it is waited for. [`wait_on`](Self::wait_on) orders a
/// compute stream after it on the device (the host goes on queueing work);
/// [`wait`](Self::wait) waits on the host under the watchdog. Dropping it waits too,
/// because the buffers may be freed right after. Leaking it (`mem::forget`) cannot free a
/// buffer under NCCL: the streams the buffers are ordered on and allocated on wait for the
/// collective on the device from the moment it is queued, so nothing later queued on
/// those streams (freeing a buffer included) runs before NCCL is done with it. Work queued
/// on a third stream after a leak is not ordered after the collective; only the call's
/// flight record stays open.
#[must_use = "a collective in flight must be waited for"]
pub struct NcclWork<'a> {
    communicator: &'a NcclCommunicator,
    pending: Pending,
    _buffers: std::marker::PhantomData<&'a mut [u8]>,
}

/// A queued call, until it is waited for.
struct Pending {
    op: OpKind,
    seq: u64,
    /// Recorded after the call's NCCL work; `None` when nothing was queued, or once
    /// waited for.
    done: Option<CudaEvent>,
    /// The call's flight record, ended when the work is waited for.
    record: Ticket,
    started: Instant,
}

impl Pending {
    /// The call's bookkeeping, moved out of `self`, which is left finished.
    fn take(&mut self) -> Pending {
        Pending {
            done: self.done.take(),
            ..*self
        }
    }
}

impl NcclWork<'_> {
    /// Makes `stream` wait, on the device, until the collective has finished: work queued
    /// on it afterwards sees the result. Call [`wait`](Self::wait) before the buffers are
    /// reused from the host or freed.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        match &self.pending.done {
            Some(done) => stream
                .wait(done)
                .map_err(cuda::driver_error("cuStreamWaitEvent")),
            None => Ok(()),
        }
    }

    /// Makes `holders` (the streams its buffers are ordered on and allocated on) wait for
    /// the collective on the device, so that whatever is queued on them next, freeing or
    /// overwriting a buffer included, follows it even when this handle is leaked with
    /// `mem::forget` instead of waited for (what PyTorch's `recordStream` ensures).
    ///
    /// Only for handles given to callers: two ranks on one GPU that queue on one shared
    /// stream deadlock here, since the first rank's wait holds back the work the second
    /// rank's matching collective is queued behind. Blocking calls wait on the host and
    /// skip it (found on an H200 with two ranks under NCCL 2.30).
    fn held_by(self, holders: &[&CudaStream]) -> Result<Self> {
        if let Some(done) = &self.pending.done {
            crate::ordering::holders_after(holders, done)?;
        }
        Ok(self)
    }

    /// Waits until the collective has finished, under the watchdog: an NCCL error or the
    /// timeout aborts the communicator and is returned.
    pub fn wait(mut self) -> Result<()> {
        self.finish()
    }

    /// [`wait`](Self::wait) for a blocking call: on the host alone when it succeeds; when
    /// it fails (the communicator is aborted, and its kernels may not have ended within
    /// the drain), `holders` wait on the device for whatever NCCL had queued, so memory
    /// the caller frees next is not freed under a kernel still writing it.
    fn wait_blocking(mut self, holders: &[&CudaStream]) -> Result<()> {
        let result = self.finish();
        if result.is_err() {
            if let Ok(drained) = self.communicator.stream.record_event(None) {
                for stream in holders {
                    let _ = stream.wait(&drained);
                }
            }
        }
        result
    }

    fn finish(&mut self) -> Result<()> {
        self.communicator.complete(&mut self.pending)
    }
}

impl NcclCommunicator {
    /// The [`Work`] of a call queued on lent memory: it waits under the watchdog and
    /// hands back `result`, keeping `released` (an input) alive until then. The buffers
    /// travel with the work, so the memory outlives NCCL's use of it, and no stream of
    /// the owner waits on NCCL.
    fn deferred(&self, mut pending: Pending, result: Buffer, released: Option<Buffer>) -> Work {
        let handle = NcclCommunicator {
            shared: self.shared.clone(),
        };
        Work::deferred(move || match handle.complete(&mut pending) {
            Ok(()) => {
                drop(released);
                Ok(result)
            }
            Err(error) => {
                // Every failure has aborted the communicator, whose kernels may outlive a
                // drain that timed out: keep the memory (and its owner's lease) rather
                // than hand back what NCCL might still write.
                std::mem::forget((result, released));
                Err(error)
            }
        })
    }

    /// Waits for a queued call under the watchdog and ends its flight record (once).
    fn complete(&self, pending: &mut Pending) -> Result<()> {
        let Some(done) = pending.done.take() else {
            return Ok(());
        };
        let mut state = self.state.lock();
        let comm = self
            .live(&state)
            .inspect_err(|_| self.recorder.end(pending.record, false))?;
        let watched = self.watch(comm, &done, pending.op, pending.seq, pending.started);
        self.recorder.end(pending.record, watched.is_ok());
        watched.map_err(|e| self.abort(&mut state, e))
    }
}

impl Drop for NcclWork<'_> {
    fn drop(&mut self) {
        // An error here has aborted the communicator, so later calls report it as Broken.
        let _ = self.finish();
    }
}

impl NcclCommunicator {
    /// [`Communicator::all_reduce`] without waiting: see [`NcclWork`].
    pub fn all_reduce_async<'a>(&'a self, buf: BufMut<'a>, op: ReduceOp) -> Result<NcclWork<'a>> {
        let holders = buf.cuda_holders();
        self.queue_all_reduce(buf, op)?.held_by(&holders)
    }

    /// Queues an all-reduce on NCCL's stream behind the work queued on `buf`'s stream,
    /// without making any stream wait for it.
    fn queue_all_reduce<'a>(&'a self, buf: BufMut<'a>, op: ReduceOp) -> Result<NcclWork<'a>> {
        let kind = OpKind::AllReduce;
        let sig = self.check().all_reduce(&buf, op)?;
        let stream = self.stream_of(kind, "buffer", buf.memory(), buf.cuda_stream())?;
        let (ptr, count, dtype) = (buf.device_ptr(), buf.len(), nccl_dtype(buf.dtype()));
        self.start((&sig, None), &[stream], count, |comm, s| {
            // SAFETY: as for the blocking calls; in place, as NCCL allows. The work
            // borrows `buf` until it has been waited for (the caller keeps it alive past
            // a leak: see `all_reduce_async` and `start`).
            let r =
                unsafe { nccl::all_reduce(src(ptr), dst(ptr), count, dtype, nccl_op(op), comm, s) };
            queued("ncclAllReduce", r)
        })
    }

    /// [`Communicator::all_gather`] without waiting: see [`NcclWork`].
    pub fn all_gather_async<'a>(
        &'a self,
        input: BufRef<'a>,
        output: BufMut<'a>,
    ) -> Result<NcclWork<'a>> {
        let holders = [input.cuda_holders(), output.cuda_holders()].concat();
        self.queue_all_gather(input, output)?.held_by(&holders)
    }

    /// Queues an all-gather on NCCL's stream behind the work queued on both buffers'
    /// streams, without making any stream wait for it.
    fn queue_all_gather<'a>(
        &'a self,
        input: BufRef<'a>,
        output: BufMut<'a>,
    ) -> Result<NcclWork<'a>> {
        let kind = OpKind::AllGather;
        let (sig, _) = self.check().all_gather(&input, &output, None)?;
        let streams = self.io_streams(kind, &input, &output)?;
        let (from, to) = (input.device_ptr(), output.device_ptr());
        let (count, dtype) = (input.len(), nccl_dtype(input.dtype()));
        self.start((&sig, None), &streams, count, |comm, s| {
            // SAFETY: as for the blocking calls; the work borrows both buffers.
            let r = unsafe { nccl::all_gather(src(from), dst(to), count, dtype, comm, s) };
            queued("ncclAllGather", r)
        })
    }

    /// [`Communicator::reduce_scatter`] without waiting: see [`NcclWork`].
    pub fn reduce_scatter_async<'a>(
        &'a self,
        input: BufRef<'a>,
        output: BufMut<'a>,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let holders = [input.cuda_holders(), output.cuda_holders()].concat();
        self.queue_reduce_scatter(input, output, op)?
            .held_by(&holders)
    }

    /// Queues a reduce-scatter on NCCL's stream behind the work queued on both buffers'
    /// streams, without making any stream wait for it.
    fn queue_reduce_scatter<'a>(
        &'a self,
        input: BufRef<'a>,
        output: BufMut<'a>,
        op: ReduceOp,
    ) -> Result<NcclWork<'a>> {
        let kind = OpKind::ReduceScatter;
        let (sig, _) = self.check().reduce_scatter(&input, &output, None, op)?;
        let streams = self.io_streams(kind, &input, &output)?;
        let (from, to) = (input.device_ptr(), output.device_ptr());
        let (count, dtype) = (output.len(), nccl_dtype(input.dtype()));
        self.start((&sig, None), &streams, count, |comm, s| {
            // SAFETY: as for the blocking calls; the work borrows both buffers.
            let r = unsafe {
                nccl::reduce_scatter(src(from), dst(to), count, dtype, nccl_op(op), comm, s)
            };
            queued("ncclReduceScatter", r)
        })
    }
}

/// Aborts the communicator (if still live) because of `error`, which later calls report
/// as the cause, and returns `error`.
/// `duration` in whole nanoseconds, saturating (a timeout of centuries is no timeout).
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

fn abort_comm(state: &mut State, error: Error) -> Error {
    if let Ok(comm) = std::mem::replace(&mut state.comm, Err(error.to_string())) {
        // SAFETY: a live communicator that nothing uses after this (we hold the lock and
        // replaced it). A failed abort leaves nothing better to do.
        let _ = unsafe { nccl::comm_abort(comm.0) };
    }
    error
}

/// `check` `None` reads [`CHECK_ENV`].
fn open_locally(bootstrap: &dyn Communicator, device: usize, check: Option<bool>) -> Result<Local> {
    let timeout = crate::local::timeout_from_env()?;
    let flight_recorder = flight_recorder::capacity_from_env()?;
    let check = match check {
        Some(check) => check,
        None => signature::switch_from_env(CHECK_ENV, false)?,
    };
    let int = |what: &str, value: usize| {
        c_int::try_from(value).map_err(|_| {
            Error::Config(format!(
                "{what} {value} exceeds the C int range NCCL accepts"
            ))
        })
    };
    let (nranks, rank) = (
        int("group size", bootstrap.size())?,
        int("rank", bootstrap.rank())?,
    );
    cuda::require(Library::Nccl, "the nccl backend")?;
    let ctx = cuda::context(device)?;
    let stream = ctx
        .new_stream()
        .map_err(cuda::driver_error("cuStreamCreate"))?;
    let barrier_buf = stream
        .alloc_zeros::<f32>(1)
        .map_err(cuda::driver_error("cuMemAlloc"))?;
    let check = if check {
        let words = signature::words(bootstrap.size());
        let alloc = |len: usize| {
            stream
                .alloc_zeros::<i64>(len)
                .map_err(cuda::driver_error("cuMemAlloc"))
        };
        Some(CheckBuffers {
            send: alloc(words)?,
            recv: alloc(words * bootstrap.size())?,
        })
    } else {
        None
    };
    Ok(Local {
        stream,
        barrier_buf,
        timeout,
        flight_recorder,
        check,
        nranks,
        rank,
    })
}

/// Every rank must check signatures or none: a rank that skips the check would pair its
/// peers' signature all-gather with its own collective. Returns [`Error::Config`] on
/// every rank when the setting differs.
fn same_check(bootstrap: &dyn Communicator, check: bool) -> Result<()> {
    let all = bootstrap.all_gather_vec(&[i64::from(check)])?;
    let on: Vec<usize> = (0..all.len()).filter(|&r| all[r] != 0).collect();
    if on.is_empty() || on.len() == all.len() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{CHECK_ENV} differs between the ranks of group '{}': ranks {on:?} compare \
         signatures and the others do not; set it alike on every rank (e.g. \
         `mpirun -x {CHECK_ENV}`), or pass the same value to `new_with_check`",
        bootstrap.name()
    )))
}

fn init_rank(local: &Local, id: sys::ncclUniqueId, group: &str) -> Result<RawComm> {
    // NCCL joins with the device current on this thread.
    cuda::bind(&local.stream)?;
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; rank < nranks (the bootstrap's own rank and size).
    unsafe { nccl::comm_init_rank(&mut comm, local.nranks, id, local.rank) }
        .map_err(|e| with_sharing_hint(nccl_error("ncclCommInitRank", group, &e)))?;
    Ok(RawComm(comm))
}

/// The version of the libnccl loaded, as (major, minor, patch).
pub fn version() -> Result<(u32, u32, u32)> {
    cuda::require(Library::Nccl, "nccl::version")?;
    let code = nccl::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", "", &e))?;
    let code = u32::try_from(code).unwrap_or(0);
    // NCCL_VERSION_CODE: major·10000 + minor·100 + patch since 2.9, major·1000 + … before.
    Ok(if code >= 20_900 {
        (code / 10_000, code / 100 % 100, code % 100)
    } else {
        (code / 1000, code / 100 % 10, code % 100)
    })
}

/// Whether ranks of one communicator may share a GPU here: NCCL ≥ 2.30 with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1` (older versions refuse with "Duplicate GPU detected").
pub fn ranks_may_share_a_gpu() -> bool {
    let enabled = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
    enabled && version().is_ok_and(|v| v >= (2, 30, 0))
}

/// NCCL's "Duplicate GPU" refusal, with what would make the layout work.
fn with_sharing_hint(error: Error) -> Error {
    let Error::Nccl {
        call,
        group,
        mut message,
    } = error
    else {
        return error;
    };
    if message.contains("Duplicate GPU") {
        let found = version().map_or_else(|_| "?".into(), |(a, b, c)| format!("{a}.{b}.{c}"));
        message.push_str(&format!(
            "; two ranks of a communicator share one GPU, which NCCL {found} refuses: give \
             each rank its own GPU, or use NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1"
        ));
    }
    Error::Nccl {
        call,
        group,
        message,
    }
}

/// Tells every rank of `bootstrap` whether one setup step failed here, and returns
/// [`Error::Broken`] quoting every rank where it failed: no rank then goes on to wait in
/// NCCL for a peer that gave up.
fn agree(bootstrap: &dyn Communicator, step: &str, failure: Option<&Error>) -> Result<()> {
    let message = failure.map(ToString::to_string).unwrap_or_default();
    let lengths = bootstrap.all_gather_vec(&[message.len() as i64])?;
    let counts: Vec<usize> = lengths
        .iter()
        .map(|&n| usize::try_from(n).unwrap_or(0))
        .collect();
    if counts.iter().all(|&n| n == 0) {
        return Ok(());
    }
    let text = bootstrap.all_gather_v_vec(message.as_bytes(), &counts)?;
    let failures: Vec<String> = offsets(&counts)
        .into_iter()
        .zip(&counts)
        .enumerate()
        .filter(|(_, (_, &n))| n > 0)
        .map(|(r, (start, &n))| {
            let world = bootstrap.world_ranks().get(r).copied().unwrap_or(r);
            let said = text.get(start..start + n).unwrap_or_default();
            format!(
                "rank {r} (world rank {world}): {}",
                String::from_utf8_lossy(said)
            )
        })
        .collect();
    Err(Error::Broken {
        group: bootstrap.name().to_string(),
        cause: format!(
            "setting up NCCL, a rank could not {step}: {}",
            failures.join("; ")
        ),
    })
}

/// An NCCL call that failed while being queued: the function and its result.
type Queued = std::result::Result<(), (&'static str, NcclError)>;

fn queued(call: &'static str, result: std::result::Result<NcclStatus, NcclError>) -> Queued {
    result.map(drop).map_err(|e| (call, e))
}

/// Queues several NCCL calls as one group (one launch, and a rank's sends cannot block its
/// receives). The group is closed even when a call fails: NCCL counts open groups per
/// thread, and one left open would swallow this thread's later calls.
/// Queues `each(rank, offset, count)` for every rank's non-empty block of `counts`, as one
/// NCCL group.
fn per_block(counts: &[usize], mut each: impl FnMut(usize, usize, usize) -> Queued) -> Queued {
    grouped(|| {
        for (r, offset) in offsets(counts).into_iter().enumerate() {
            if counts[r] > 0 {
                each(r, offset, counts[r])?;
            }
        }
        Ok(())
    })
}

fn grouped(calls: impl FnOnce() -> Queued) -> Queued {
    queued("ncclGroupStart", nccl::group_start())?;
    let queued_calls = calls();
    let end = queued("ncclGroupEnd", nccl::group_end());
    queued_calls.and(end)
}

fn nccl_error(call: &'static str, group: &str, error: &NcclError) -> Error {
    // SAFETY: NCCL returns NUL-terminated strings it owns (or null), copied at once. The
    // last-error string ignores its communicator argument, which may be null.
    let (text, last) = unsafe {
        (
            c_string(sys::ncclGetErrorString(error.0)),
            c_string(sys::ncclGetLastError(std::ptr::null_mut())),
        )
    };
    let mut message = format!("{} ({:?})", text.unwrap_or_default(), error.0);
    if let Some(last) = last.filter(|s| !s.trim().is_empty()) {
        message.push_str(": ");
        message.push_str(last.trim());
    }
    Error::Nccl {
        call,
        group: group.to_string(),
        message,
    }
}

/// # Safety
/// `ptr` is null or a NUL-terminated string valid for the call.
unsafe fn c_string(ptr: *const c_char) -> Option<String> {
    (!ptr.is_null()).then(|| CStr::from_ptr(ptr).to_string_lossy().into_owned())
}

fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
    }
}

/// A group rank as NCCL takes it; it fits, as the group size was checked at creation.
fn peer(rank: usize) -> c_int {
    rank as c_int
}

fn src(ptr: u64) -> *const c_void {
    ptr as usize as *const c_void
}

fn dst(ptr: u64) -> *mut c_void {
    ptr as usize as *mut c_void
}

/// The device address `offset` elements of `dtype` past `ptr`.
fn at(ptr: u64, offset: usize, dtype: DType) -> u64 {
    ptr + (offset * dtype.size_in_bytes()) as u64
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Ok(comm) = &self.state.get_mut().comm {
            // NCCL frees its device memory in the current context.
            let _ = cuda::bind(&self.stream);
            // A leaked `NcclWork` may have left its call queued: let it finish first.
            let _ = self.stream.synchronize();
            // SAFETY: we own the communicator and no call is in flight: every call waits
            // for its NCCL work (or the synchronize above did), and `&mut self` excludes
            // new ones. A failure cannot be reported from drop and leaks only the
            // communicator.
            let _ = unsafe { nccl::comm_destroy(comm.0) };
        }
    }
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("group", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .finish()
    }
}

// SAFETY (of every `unsafe` NCCL call below): `CallCheck` proved the views hold the
// counts passed (offsets included), `stream_of` that they are memory of this device, and
// `run` returns only once NCCL has finished with them, while the views still borrow it.
impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn world_ranks(&self) -> &[usize] {
        &self.world_ranks
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        // Waited for on the host before any stream of the caller's is made to wait: ranks
        // that share a GPU may share a compute stream too, and a peer's collective queued
        // behind this one's wait on it could never start (see `NcclWork::held_by`).
        let holders = buf.cuda_holders();
        self.queue_all_reduce(buf, op)?.wait_blocking(&holders)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        let sig = self.check().broadcast(&buf, root)?;
        let stream = self.stream_of(kind, "buffer", buf.memory(), buf.cuda_stream())?;
        let (ptr, count, dtype) = (buf.device_ptr(), buf.len(), nccl_dtype(buf.dtype()));
        self.run((&sig, None), &[stream], count, |comm, s| {
            // SAFETY: see above; in place, as NCCL allows.
            let r =
                unsafe { nccl::broadcast(src(ptr), dst(ptr), count, dtype, peer(root), comm, s) };
            queued("ncclBroadcast", r)
        })
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        // As `all_reduce`: no stream of the caller's waits on NCCL.
        let holders = [input.cuda_holders(), output.cuda_holders()].concat();
        self.queue_all_gather(input, output)?
            .wait_blocking(&holders)
    }

    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let kind = OpKind::AllGatherV;
        let (sig, counts) = self.check().all_gather(&input, &output, Some(counts))?;
        let streams = self.io_streams(kind, &input, &output)?;
        let (from, to, dt) = (input.device_ptr(), output.device_ptr(), input.dtype());
        let me = self.rank;
        self.run((&sig, None), &streams, counts.iter().sum(), |comm, s| {
            // One broadcast per rank into its block of the output: NCCL has no all-gather
            // with per-rank counts.
            per_block(&counts, |r, offset, count| {
                let block = at(to, offset, dt);
                let send = if r == me { from } else { block };
                // SAFETY: see above; `send` is read on the root only.
                let res = unsafe {
                    nccl::broadcast(
                        src(send),
                        dst(block),
                        count,
                        nccl_dtype(dt),
                        peer(r),
                        comm,
                        s,
                    )
                };
                queued("ncclBroadcast", res)
            })
        })
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        // As `all_reduce`: no stream of the caller's waits on NCCL.
        let holders = [input.cuda_holders(), output.cuda_holders()].concat();
        self.queue_reduce_scatter(input, output, op)?
            .wait_blocking(&holders)
    }

    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let kind = OpKind::ReduceScatterV;
        let (sig, counts) = self
            .check()
            .reduce_scatter(&input, &output, Some(counts), op)?;
        let streams = self.io_streams(kind, &input, &output)?;
        let (from, to, dt) = (input.device_ptr(), output.device_ptr(), input.dtype());
        let me = self.rank;
        self.run((&sig, None), &streams, counts.iter().sum(), |comm, s| {
            // One reduction per rank of its block onto that rank: NCCL has no
            // reduce-scatter with per-rank counts.
            per_block(&counts, |r, offset, count| {
                let block = at(from, offset, dt);
                // NCCL writes the receive buffer on the root only; elsewhere it gets the
                // block itself (in place), which is never written.
                let recv = if r == me { to } else { block };
                // SAFETY: see above.
                let res = unsafe {
                    nccl::reduce(
                        src(block),
                        dst(recv),
                        count,
                        nccl_dtype(dt),
                        nccl_op(op),
                        peer(r),
                        comm,
                        s,
                    )
                };
                queued("ncclReduce", res)
            })
        })
    }

    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let kind = OpKind::AllToAllV;
        let sig = self
            .check()
            .all_to_all_v(&input, send_counts, &output, recv_counts)?;
        let streams = self.io_streams(kind, &input, &output)?;
        let (from, to, dt) = (input.device_ptr(), output.device_ptr(), input.dtype());
        let count = input.len() + output.len();
        self.run((&sig, None), &streams, count, |comm, s| {
            grouped(|| {
                // Empty pairs are skipped on both sides: a rank's send count to r is r's
                // receive count from it.
                let sends = offsets(send_counts).into_iter().zip(send_counts);
                let recvs = offsets(recv_counts).into_iter().zip(recv_counts);
                for (r, ((send_at, &send_n), (recv_at, &recv_n))) in sends.zip(recvs).enumerate() {
                    if send_n > 0 {
                        // SAFETY: see above.
                        let res = unsafe {
                            nccl::send(
                                src(at(from, send_at, dt)),
                                send_n,
                                nccl_dtype(dt),
                                peer(r),
                                comm,
                                s,
                            )
                        };
                        queued("ncclSend", res)?;
                    }
                    if recv_n > 0 {
                        // SAFETY: see above.
                        let res = unsafe {
                            nccl::recv(
                                dst(at(to, recv_at, dt)),
                                recv_n,
                                nccl_dtype(dt),
                                peer(r),
                                comm,
                                s,
                            )
                        };
                        queued("ncclRecv", res)?;
                    }
                }
                Ok(())
            })
        })
    }

    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        let kind = OpKind::Send;
        self.check().peer(kind, "destination", dest)?;
        let stream = self.stream_of(kind, "buffer", buf.memory(), buf.cuda_stream())?;
        let sig = self.check().signature(kind, Some(buf.dtype()), buf.len());
        let (ptr, count, dtype) = (buf.device_ptr(), buf.len(), nccl_dtype(buf.dtype()));
        self.run((&sig, Some(dest)), &[stream], count, |comm, s| {
            // SAFETY: see above.
            let r = unsafe { nccl::send(src(ptr), count, dtype, peer(dest), comm, s) };
            queued("ncclSend", r)
        })
    }

    fn recv(&self, buf: BufMut<'_>, source: usize) -> Result<()> {
        let kind = OpKind::Recv;
        self.check().peer(kind, "source", source)?;
        let stream = self.stream_of(kind, "buffer", buf.memory(), buf.cuda_stream())?;
        let sig = self.check().signature(kind, Some(buf.dtype()), buf.len());
        let (ptr, count, dtype) = (buf.device_ptr(), buf.len(), nccl_dtype(buf.dtype()));
        self.run((&sig, Some(source)), &[stream], count, |comm, s| {
            // SAFETY: see above.
            let r = unsafe { nccl::recv(dst(ptr), count, dtype, peer(source), comm, s) };
            queued("ncclRecv", r)
        })
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let kind = OpKind::Exchange;
        let mut streams = Vec::with_capacity(ops.len());
        // (send?, device pointer, count, dtype, peer) of each transfer.
        let mut transfers = Vec::with_capacity(ops.len());
        for op in ops.iter() {
            let (send, memory, stream, ptr, count, dtype, peer) = match op {
                P2p::Send { buf, peer } => {
                    self.check().peer(OpKind::Send, "destination", *peer)?;
                    let (m, s) = (buf.memory(), buf.cuda_stream());
                    (true, m, s, buf.device_ptr(), buf.len(), buf.dtype(), *peer)
                }
                P2p::Recv { buf, peer } => {
                    self.check().peer(OpKind::Recv, "source", *peer)?;
                    let (m, s) = (buf.memory(), buf.cuda_stream());
                    (false, m, s, buf.device_ptr(), buf.len(), buf.dtype(), *peer)
                }
            };
            streams.push(self.stream_of(kind, "buffer", memory, stream)?);
            transfers.push((send, ptr, count, dtype, peer));
        }
        let total = transfers.iter().map(|t| t.2).sum();
        let sig = self.check().signature(kind, None, total);
        self.run((&sig, None), &streams, total, |comm, s| {
            // One NCCL group: every send and receive is in flight at once, which is what
            // keeps neighbours that both send first out of deadlock.
            grouped(|| {
                for &(send, ptr, count, dtype, to) in transfers.iter().filter(|t| t.2 > 0) {
                    if send {
                        // SAFETY: see above.
                        let r = unsafe {
                            nccl::send(src(ptr), count, nccl_dtype(dtype), peer(to), comm, s)
                        };
                        queued("ncclSend", r)?;
                    } else {
                        // SAFETY: see above.
                        let r = unsafe {
                            nccl::recv(dst(ptr), count, nccl_dtype(dtype), peer(to), comm, s)
                        };
                        queued("ncclRecv", r)?;
                    }
                }
                Ok(())
            })
        })
    }

    fn isend(&self, _: BufRef<'_>, _: usize) -> Result<P2pWork> {
        Err(self.no_single_transfers(OpKind::Send))
    }

    fn irecv(&self, _: crate::Buffer, _: usize) -> Result<P2pWork> {
        Err(self.no_single_transfers(OpKind::Recv))
    }

    fn barrier(&self) -> Result<()> {
        // Only the communicator's stream touches this buffer, and calls are serialised.
        let (ptr, _record) = self.barrier_buf.device_ptr(&self.stream);
        let sig = self.check().signature(OpKind::Barrier, None, 0);
        self.run((&sig, None), &[], 1, |comm, s| {
            // SAFETY: one f32 of our own device memory, alive as long as `self`.
            let r = unsafe {
                nccl::all_reduce(
                    src(ptr),
                    dst(ptr),
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    s,
                )
            };
            queued("ncclAllReduce (barrier)", r)
        })
    }

    fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
    ) -> Result<Option<Arc<dyn Communicator>>> {
        if let Err(cause) = &self.state.lock().comm {
            return Err(Error::Broken {
                group: self.name.clone(),
                cause: cause.clone(),
            });
        }
        let Some(sub) = self.bootstrap.split(color, key, name)? else {
            return Ok(None);
        };
        let check = self.checks_signatures();
        let comm =
            NcclCommunicator::open(sub, self.device, Some(check))?.with_timeout(self.timeout());
        Ok(Some(Arc::new(comm)))
    }

    fn flight_record(&self) -> FlightRecord {
        self.dump().record()
    }

    fn start(&self, op: AsyncOp) -> Result<Work> {
        let (kind, memory) = match &op {
            AsyncOp::AllReduce { buf, .. } => (OpKind::AllReduce, buf.memory()),
            AsyncOp::Broadcast { buf, .. } => (OpKind::Broadcast, buf.memory()),
            AsyncOp::AllGather { input } | AsyncOp::AllGatherInto { input, .. } => {
                (OpKind::AllGather, input.memory())
            }
            AsyncOp::ReduceScatter { input, .. } | AsyncOp::ReduceScatterInto { input, .. } => {
                (OpKind::ReduceScatter, input.memory())
            }
        };
        match (op, memory) {
            // Lent device memory (a tensor library's gradient bucket) is reduced in place,
            // queued now on NCCL's stream behind the work its owner already queued, so
            // the owner's later kernels overlap it.
            (AsyncOp::AllReduce { mut buf, op }, Device::Cuda(_)) => {
                let pending = self.queue_all_reduce(buf.as_buf_mut(), op)?.pending.take();
                Ok(self.deferred(pending, buf, None))
            }
            // The same for a reduce-scatter from one lent buffer into another.
            (
                AsyncOp::ReduceScatterInto {
                    input,
                    mut output,
                    op,
                },
                Device::Cuda(_),
            ) => {
                let pending = self
                    .queue_reduce_scatter(input.as_buf_ref(), output.as_buf_mut(), op)?
                    .pending
                    .take();
                Ok(self.deferred(pending, output, Some(input)))
            }
            // And an all-gather from one lent buffer into another.
            (AsyncOp::AllGatherInto { input, mut output }, Device::Cuda(_)) => {
                let pending = self
                    .queue_all_gather(input.as_buf_ref(), output.as_buf_mut())?
                    .pending
                    .take();
                Ok(self.deferred(pending, output, Some(input)))
            }
            _ => Err(Error::InvalidBuffer {
                op: kind,
                group: self.name.clone(),
                detail: "NCCL's non-blocking operations take lent device memory \
                         (`Buffer::lent`), not host buffers: an all-reduce in place, or a \
                         reduce-scatter or all-gather from one lent buffer into another; for other \
                         operations call the `*_async` or blocking methods with device views \
                         (`BufRef::cuda` / `BufMut::cuda`): it returns once the result is in \
                         place"
                    .to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_local;

    /// NCCL's refusal of two ranks on one GPU says what would make the layout work; other
    /// errors pass unchanged.
    #[test]
    fn a_shared_gpu_refusal_says_what_to_do() {
        let refusal = |message: &str| Error::Nccl {
            call: "ncclCommInitRank",
            group: "world".into(),
            message: message.into(),
        };
        let hinted = with_sharing_hint(refusal("Duplicate GPU detected : rank 0 and rank 1"));
        let text = hinted.to_string();
        assert!(text.contains("give each rank its own GPU"), "{text}");
        assert!(text.contains("NCCL_MULTI_RANK_GPU_ENABLE=1"), "{text}");
        let other = with_sharing_hint(refusal("unhandled system error")).to_string();
        assert!(!other.contains("own GPU"), "{other}");
    }

    /// The agreement runs on the bootstrap alone, so it is tested without a GPU.
    #[test]
    fn a_setup_failure_on_one_rank_reaches_every_rank() {
        let seen = run_local(3, |comm| {
            let failure = (comm.rank() == 1).then(|| Error::Config("rank one's trouble".into()));
            Ok::<_, Error>(agree(&comm, "try", failure.as_ref()).err())
        })
        .unwrap();
        for error in seen {
            match error {
                Some(Error::Broken { group, cause }) => {
                    assert_eq!(group, "world");
                    assert!(cause.contains("could not try"), "{cause}");
                    assert!(cause.contains("rank 1 (world rank 1)"), "{cause}");
                    assert!(cause.contains("rank one's trouble"), "{cause}");
                    assert!(
                        !cause.contains("rank 0") && !cause.contains("rank 2"),
                        "{cause}"
                    );
                }
                other => panic!("expected Broken, got {other:?}"),
            }
        }
        let clean = run_local(2, |comm| agree(&comm, "try", None)).unwrap();
        assert_eq!(clean, vec![(), ()]);
    }
}
