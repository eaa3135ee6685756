//! The `mpi` backend (cargo feature `mpi`): the system MPI library through rsmpi, one
//! process per rank, launched by `mpirun`.
//!
//! ```no_run
//! use ferrotron_comm_core::mpi::MpiWorld;
//! use ferrotron_comm_core::{CommunicatorExt, ReduceOp};
//!
//! let mpi = MpiWorld::init()?; // once per process
//! let world = mpi.world()?;
//! let mut x = [1.0f32];
//! world.all_reduce_slice(&mut x, ReduceOp::Sum)?;
//! # Ok::<(), ferrotron_comm_core::Error>(())
//! ```
//!
//! Collectives map one-to-one onto MPI calls on the type-erased buffers. MPI has no
//! 16-bit float types, so f16/bf16 reductions run in f32 and round once, exactly as the
//! local backend does; `Avg` is a sum followed by a division. Non-blocking operations run
//! on a per-communicator progress thread, which is why MPI must provide
//! `MPI_THREAD_MULTIPLE`.
//!
//! MPI itself cannot tell that ranks disagree about a call; it hangs or corrupts memory.
//! So by default every collective first all-gathers its [`CallSignature`] and turns a
//! disagreement into [`Error::Mismatch`] on every rank, naming op, group, sequence number
//! and each rank's arguments; the communicator stays usable. All-reduces, broadcasts and
//! all-gathers of up to 1 KiB per rank (less from 8 ranks on) send their data in that same
//! all-gather and finish from it, so for them the check costs no extra exchange (and a
//! barrier is the exchange itself); larger calls pay one small all-gather before MPI's
//! own collective. [`CHECK_ENV`]`=0` skips the check, for users who want MPI's raw latency
//! and accept a hang or corrupted memory when ranks disagree. All ranks must use the same
//! setting: [`MpiWorld::world`] compares it and returns [`Error::Config`] on every rank
//! when it differs. Point-to-point calls compare the message length instead.

use crate::buffer::{BufMut, BufRef};
use crate::calls::{offsets, CallCheck};
use crate::communicator::{AsyncOp, Communicator, P2p, P2pWork};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CallSignature, Error, OpKind, Result};
use crate::flight_recorder::{self, CallRecord, Dump, FlightRecord, Recorder, Ticket};
use crate::signature;
use crate::work::{ProgressQueue, Work};
use half::{bf16, f16};
use mpi::environment::Universe;
use mpi::ffi;
use mpi::Threading;
use parking_lot::Mutex;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Environment variable for the cross-rank signature check: on unless it is `0` (or
/// `false`, `no`, `off`).
pub const CHECK_ENV: &str = "FERROTRON_MPI_CHECK";

/// The MPI library for this process: initialised once, finalised when it and every
/// communicator made from it are dropped.
pub struct MpiWorld {
    env: Arc<MpiEnv>,
}

struct MpiEnv {
    _universe: Universe,
    check: bool,
}

impl MpiWorld {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE`. Collectives compare their signatures
    /// across ranks unless [`CHECK_ENV`] is `0`.
    pub fn init() -> Result<MpiWorld> {
        MpiWorld::init_with(signature::switch_from_env(CHECK_ENV, true)?)
    }

    /// Initialises MPI with the cross-rank signature check on, whatever the environment.
    pub fn init_checked() -> Result<MpiWorld> {
        MpiWorld::init_with(true)
    }

    fn init_with(check: bool) -> Result<MpiWorld> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                Error::Mpi(
                    "MPI is already initialised in this process; create one MpiWorld and \
                     share it"
                        .into(),
                )
            })?;
        if threading < Threading::Multiple {
            return Err(Error::Mpi(format!(
                "the MPI library offers thread level {threading:?}, but ferrotron's progress \
                 threads need MPI_THREAD_MULTIPLE; use an MPI built with thread support \
                 (OpenMPI and MPICH are by default)"
            )));
        }
        Ok(MpiWorld {
            env: Arc::new(MpiEnv {
                _universe: universe,
                check,
            }),
        })
    }

    /// Whether collectives check their signatures across ranks.
    pub fn checks_signatures(&self) -> bool {
        self.env.check
    }

    /// A communicator over every process (a duplicate of `MPI_COMM_WORLD`, so its
    /// traffic never mixes with other users of the world communicator).
    pub fn world(&self) -> Result<MpiCommunicator> {
        let mut comm = null_comm();
        // SAFETY: MPI is initialised (we hold the universe); `comm` is a valid out-pointer.
        check_rc(
            unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm) },
            "MPI_Comm_dup",
        )?;
        MpiCommunicator::adopt(RawComm(comm), "world".into(), self.env.clone(), None)
    }
}

/// `MPI_Comm` is a handle the MPI library lets any thread use under
/// `MPI_THREAD_MULTIPLE`; our per-communicator lock keeps calls on one handle in order.
struct RawComm(ffi::MPI_Comm);
// SAFETY: see above; the handle is only used under `MpiCore::counters`' lock or in drop.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

fn null_comm() -> ffi::MPI_Comm {
    // SAFETY: reading an immutable handle constant exported by the MPI shim.
    unsafe { ffi::RSMPI_COMM_NULL }
}

fn check_rc(rc: c_int, call: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters as the standard requires.
    let described = unsafe { ffi::MPI_Error_string(rc, text.as_mut_ptr().cast(), &mut len) } == 0;
    let message = if described {
        String::from_utf8_lossy(&text[..len.max(0) as usize]).into_owned()
    } else {
        format!("error code {rc}")
    };
    Err(Error::Mpi(format!("{call} failed: {message}")))
}

extern "C" {
    /// `MPI_IN_PLACE` as the system's mpi.h defines it (see csrc/mpi_in_place.c).
    fn ferrotron_mpi_in_place() -> *mut c_void;
}

/// MPI rejects the identical dangling addresses Rust gives empty slices (as aliasing
/// send and receive buffers), so empty buffers get distinct real addresses instead.
static EMPTY_SEND: u64 = 0;
struct EmptyRecv(std::cell::UnsafeCell<u64>);
// SAFETY: MPI never writes through a receive pointer whose count is zero.
unsafe impl Sync for EmptyRecv {}
static EMPTY_RECV: EmptyRecv = EmptyRecv(std::cell::UnsafeCell::new(0));

fn send_ptr(buf: &BufRef<'_>) -> *const c_void {
    if buf.is_empty() {
        std::ptr::addr_of!(EMPTY_SEND).cast()
    } else {
        buf.host_ptr().cast()
    }
}

fn recv_ptr(buf: &mut BufMut<'_>) -> *mut c_void {
    if buf.is_empty() {
        EMPTY_RECV.0.get().cast()
    } else {
        buf.host_ptr_mut().cast()
    }
}

fn raw_dtype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable datatype handles exported by the MPI shim.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            // Moved as raw bits; reductions convert to f32 first.
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

fn raw_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading immutable operator handles exported by the MPI shim.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Prod => ffi::RSMPI_PROD,
        }
    }
}

/// One rank's handle on an MPI group. Dropping it frees the MPI communicator once its
/// queued non-blocking operations have finished.
pub struct MpiCommunicator {
    core: Arc<MpiCore>,
    /// False for the progress thread's handle, whose drop must not shut the queue down.
    owner: bool,
}

struct MpiCore {
    comm: RawComm,
    env: Arc<MpiEnv>,
    name: String,
    rank: usize,
    size: usize,
    world_ranks: Vec<usize>,
    /// Collectives issued (for error messages); locked for a whole call so that calls
    /// on one communicator from several threads never interleave.
    seq: Mutex<u64>,
    queue: ProgressQueue,
    /// This rank's last calls; written under `seq`'s lock.
    recorder: Recorder,
    /// Messages sent and received, for the flight recorder; changed under `seq`'s lock.
    messages: [AtomicU64; 2],
}

impl Drop for MpiCore {
    fn drop(&mut self) {
        let mut comm = self.comm.0;
        // SAFETY: we own this duplicated/split communicator and nothing uses it any more.
        // A failure to free cannot be reported from drop and leaks only the handle.
        let _ = unsafe { ffi::MPI_Comm_free(&mut comm) };
    }
}

impl MpiCommunicator {
    /// Wraps a communicator we own: returns errors instead of aborting, learns the
    /// members' world ranks (given, or gathered) and checks, in the same all-gather, that
    /// every member has the signature check set alike.
    fn adopt(
        comm: RawComm,
        name: String,
        env: Arc<MpiEnv>,
        world_rank: Option<usize>,
    ) -> Result<MpiCommunicator> {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `comm` is a valid communicator we own; out-pointers are valid.
        unsafe {
            check_rc(
                ffi::MPI_Comm_set_errhandler(comm.0, ffi::RSMPI_ERRORS_RETURN),
                "MPI_Comm_set_errhandler",
            )?;
            check_rc(ffi::MPI_Comm_rank(comm.0, &mut rank), "MPI_Comm_rank")?;
            check_rc(ffi::MPI_Comm_size(comm.0, &mut size), "MPI_Comm_size")?;
        }
        let (rank, size) = (rank as usize, size as usize);
        // Per rank: its world rank and whether it checks signatures.
        let mut gathered = vec![0i64; 2 * size];
        let mine = [world_rank.unwrap_or(rank) as i64, env.check as i64];
        // SAFETY: two i64 sent, `2 * size` received, buffers sized accordingly.
        check_rc(
            unsafe {
                ffi::MPI_Allgather(
                    mine.as_ptr().cast(),
                    2,
                    ffi::RSMPI_INT64_T,
                    gathered.as_mut_ptr().cast(),
                    2,
                    ffi::RSMPI_INT64_T,
                    comm.0,
                )
            },
            "MPI_Allgather",
        )?;
        let queue = ProgressQueue::new(format!("{name}-mpi-progress-{rank}"));
        let recorder = Recorder::new(flight_recorder::capacity_from_env()?);
        let communicator = MpiCommunicator {
            core: Arc::new(MpiCore {
                comm,
                env,
                name,
                rank,
                size,
                world_ranks: gathered.chunks(2).map(|r| r[0] as usize).collect(),
                seq: Mutex::new(0),
                queue,
                recorder,
                messages: [AtomicU64::new(0), AtomicU64::new(0)],
            }),
            owner: true,
        };
        // A rank that skips the check would pair its peers' signature all-gather with its
        // own collective: refuse on every rank instead (dropping frees the communicator).
        let unchecked: Vec<usize> = (0..size).filter(|&r| gathered[2 * r + 1] == 0).collect();
        if !unchecked.is_empty() && unchecked.len() < size {
            return Err(Error::Config(format!(
                "{CHECK_ENV} differs between the ranks of group '{}': ranks {unchecked:?} skip \
                 the signature check and the others run it; set it alike on every rank \
                 (e.g. `mpirun -x {CHECK_ENV}`)",
                communicator.core.name
            )));
        }
        Ok(communicator)
    }

    fn check(&self) -> CallCheck<'_> {
        CallCheck {
            group: &self.core.name,
            rank: self.core.rank,
            size: self.core.size,
        }
    }

    /// Runs `call` under the communicator's lock after the queued operations and, unless
    /// the check is off, after all ranks agreed on `sig`.
    fn collective<T>(&self, sig: &CallSignature, call: impl FnOnce() -> Result<T>) -> Result<T> {
        self.collective_inline(sig, None, |_| call())
    }

    /// [`collective`](Self::collective) for a call that can finish from the check's
    /// exchange: `data` (this rank's host bytes, read before `call` runs) travels with the
    /// signature when it fits in [`inline_words`], and then `call` gets every rank's copy
    /// and needs no MPI call of its own; otherwise, or with the check off, `call` gets
    /// `None`. Whether it fits depends only on the agreed signature (op, dtype, count), so
    /// every rank takes the same path.
    fn collective_inline<T>(
        &self,
        sig: &CallSignature,
        data: Option<BufRef<'_>>,
        call: impl FnOnce(Option<Inlined<'_>>) -> Result<T>,
    ) -> Result<T> {
        self.core.queue.wait_idle();
        let mut seq = self.core.seq.lock();
        let this = *seq;
        *seq += 1;
        let record = self.core.recorder.start(&CallRecord::collective(this, sig));
        let result = if self.core.env.check {
            let size = self.core.size;
            let mut extra = vec![0i64; inline_words(size)];
            let data = data.filter(|d| d.byte_len() <= extra.len() * 8);
            if let Some(data) = data.filter(|d| !d.is_empty()) {
                // SAFETY: a host view of `byte_len` readable bytes (callers stage device
                // memory first), which `extra` can hold; the two do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.host_ptr(),
                        extra.as_mut_ptr().cast(),
                        data.byte_len(),
                    )
                };
            }
            self.agree(sig, this, &extra).and_then(|words| {
                call(data.map(|_| Inlined {
                    words: &words,
                    stride: signature::words(size) + extra.len(),
                    header: signature::words(size),
                }))
            })
        } else {
            call(None)
        };
        self.recorded(record, result)
    }

    /// Records how a call ended. An MPI failure (a lost peer, say) also writes this
    /// rank's flight record to a file and names it in the error: a stuck peer cannot be
    /// asked, so the user collects every rank's file.
    fn recorded<T>(&self, record: Ticket, result: Result<T>) -> Result<T> {
        self.core.recorder.end(record, result.is_ok());
        result.map_err(|e| match e {
            Error::Mpi(_) => self.dump().attach(e),
            other => other,
        })
    }

    /// Records the start of this rank's next send or receive; call under `seq`'s lock.
    fn start_message(&self, op: OpKind, dtype: DType, count: usize, peer: usize) -> Ticket {
        let counter = &self.core.messages[usize::from(op == OpKind::Recv)];
        let seq = counter.load(Ordering::Relaxed);
        counter.store(seq + 1, Ordering::Relaxed);
        let call = CallRecord::message(seq, op, dtype, count, peer);
        self.core.recorder.start(&call)
    }

    fn dump(&self) -> Dump<'_> {
        let core = &self.core;
        Dump {
            backend: "mpi",
            group: &core.name,
            rank: core.rank,
            size: core.size,
            world_rank: core.world_ranks[core.rank],
            recorder: &core.recorder,
        }
    }

    /// All-gathers every rank's signature (and `extra` words) and checks them like the
    /// local backend does (see [`signature::agree`]); returns every rank's words.
    fn agree(&self, sig: &CallSignature, seq: u64, extra: &[i64]) -> Result<Vec<i64>> {
        let size = self.core.size;
        signature::agree(&self.core.name, seq, size, sig, extra, |mine, all| {
            // SAFETY: every rank sends the same fixed number of words
            // (`signature::words(size) + inline_words(size)`) and `all` holds `size`
            // times as many.
            check_rc(
                unsafe {
                    ffi::MPI_Allgather(
                        mine.as_ptr().cast(),
                        mine.len() as c_int,
                        ffi::RSMPI_INT64_T,
                        all.as_mut_ptr().cast(),
                        mine.len() as c_int,
                        ffi::RSMPI_INT64_T,
                        self.core.comm.0,
                    )
                },
                "MPI_Allgather (signature check)",
            )
        })
    }

    fn int(&self, op: OpKind, what: &str, value: usize) -> Result<c_int> {
        c_int::try_from(value).map_err(|_| Error::InvalidArgument {
            op,
            group: self.core.name.clone(),
            detail: format!(
                "{what} {value} exceeds MPI's C int range; split the buffer into smaller calls"
            ),
        })
    }

    fn ints(&self, op: OpKind, what: &str, values: &[usize]) -> Result<Vec<c_int>> {
        values.iter().map(|&v| self.int(op, what, v)).collect()
    }

    /// Reduces `send` into `recv` (`count` f32 values or native elements).
    #[allow(clippy::too_many_arguments)]
    fn raw_reduce(
        &self,
        kind: OpKind,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        counts: Option<&[usize]>,
        dtype: ffi::MPI_Datatype,
        op: ReduceOp,
    ) -> Result<()> {
        let comm = self.core.comm.0;
        match counts {
            None => {
                let count = self.int(kind, "count", count)?;
                // SAFETY: callers pass buffers holding `count` elements of `dtype`.
                check_rc(
                    unsafe { ffi::MPI_Allreduce(send, recv, count, dtype, raw_op(op), comm) },
                    "MPI_Allreduce",
                )
            }
            Some(counts) => {
                let counts = self.ints(kind, "count", counts)?;
                // SAFETY: callers pass an input of sum(counts) and an output of
                // counts[rank] elements of `dtype`.
                check_rc(
                    unsafe {
                        ffi::MPI_Reduce_scatter(
                            send,
                            recv,
                            counts.as_ptr(),
                            dtype,
                            raw_op(op),
                            comm,
                        )
                    },
                    "MPI_Reduce_scatter",
                )
            }
        }
    }

    /// A reduction (all-reduce when `counts` is `None`, else reduce-scatter) from `input`
    /// into `output`, handling 16-bit floats through f32 and `Avg` as sum then divide.
    fn reduce(
        &self,
        kind: OpKind,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: Option<&[usize]>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.core.size;
        macro_rules! through_f32 {
            ($t:ty) => {{
                let send: Vec<f32> = input
                    .as_host_slice::<$t>()
                    .unwrap_or_default()
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let mut recv = vec![0f32; output.len()];
                self.raw_reduce(
                    kind,
                    send_ptr(&BufRef::from(send.as_slice())),
                    recv_ptr(&mut BufMut::from(recv.as_mut_slice())),
                    recv.len(),
                    counts,
                    raw_dtype(DType::F32),
                    op,
                )?;
                let scale = if op == ReduceOp::Avg { n as f32 } else { 1.0 };
                for (o, r) in output
                    .as_host_slice_mut::<$t>()
                    .unwrap_or_default()
                    .iter_mut()
                    .zip(recv)
                {
                    *o = <$t>::from_f32(r / scale);
                }
                Ok(())
            }};
        }
        match input.dtype() {
            DType::F16 => through_f32!(f16),
            DType::BF16 => through_f32!(bf16),
            dtype => {
                let out = recv_ptr(&mut output);
                self.raw_reduce(
                    kind,
                    send_ptr(&input),
                    out,
                    output.len(),
                    counts,
                    raw_dtype(dtype),
                    op,
                )?;
                average_in_place(&mut output, op, n);
                Ok(())
            }
        }
    }
}

/// Words of data per rank that travel with the signature check: all-reduces,
/// broadcasts and all-gathers of up to 1 KiB per rank finish from the check's
/// all-gather instead of making a second MPI call, so the check costs them one exchange,
/// not two. Every rank sends this much (padded) with every check, whatever its call, so
/// it is small: each message of the exchange stays below the shared-memory transports'
/// eager limit (4 KiB), and from 8 ranks on the budget shrinks (to none from 32 ranks on,
/// where the exchange itself grows with the group).
fn inline_words(size: usize) -> usize {
    (1024 / size.max(1))
        .saturating_sub(signature::words(size))
        .min(128)
}

/// Every rank's copy of a small call's data, from the check's all-gather.
struct Inlined<'a> {
    words: &'a [i64],
    /// Words per rank: its signature, then its data.
    stride: usize,
    /// Words of signature before the data.
    header: usize,
}

impl Inlined<'_> {
    /// The start of rank `rank`'s data: as many bytes as that rank passed, which the
    /// agreed signature says is as many as this rank passed. Aligned to 8 bytes, enough
    /// for every element type.
    fn from(&self, rank: usize) -> *const u8 {
        self.words[rank * self.stride + self.header..]
            .as_ptr()
            .cast()
    }
}

/// Turns a sum into an average (`Avg` is only accepted for float types).
fn average_in_place(buf: &mut BufMut<'_>, op: ReduceOp, n: usize) {
    if op != ReduceOp::Avg {
        return;
    }
    if let Some(values) = buf.as_host_slice_mut::<f32>() {
        values.iter_mut().for_each(|x| *x /= n as f32);
    } else if let Some(values) = buf.as_host_slice_mut::<f64>() {
        values.iter_mut().for_each(|x| *x /= n as f64);
    }
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        if self.owner {
            self.core.queue.shutdown();
        }
    }
}

/// The tag of an exchange's headers (each send's dtype and length); data travels on tag 0
/// with `send`/`recv`'s, which keeps a pair's messages in order across both.
const HEADER_TAG: c_int = 1;

/// A request handle moved into a `P2pWork`'s completion.
struct Request(ffi::MPI_Request);
// SAFETY: MPI lets any thread complete a request under MPI_THREAD_MULTIPLE.
unsafe impl Send for Request {}

/// Waits for `request`; for a receive (`dtype` given) returns the elements received.
fn wait_one(request: &mut ffi::MPI_Request, dtype: Option<DType>) -> Result<Option<usize>> {
    // SAFETY: MPI_Status is plain data that MPI_Wait fills in.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: a request from MPI_Isend/MPI_Irecv whose buffer is still alive.
    check_rc(unsafe { ffi::MPI_Wait(request, &mut status) }, "MPI_Wait")?;
    let Some(dtype) = dtype else {
        return Ok(None);
    };
    let mut count: c_int = 0;
    // SAFETY: the status MPI_Wait filled in.
    check_rc(
        unsafe { ffi::MPI_Get_count(&status, raw_dtype(dtype), &mut count) },
        "MPI_Get_count",
    )?;
    Ok(usize::try_from(count).ok())
}

/// An exchange's header: a send's dtype (its index in `DType::ALL`) and length.
fn header(dtype: DType, len: usize) -> [i64; 2] {
    let code = DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0);
    [code as i64, len as i64]
}

/// The buffer of a non-blocking transfer: read by a send, written by a receive.
enum Raw {
    Send(*const c_void),
    Recv(*mut c_void),
}

impl MpiCommunicator {
    /// An exchange of host buffers, under the communicator's lock. With the check on,
    /// each send is preceded by a header with its dtype and length (on its own tag, so
    /// headers and data each stay in order between a pair); a receive reads the header
    /// first and takes a message that does not fit into scratch memory, so that the
    /// sender completes and the receiver returns `Mismatch`.
    fn exchange_host(&self, ops: &mut [P2p<'_>], first_recv: u64) -> Result<()> {
        let check = self.core.env.check;
        let sent: Vec<[i64; 2]> = ops
            .iter()
            .filter_map(|op| match op {
                P2p::Send { buf, .. } => Some(header(buf.dtype(), buf.len())),
                P2p::Recv { .. } => None,
            })
            .collect();
        let recvs = ops.len() - sent.len();
        let mut announced = vec![[0i64; 2]; if check { recvs } else { 0 }];
        let mut scratch = Vec::new();
        let (mut requests, mut header_requests) = (Vec::new(), Vec::new());
        let posted = self.post_exchange(
            ops,
            (&sent, &mut announced),
            &mut scratch,
            (&mut requests, &mut header_requests),
            first_recv,
        );
        // Posted transfers borrow `ops`' buffers, the headers and the scratch memory:
        // whatever happened, they complete before any of those go.
        let waited = self
            .wait_all(&mut header_requests)
            .and(self.wait_all(&mut requests));
        let mismatch = posted?;
        waited?;
        mismatch.map_or(Ok(()), Err)
    }

    /// Posts the sends (after their headers when checking) and, once the receives'
    /// headers have arrived, the receives; returns the first mismatch found.
    fn post_exchange(
        &self,
        ops: &mut [P2p<'_>],
        (sent, announced): (&[[i64; 2]], &mut [[i64; 2]]),
        scratch: &mut Vec<crate::Buffer>,
        (requests, header_requests): (&mut Vec<ffi::MPI_Request>, &mut Vec<ffi::MPI_Request>),
        first_recv: u64,
    ) -> Result<Option<Error>> {
        let check = self.core.env.check;
        let mut sent = sent.iter();
        for op in ops.iter() {
            if let P2p::Send { buf, peer } = op {
                if let (true, Some(header)) = (check, sent.next()) {
                    let raw = Raw::Send(header.as_ptr().cast());
                    requests.push(self.post(raw, 2, DType::I64, *peer, HEADER_TAG)?);
                }
                let raw = Raw::Send(send_ptr(buf));
                requests.push(self.post(raw, buf.len(), buf.dtype(), *peer, 0)?);
            }
        }
        let peers = ops
            .iter()
            .filter(|op| matches!(op, P2p::Recv { .. }))
            .map(P2p::peer);
        for (header, peer) in announced.iter_mut().zip(peers) {
            let raw = Raw::Recv(header.as_mut_ptr().cast());
            header_requests.push(self.post(raw, 2, DType::I64, peer, HEADER_TAG)?);
        }
        self.wait_all(header_requests)?;
        let mut mismatch = None;
        let mut announced = announced.iter();
        for (i, op) in ops.iter_mut().enumerate() {
            let P2p::Recv { buf, peer } = op else {
                continue;
            };
            let (ptr, dtype, len) = match announced.next() {
                Some(theirs) if *theirs != header(buf.dtype(), buf.len()) => {
                    let dtype = DType::ALL
                        .get(theirs[0] as usize)
                        .copied()
                        .unwrap_or(DType::U8);
                    let len = usize::try_from(theirs[1]).unwrap_or(0);
                    let mut send = self.check().signature(OpKind::Send, Some(dtype), len);
                    send.rank = *peer;
                    let recv = self
                        .check()
                        .signature(OpKind::Recv, Some(buf.dtype()), buf.len());
                    mismatch.get_or_insert(Error::Mismatch {
                        group: self.core.name.clone(),
                        seq: first_recv + i as u64,
                        calls: vec![send, recv],
                    });
                    // A buffer's elements live on the heap: they stay put as `scratch`
                    // grows.
                    scratch.push(crate::Buffer::zeros(dtype, len));
                    let taken = scratch.last_mut().map(|b| recv_ptr(&mut b.as_buf_mut()));
                    (taken.unwrap_or(std::ptr::null_mut()), dtype, len)
                }
                _ => (recv_ptr(buf), buf.dtype(), buf.len()),
            };
            requests.push(self.post(Raw::Recv(ptr), len, dtype, *peer, 0)?);
        }
        Ok(mismatch)
    }

    /// Posts a non-blocking transfer of `len` elements of `dtype` with `peer`.
    fn post(
        &self,
        transfer: Raw,
        len: usize,
        dtype: DType,
        peer: usize,
        tag: c_int,
    ) -> Result<ffi::MPI_Request> {
        let op = match transfer {
            Raw::Send(_) => OpKind::Send,
            Raw::Recv(_) => OpKind::Recv,
        };
        let count = self.int(op, "count", len)?;
        let (dtype, peer, comm) = (raw_dtype(dtype), peer as c_int, self.core.comm.0);
        // SAFETY: a null request handle for MPI to fill in.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the pointer holds (has room for) `count` elements of `dtype`, alive
        // until `wait_all`.
        let (rc, call) = unsafe {
            match transfer {
                Raw::Send(ptr) => (
                    ffi::MPI_Isend(ptr, count, dtype, peer, tag, comm, &mut request),
                    "MPI_Isend",
                ),
                Raw::Recv(ptr) => (
                    ffi::MPI_Irecv(ptr, count, dtype, peer, tag, comm, &mut request),
                    "MPI_Irecv",
                ),
            }
        };
        check_rc(rc, call)?;
        Ok(request)
    }

    fn wait_all(&self, requests: &mut [ffi::MPI_Request]) -> Result<()> {
        if requests.is_empty() {
            return Ok(());
        }
        // SAFETY: valid requests from MPI_Isend/MPI_Irecv; statuses are not wanted.
        check_rc(
            unsafe {
                ffi::MPI_Waitall(
                    requests.len() as c_int,
                    requests.as_mut_ptr(),
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            },
            "MPI_Waitall",
        )
    }

    /// An exchange with device buffers, staged through host memory.
    #[cfg(feature = "cuda")]
    fn exchange_through_host(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let mut staged: Vec<crate::Buffer> = ops
            .iter()
            .map(|op| match op {
                P2p::Send { buf, .. } => buf.to_host(),
                P2p::Recv { buf, .. } => Ok(crate::Buffer::zeros(buf.dtype(), buf.len())),
            })
            .collect::<Result<_>>()?;
        let mut host: Vec<P2p<'_>> = ops
            .iter()
            .zip(staged.iter_mut())
            .map(|(op, buf)| match op {
                P2p::Send { peer, .. } => P2p::Send {
                    buf: buf.as_buf_ref(),
                    peer: *peer,
                },
                P2p::Recv { peer, .. } => P2p::Recv {
                    buf: buf.as_buf_mut(),
                    peer: *peer,
                },
            })
            .collect();
        self.exchange(&mut host)?;
        drop(host);
        for (op, data) in ops.iter_mut().zip(&staged) {
            if let P2p::Recv { buf, .. } = op {
                buf.copy_from_host(data)?;
            }
        }
        Ok(())
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.core.rank
    }
    fn size(&self) -> usize {
        self.core.size
    }
    fn name(&self) -> &str {
        &self.core.name
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn world_ranks(&self) -> &[usize] {
        &self.core.world_ranks
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        buf.declare("all_reduce", true)?;
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            return crate::cuda::staged_inout(buf, |host| self.all_reduce(host, op));
        }
        let sig = self.check().all_reduce(&buf, op)?;
        // SAFETY: read (copied into the check's exchange) before `call` writes `buf`.
        let data =
            unsafe { BufRef::from_raw_host(buf.as_ref().host_ptr(), buf.len(), buf.dtype()) };
        self.collective_inline(&sig, Some(data), |inlined| match (inlined, buf.dtype()) {
            (Some(all), dtype) => {
                let (len, out) = (buf.len(), recv_ptr(&mut buf));
                crate::with_dtype!(dtype, T => {
                    let sources: Vec<*const T> =
                        (0..self.core.size).map(|r| all.from(r).cast()).collect();
                    // SAFETY: agreed signatures: every rank sent `len` elements of `T`,
                    // which `out` holds; the sources are the exchange's, not `buf`.
                    unsafe { crate::dtype::reduce_raw::<T>(op, &sources, &[out.cast()], len) }
                });
                Ok(())
            }
            // 16-bit floats reduce through an f32 copy anyway.
            (None, DType::F16 | DType::BF16) => {
                // SAFETY: the view aliases `buf` only while `reduce` reads it into f32
                // before writing any output.
                let input = unsafe {
                    BufRef::from_raw_host(buf.as_ref().host_ptr(), buf.len(), buf.dtype())
                };
                self.reduce(OpKind::AllReduce, input, buf, None, op)
            }
            (None, dtype) => {
                // SAFETY: MPI_IN_PLACE tells MPI to read the input from the output buffer.
                let in_place = unsafe { ferrotron_mpi_in_place() };
                let out = recv_ptr(&mut buf);
                self.raw_reduce(
                    OpKind::AllReduce,
                    in_place,
                    out,
                    buf.len(),
                    None,
                    raw_dtype(dtype),
                    op,
                )?;
                average_in_place(&mut buf, op, self.core.size);
                Ok(())
            }
        })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        buf.declare("broadcast", true)?;
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            return crate::cuda::staged_inout(buf, |host| self.broadcast(host, root));
        }
        let sig = self.check().broadcast(&buf, root)?;
        let count = self.int(OpKind::Broadcast, "count", buf.len())?;
        // SAFETY: read (copied into the check's exchange) before `call` writes `buf`.
        let data =
            unsafe { BufRef::from_raw_host(buf.as_ref().host_ptr(), buf.len(), buf.dtype()) };
        self.collective_inline(&sig, Some(data), |inlined| {
            if let Some(all) = inlined {
                let n = buf.byte_len();
                let out = recv_ptr(&mut buf);
                // SAFETY: agreed signatures: the root sent `n` bytes, which `buf` holds.
                unsafe { std::ptr::copy_nonoverlapping(all.from(root), out.cast(), n) };
                return Ok(());
            }
            // SAFETY: `buf` holds `count` elements of its dtype.
            check_rc(
                unsafe {
                    ffi::MPI_Bcast(
                        recv_ptr(&mut buf),
                        count,
                        raw_dtype(buf.dtype()),
                        root as c_int,
                        self.core.comm.0,
                    )
                },
                "MPI_Bcast",
            )
        })
    }

    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        crate::buffer::declare_in_out("all_gather", &input, &output)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::any_device(&input, &output) {
            return crate::cuda::staged(input, output, |input, output| {
                self.all_gather(input, output)
            });
        }
        let (sig, counts) = self.check().all_gather(&input, &output, None)?;
        self.gather(sig, input, output, &counts)
    }

    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        crate::buffer::declare_in_out("all_gather_v", &input, &output)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::any_device(&input, &output) {
            return crate::cuda::staged(input, output, |input, output| {
                self.all_gather_v(input, output, counts)
            });
        }
        let (sig, counts) = self.check().all_gather(&input, &output, Some(counts))?;
        self.gather(sig, input, output, &counts)
    }

    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        crate::buffer::declare_in_out("reduce_scatter", &input, &output)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::any_device(&input, &output) {
            return crate::cuda::staged(input, output, |input, output| {
                self.reduce_scatter(input, output, op)
            });
        }
        let (sig, counts) = self.check().reduce_scatter(&input, &output, None, op)?;
        self.collective(&sig, || {
            self.reduce(sig.op, input, output, Some(&counts), op)
        })
    }

    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        crate::buffer::declare_in_out("reduce_scatter_v", &input, &output)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::any_device(&input, &output) {
            return crate::cuda::staged(input, output, |input, output| {
                self.reduce_scatter_v(input, output, counts, op)
            });
        }
        let (sig, counts) = self
            .check()
            .reduce_scatter(&input, &output, Some(counts), op)?;
        self.collective(&sig, || {
            self.reduce(sig.op, input, output, Some(&counts), op)
        })
    }

    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        mut output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        crate::buffer::declare_in_out("all_to_all_v", &input, &output)?;
        #[cfg(feature = "cuda")]
        if crate::cuda::any_device(&input, &output) {
            return crate::cuda::staged(input, output, |input, output| {
                self.all_to_all_v(input, send_counts, output, recv_counts)
            });
        }
        let kind = OpKind::AllToAllV;
        let sig = self
            .check()
            .all_to_all_v(&input, send_counts, &output, recv_counts)?;
        let sends = self.ints(kind, "count", send_counts)?;
        let recvs = self.ints(kind, "count", recv_counts)?;
        let send_offsets = self.ints(kind, "offset", &offsets(send_counts))?;
        let recv_offsets = self.ints(kind, "offset", &offsets(recv_counts))?;
        let dtype = raw_dtype(input.dtype());
        self.collective(&sig, || {
            // SAFETY: lengths validated against the counts by `CallCheck`.
            check_rc(
                unsafe {
                    ffi::MPI_Alltoallv(
                        send_ptr(&input),
                        sends.as_ptr(),
                        send_offsets.as_ptr(),
                        dtype,
                        recv_ptr(&mut output),
                        recvs.as_ptr(),
                        recv_offsets.as_ptr(),
                        dtype,
                        self.core.comm.0,
                    )
                },
                "MPI_Alltoallv",
            )
        })
    }

    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        buf.declare("send", false)?;
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            return self.send(buf.to_host()?.as_buf_ref(), dest);
        }
        self.check().peer(OpKind::Send, "destination", dest)?;
        let count = self.int(OpKind::Send, "count", buf.len())?;
        self.core.queue.wait_idle();
        let _order = self.core.seq.lock();
        let record = self.start_message(OpKind::Send, buf.dtype(), buf.len(), dest);
        // SAFETY: `buf` holds `count` elements of its dtype.
        let sent = check_rc(
            unsafe {
                ffi::MPI_Ssend(
                    send_ptr(&buf),
                    count,
                    raw_dtype(buf.dtype()),
                    dest as c_int,
                    0,
                    self.core.comm.0,
                )
            },
            "MPI_Ssend",
        );
        self.recorded(record, sent)
    }

    fn recv(&self, mut buf: BufMut<'_>, src: usize) -> Result<()> {
        buf.declare("recv", true)?;
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            let mut host = crate::Buffer::zeros(buf.dtype(), buf.len());
            self.recv(host.as_buf_mut(), src)?;
            return buf.copy_from_host(&host);
        }
        self.check().peer(OpKind::Recv, "source", src)?;
        self.core.queue.wait_idle();
        let seq = self.core.seq.lock();
        let record = self.start_message(OpKind::Recv, buf.dtype(), buf.len(), src);
        let received = (|| {
            let dtype = raw_dtype(buf.dtype());
            // SAFETY: MPI_Status is plain data that MPI_Probe fills in.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let mut count: c_int = 0;
            // SAFETY: valid communicator and out-pointers.
            unsafe {
                check_rc(
                    ffi::MPI_Probe(src as c_int, 0, self.core.comm.0, &mut status),
                    "MPI_Probe",
                )?;
                check_rc(
                    ffi::MPI_Get_count(&status, dtype, &mut count),
                    "MPI_Get_count",
                )?;
            }
            // A message that does not fit is still taken, into scratch memory: the
            // sender's MPI_Ssend completes only once its message is received.
            let fits = usize::try_from(count).ok() == Some(buf.len());
            let mut scratch =
                (!fits).then(|| crate::Buffer::zeros(buf.dtype(), count.max(0) as usize));
            let target = match &mut scratch {
                Some(scratch) => recv_ptr(&mut scratch.as_buf_mut()),
                None => recv_ptr(&mut buf),
            };
            // SAFETY: `target` has room for the probed message's `count` elements.
            check_rc(
                unsafe {
                    ffi::MPI_Recv(
                        target,
                        count,
                        dtype,
                        src as c_int,
                        0,
                        self.core.comm.0,
                        ffi::RSMPI_STATUS_IGNORE,
                    )
                },
                "MPI_Recv",
            )?;
            if fits {
                return Ok(());
            }
            let mut sent = self.check().signature(OpKind::Send, Some(buf.dtype()), 0);
            sent.rank = src;
            sent.count = usize::try_from(count).unwrap_or(0);
            Err(Error::Mismatch {
                group: self.core.name.clone(),
                seq: *seq,
                calls: vec![
                    sent,
                    self.check()
                        .signature(OpKind::Recv, Some(buf.dtype()), buf.len()),
                ],
            })
        })();
        self.recorded(record, received)
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        crate::buffer::declare_exchange(ops, false)?;
        #[cfg(feature = "cuda")]
        if ops.iter().any(|op| match op {
            P2p::Send { buf, .. } => buf.cuda_stream().is_some(),
            P2p::Recv { buf, .. } => buf.cuda_stream().is_some(),
        }) {
            return self.exchange_through_host(ops);
        }
        for op in ops.iter() {
            let (kind, role, len) = match op {
                P2p::Send { buf, peer } => (OpKind::Send, "destination", (buf.len(), *peer)),
                P2p::Recv { buf, peer } => (OpKind::Recv, "source", (buf.len(), *peer)),
            };
            self.check().peer(kind, role, len.1)?;
            self.int(kind, "count", len.0)?;
        }
        self.core.queue.wait_idle();
        let _order = self.core.seq.lock();
        let first_recv = self.core.messages[1].load(Ordering::Relaxed);
        let records: Vec<Ticket> = ops
            .iter()
            .map(|op| match op {
                P2p::Send { buf, peer } => {
                    self.start_message(OpKind::Send, buf.dtype(), buf.len(), *peer)
                }
                P2p::Recv { buf, peer } => {
                    self.start_message(OpKind::Recv, buf.dtype(), buf.len(), *peer)
                }
            })
            .collect();
        let result = self.exchange_host(ops, first_recv);
        let last = records.len().saturating_sub(1);
        for (i, record) in records.into_iter().enumerate() {
            if i == last {
                return self.recorded(record, result);
            }
            self.core.recorder.end(record, result.is_ok());
        }
        result
    }

    fn isend(&self, buf: BufRef<'_>, dest: usize) -> Result<P2pWork> {
        self.check().peer(OpKind::Send, "destination", dest)?;
        // The transfer outlives the borrow: it sends a copy (device memory included).
        let data = buf.to_host()?;
        self.core.queue.wait_idle();
        let request = {
            let _order = self.core.seq.lock();
            let record = self.start_message(OpKind::Send, data.dtype(), data.len(), dest);
            let raw = Raw::Send(send_ptr(&data.as_buf_ref()));
            let posted = self.post(raw, data.len(), data.dtype(), dest, 0);
            self.core.recorder.end(record, posted.is_ok());
            posted?
        };
        let (core, request) = (self.core.clone(), Request(request));
        Ok(P2pWork::new(move || {
            let mut request = request;
            let waited = wait_one(&mut request.0, None);
            drop((data, core));
            waited.map(|_| None)
        }))
    }

    fn irecv(&self, mut buf: crate::Buffer, src: usize) -> Result<P2pWork> {
        self.check().peer(OpKind::Recv, "source", src)?;
        buf.as_buf_ref().declare("irecv", true)?;
        self.core.queue.wait_idle();
        let (dtype, len) = (buf.dtype(), buf.len());
        let seq = self.core.messages[1].load(Ordering::Relaxed);
        let request = {
            let _order = self.core.seq.lock();
            let record = self.start_message(OpKind::Recv, dtype, len, src);
            let raw = Raw::Recv(recv_ptr(&mut buf.as_buf_mut()));
            let posted = self.post(raw, len, dtype, src, 0);
            self.core.recorder.end(record, posted.is_ok());
            posted?
        };
        let this = MpiCommunicator {
            core: self.core.clone(),
            owner: false,
        };
        let request = Request(request);
        Ok(P2pWork::new(move || {
            let mut request = request;
            let received = wait_one(&mut request.0, Some(dtype))?;
            // A shorter message than the buffer leaves it partly unwritten: a mismatch.
            if received != Some(len) {
                let mut sent = this.check().signature(OpKind::Send, Some(dtype), 0);
                sent.rank = src;
                sent.count = received.unwrap_or(0);
                return Err(Error::Mismatch {
                    group: this.core.name.clone(),
                    seq,
                    calls: vec![sent, this.check().signature(OpKind::Recv, Some(dtype), len)],
                });
            }
            Ok(Some(buf))
        }))
    }

    fn barrier(&self) -> Result<()> {
        let sig = self.check().signature(OpKind::Barrier, None, 0);
        // The check's all-gather is itself a barrier: no rank leaves it before every rank
        // has sent its words.
        self.collective_inline(
            &sig,
            Some(BufRef::from(&[0u8; 0][..])),
            |inlined| match inlined {
                Some(_) => Ok(()),
                // SAFETY: valid communicator.
                None => check_rc(unsafe { ffi::MPI_Barrier(self.core.comm.0) }, "MPI_Barrier"),
            },
        )
    }

    fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
    ) -> Result<Option<Arc<dyn Communicator>>> {
        let kind = OpKind::Split;
        let sig = self.check().signature(kind, None, 0);
        let raw_color = match color {
            // SAFETY: reading an immutable constant exported by the MPI shim.
            None => unsafe { ffi::RSMPI_UNDEFINED },
            Some(c) => self.int(kind, "color", c as usize)?,
        };
        let raw_key = self.int(kind, "key", key as usize)?;
        let mut new = null_comm();
        self.collective(&sig, || {
            // SAFETY: valid communicator and out-pointer.
            check_rc(
                unsafe { ffi::MPI_Comm_split(self.core.comm.0, raw_color, raw_key, &mut new) },
                "MPI_Comm_split",
            )
        })?;
        if color.is_none() || new == null_comm() {
            return Ok(None);
        }
        let world_rank = self.core.world_ranks[self.core.rank];
        let comm = MpiCommunicator::adopt(
            RawComm(new),
            name.to_string(),
            self.core.env.clone(),
            Some(world_rank),
        )?;
        Ok(Some(Arc::new(comm)))
    }

    fn flight_record(&self) -> FlightRecord {
        self.dump().record()
    }

    fn start(&self, op: AsyncOp) -> Result<Work> {
        let handle = MpiCommunicator {
            core: self.core.clone(),
            owner: false,
        };
        self.core
            .queue
            .submit(Box::new(move || op.run_blocking(&handle)))
    }
}

impl MpiCommunicator {
    fn gather(
        &self,
        sig: CallSignature,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: &[usize],
    ) -> Result<()> {
        let kind = sig.op;
        let send = self.int(kind, "count", input.len())?;
        let recvs = self.ints(kind, "count", counts)?;
        let displs = self.ints(kind, "offset", &offsets(counts))?;
        let dtype = raw_dtype(input.dtype());
        // Equal counts only: whether per-rank counts fit would differ between ranks.
        let data = (kind == OpKind::AllGather).then_some(input);
        self.collective_inline(&sig, data, |inlined| {
            if let Some(all) = inlined {
                let (per, out) = (input.byte_len(), recv_ptr(&mut output).cast::<u8>());
                for r in 0..self.core.size {
                    // SAFETY: agreed signatures: rank r sent `per` bytes, and the output
                    // holds `size * per`.
                    unsafe { std::ptr::copy_nonoverlapping(all.from(r), out.add(r * per), per) };
                }
                return Ok(());
            }
            // SAFETY: lengths validated against the counts by `CallCheck`.
            check_rc(
                unsafe {
                    ffi::MPI_Allgatherv(
                        send_ptr(&input),
                        send,
                        dtype,
                        recv_ptr(&mut output),
                        recvs.as_ptr(),
                        displs.as_ptr(),
                        dtype,
                        self.core.comm.0,
                    )
                },
                "MPI_Allgatherv",
            )
        })
    }
}
