//! The `local` backend: every rank is a thread of this process and collectives move data
//! through shared memory, with no serialisation.
//!
//! Small messages (at most [`SMALL_MESSAGE_BYTES`] per rank) are copied into per-rank
//! staging areas and finished after a single barrier; larger ones are read directly from
//! the peers' buffers (each rank reduces or copies its own share) and cost two or three
//! barriers. Every call first publishes its [`CallSignature`] and checks it against the
//! peers' before touching their memory, so a mismatched call is an error, never a wrong
//! read.

#[cfg(feature = "cuda")]
mod cuda;
mod faults;
mod group;
mod moves;
mod streamed;

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::calls::{offsets, signatures_agree, CallCheck};
use crate::communicator::{AsyncOp, Communicator, P2p, P2pWork};
use crate::dtype::{reduce_raw, ReduceOp};
use crate::error::{panic_message, CallSignature, Error, OpKind, Result};
use crate::flight_recorder::{self, CallRecord, FlightRecord, Ticket};
use crate::work::{ProgressQueue, Work};
use ferrotron_device::{Event, Stream};
use group::{GroupShared, Message, Phase, WorldShared};
use moves::Call;
#[cfg(feature = "cuda")]
use moves::Shape;
use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use faults::FaultInjector;

/// Per-rank messages up to this size go through staging copies (one barrier).
pub const SMALL_MESSAGE_BYTES: usize = 64 * 1024;

/// Environment variable overriding the default collective timeout, in seconds.
pub const TIMEOUT_ENV: &str = "FERROTRON_TIMEOUT_SECS";

/// The timeout used when neither the API nor [`TIMEOUT_ENV`] sets one: generous, because
/// a slow rank (first-touch allocation, a long forward pass) is not a failure.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Launches `size` rank threads running `f`, joins them and returns their results in
/// rank order. See [`LocalLauncher`] for the timeout and per-rank results.
///
/// ```
/// use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, ReduceOp};
/// let sums = run_local(4, |comm| {
///     let mut x = [comm.rank() as f32];
///     comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
///     Ok::<_, ferrotron_comm_core::Error>(x[0])
/// })?;
/// assert_eq!(sums, vec![6.0; 4]);
/// # Ok::<(), ferrotron_comm_core::Error>(())
/// ```
pub fn run_local<T, E, F>(size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Fn(LocalCommunicator) -> std::result::Result<T, E> + Sync,
{
    LocalLauncher::new(size)?.run(f)
}

thread_local! {
    /// The size of the local world whose rank this thread runs; 0 on other threads.
    static RANK_THREADS: Cell<usize> = const { Cell::new(0) };
}

/// On a rank thread started by [`run_local`] or [`LocalLauncher`], how many rank threads
/// its world runs in this process; `None` on any other thread. Compute libraries divide
/// the cores by it so that ranks as threads do not oversubscribe them (tape's default
/// thread count does).
pub fn local_rank_threads() -> Option<usize> {
    Some(RANK_THREADS.get()).filter(|&size| size > 0)
}

/// Configures and starts a world of rank threads.
#[derive(Clone, Debug)]
pub struct LocalLauncher {
    size: usize,
    timeout: Duration,
    flight_recorder: usize,
    faults: Option<FaultInjector>,
}

impl LocalLauncher {
    /// A world of `size` ranks with the default timeout (or [`TIMEOUT_ENV`]) and flight
    /// recorder (or [`FLIGHT_RECORDER_ENV`](flight_recorder::FLIGHT_RECORDER_ENV)).
    pub fn new(size: usize) -> Result<LocalLauncher> {
        if size == 0 {
            return Err(Error::Config(
                "a local world needs at least one rank; pass size >= 1".into(),
            ));
        }
        Ok(LocalLauncher {
            size,
            timeout: timeout_from_env()?,
            flight_recorder: flight_recorder::capacity_from_env()?,
            faults: None,
        })
    }

    /// Makes the calls `faults` arms fail (see [`FaultInjector`]): for tests of what
    /// code on top does when a collective fails.
    pub fn fault_injector(mut self, faults: FaultInjector) -> LocalLauncher {
        self.faults = Some(faults);
        self
    }

    /// How long a collective waits for its peers before returning [`Error::Timeout`].
    pub fn timeout(mut self, timeout: Duration) -> LocalLauncher {
        self.timeout = timeout;
        self
    }

    /// How many recent calls each rank keeps per group for error reports (see
    /// [`flight_recorder`]); 0 turns recording off. At most
    /// [`MAX_FLIGHT_RECORDER`](flight_recorder::MAX_FLIGHT_RECORDER) are kept.
    pub fn flight_recorder(mut self, calls: usize) -> LocalLauncher {
        self.flight_recorder = calls.min(flight_recorder::MAX_FLIGHT_RECORDER);
        self
    }

    /// Runs `f` on every rank and returns the results in rank order, or the root-cause
    /// error: the first failure that is not merely a consequence (a lost peer) of another.
    pub fn run<T, E, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(LocalCommunicator) -> std::result::Result<T, E> + Sync,
    {
        let (outcomes, world) = self.launch(f);
        let mut failures: Vec<(bool, u64, Error)> = Vec::new();
        let mut values = Vec::with_capacity(outcomes.len());
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(v) => values.push(v),
                Err((order, err)) => {
                    // A rank that saw a lost peer failed because of another rank, whatever
                    // error type its own code wrapped that in.
                    let consequence = world.saw_lost_peer[rank].load(Ordering::Acquire)
                        || matches!(
                            err.root_cause(),
                            Error::PeerLost { .. } | Error::Broken { .. }
                        );
                    failures.push((consequence, order, err));
                }
            }
        }
        if failures.is_empty() {
            return Ok(values);
        }
        failures.sort_by_key(|(consequence, order, _)| (*consequence, *order));
        Err(failures.swap_remove(0).2)
    }

    /// Runs `f` on every rank and returns every rank's outcome; a failure carries the
    /// order in which it happened (0 = first) and an [`Error::RankFailed`].
    pub fn run_each<T, E, F>(&self, f: F) -> Vec<std::result::Result<T, (u64, Error)>>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(LocalCommunicator) -> std::result::Result<T, E> + Sync,
    {
        self.launch(f).0
    }

    #[allow(clippy::type_complexity)]
    fn launch<T, E, F>(&self, f: F) -> (Vec<std::result::Result<T, (u64, Error)>>, Arc<WorldShared>)
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        F: Fn(LocalCommunicator) -> std::result::Result<T, E> + Sync,
    {
        let world = WorldShared::with(self.size, self.flight_recorder, self.faults.clone());
        let group = GroupShared::new(
            "world".to_string(),
            (0..self.size).collect(),
            world.clone(),
            self.timeout,
        );
        let failure_clock = AtomicU64::new(0);
        let outcomes = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.size)
                .map(|rank| {
                    let comm = LocalCommunicator::new(group.clone(), rank);
                    let (f, clock, size) = (&f, &failure_clock, self.size);
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            RANK_THREADS.set(size);
                            ferrotron_device::use_own_streams();
                            let outcome =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                            // The rank's device work ends with it: its results are
                            // complete when the launching thread takes them.
                            let finished = ferrotron_device::finish_own_streams();
                            let (error, streams): (Box<dyn std::error::Error + Send + Sync>, _) =
                                match outcome {
                                    Ok(Ok(value)) => match finished {
                                        Ok(handoff) => return Ok((value, handoff)),
                                        Err(e) => (Box::new(Error::from(e)), None),
                                    },
                                    // A failing rank's streams are reported too: an error
                                    // path that freed memory under queued work shows there.
                                    Ok(Err(e)) => (e.into(), finished.err()),
                                    Err(panic) => {
                                        let message = panic_message(panic.as_ref());
                                        (format!("panicked: {message}").into(), finished.err())
                                    }
                                };
                            // Peers learn of the failure when the communicator is dropped,
                            // not here: a clone another thread holds may be mid-call.
                            let order = clock.fetch_add(1, Ordering::SeqCst);
                            Err((
                                order,
                                Error::RankFailed {
                                    rank,
                                    source: error,
                                    streams: streams.map(|e| e.to_string()),
                                },
                            ))
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, handle)| match handle {
                    Ok(h) => h
                        .join()
                        .map(|outcome| {
                            outcome.map(|(value, handoff)| {
                                handoff.receive();
                                value
                            })
                        })
                        .unwrap_or_else(|panic| {
                            Err((
                                u64::MAX,
                                Error::RankFailed {
                                    rank,
                                    source: panic_message(panic.as_ref()).into(),
                                    streams: None,
                                },
                            ))
                        }),
                    Err(e) => Err((
                        u64::MAX,
                        Error::Config(format!("cannot start thread for rank {rank}: {e}")),
                    )),
                })
                .collect()
        });
        (outcomes, world)
    }
}

/// The collective timeout from [`TIMEOUT_ENV`], or [`DEFAULT_TIMEOUT`]; shared with the
/// `nccl` backend's watchdog.
pub(crate) fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_ENV) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(text) => text
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{TIMEOUT_ENV}={text:?} is not a positive number of seconds (e.g. 30 or 0.5)"
                ))
            }),
    }
}

/// One rank's handle on a local group. Dropping it tells the peers this rank is gone:
/// their pending and later collectives fail with [`Error::PeerLost`]. Shared through an
/// `Arc`, the rank stays alive for its peers until the last clone is dropped, even after
/// its launcher closure returned.
pub struct LocalCommunicator {
    core: Arc<RankCore>,
    /// False for the progress thread's handle, whose drop must not signal departure.
    owner: bool,
}

/// Counters every rank advances identically; held locked for a whole call so that calls
/// from several threads (or the progress thread) on one communicator never interleave.
struct Counters {
    /// Collectives issued on this group.
    seq: u64,
    /// Barriers arrived at.
    epoch: u64,
    /// Messages sent and received (for error messages).
    sends: u64,
    recvs: u64,
    /// The flight record of the collective in progress, which [`RankCore::call`] ends.
    open: Ticket,
}

struct RankCore {
    group: Arc<GroupShared>,
    rank: usize,
    counters: Mutex<Counters>,
    queue: ProgressQueue,
    /// The communication streams of collectives over device memory (`streamed`), one
    /// per device, made on first use.
    comm_streams: Mutex<Vec<ferrotron_device::Stream>>,
}

impl LocalCommunicator {
    fn new(group: Arc<GroupShared>, rank: usize) -> LocalCommunicator {
        let queue = ProgressQueue::new(format!("{}-progress-{rank}", group.name));
        LocalCommunicator {
            core: Arc::new(RankCore {
                group,
                rank,
                counters: Mutex::new(Counters {
                    seq: 0,
                    epoch: 0,
                    sends: 0,
                    recvs: 0,
                    open: Ticket::NONE,
                }),
                comm_streams: Mutex::new(Vec::new()),
                queue,
            }),
            owner: true,
        }
    }

    /// The timeout this group's collectives use.
    pub fn timeout(&self) -> Duration {
        self.core.group.timeout
    }

    /// Every rank's recent calls in this group, as a timeout or a lost peer reports them
    /// (see [`flight_recorder`]); empty when the recorder is off.
    pub fn flight_record(&self) -> FlightRecord {
        self.core.group.flight_record()
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        // Queued operations finish (or fail) first, then peers learn we are gone.
        self.core.queue.shutdown();
        self.core.group.mark_dropped(self.core.rank);
    }
}

impl std::fmt::Debug for LocalCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCommunicator")
            .field("group", &self.core.group.name)
            .field("rank", &self.core.rank)
            .field("size", &self.core.group.size())
            .finish()
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.core.rank
    }
    fn size(&self) -> usize {
        self.core.group.size()
    }
    fn name(&self) -> &str {
        &self.core.group.name
    }
    fn backend(&self) -> &'static str {
        "local"
    }
    fn world_ranks(&self) -> &[usize] {
        &self.core.group.world_ranks
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.core.blocking(Call::AllReduce(op), None, buf, |out| {
            self.core.all_reduce(out, op)
        })
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.core.blocking(Call::Broadcast(root), None, buf, |out| {
            self.core.broadcast(out, root)
        })
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.core
            .blocking(Call::AllGather(None), Some(input), output, |out| {
                self.core.all_gather(input, out, None)
            })
    }
    fn all_gather_v(&self, input: BufRef<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let call = Call::AllGather(Some(counts.into()));
        self.core.blocking(call, Some(input), output, |out| {
            self.core.all_gather(input, out, Some(counts))
        })
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let call = Call::ReduceScatter(op, None);
        self.core.blocking(call, Some(input), output, |out| {
            self.core.reduce_scatter(input, out, None, op)
        })
    }
    fn reduce_scatter_v(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let call = Call::ReduceScatter(op, Some(counts.into()));
        self.core.blocking(call, Some(input), output, |out| {
            self.core.reduce_scatter(input, out, Some(counts), op)
        })
    }
    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let call = Call::AllToAll {
            send: send_counts.into(),
            recv: recv_counts.into(),
        };
        self.core.blocking(call, Some(input), output, |out| {
            self.core.all_to_all_v(input, send_counts, out, recv_counts)
        })
    }
    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        self.core.quiesce();
        buf.declare_transfer("send", false)?;
        self.core.send(buf, dest)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        self.core.quiesce();
        buf.declare_transfer("recv", true)?;
        self.core.recv(buf, src)
    }
    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.core.quiesce();
        crate::buffer::declare_exchange(ops, true)?;
        self.core.exchange(ops)
    }
    fn isend(&self, buf: BufRef<'_>, dest: usize) -> Result<P2pWork> {
        self.core.check().peer(OpKind::Send, "destination", dest)?;
        buf.declare_transfer("isend", false)?;
        let posted = self.core.post(buf, dest)?;
        let core = self.core.clone();
        Ok(P2pWork::new(move || {
            core.finish_send(posted).map(|()| None)
        }))
    }
    fn irecv(&self, buf: Buffer, src: usize) -> Result<P2pWork> {
        buf.as_buf_ref().declare_transfer("irecv", true)?;
        self.core.irecv(buf, src)
    }
    fn barrier(&self) -> Result<()> {
        self.core.quiesce();
        self.core.barrier()
    }
    fn split(
        &self,
        color: Option<u32>,
        key: u32,
        name: &str,
    ) -> Result<Option<Arc<dyn Communicator>>> {
        self.core.quiesce();
        Ok(self
            .core
            .split(color, key, name)?
            .map(|c| Arc::new(c) as Arc<dyn Communicator>))
    }
    fn flight_record(&self) -> FlightRecord {
        self.core.group.flight_record()
    }
    fn start(&self, op: AsyncOp) -> Result<Work> {
        let op = match self.core.start_streamed(op)? {
            Ok(queued) => return Ok(queued),
            Err(op) => op,
        };
        let handle = LocalCommunicator {
            core: self.core.clone(),
            owner: false,
        };
        self.core
            .queue
            .submit(Box::new(move || op.run_blocking(&handle)))
    }
}

/// Splits `len` elements into `parts` nearly equal chunks; returns the start of `part`
/// and its length.
fn chunk(len: usize, parts: usize, part: usize) -> (usize, usize) {
    let base = len / parts;
    let extra = len % parts;
    let start = part * base + part.min(extra);
    (start, base + usize::from(part < extra))
}

/// Element-typed pointer arithmetic on a published address.
fn at<T>(addr: usize, offset: usize) -> *const T {
    (addr as *const T).wrapping_add(offset)
}

impl RankCore {
    /// Lets the calls this rank queued on the progress thread run before a call the
    /// calling thread runs itself (calls on the communication streams took their place
    /// in the group's order when they were queued).
    fn quiesce(&self) {
        self.queue.wait_idle();
    }

    fn name(&self) -> &str {
        &self.group.name
    }

    fn check(&self) -> CallCheck<'_> {
        CallCheck {
            group: &self.group.name,
            rank: self.rank,
            size: self.group.size(),
        }
    }

    /// Publishes this rank's call, waits for every peer to publish theirs, and checks
    /// that all of them agree. Returns the call's sequence number. A fault injected
    /// into the call fails it before anything is published.
    fn begin(
        &self,
        counters: &mut Counters,
        sig: CallSignature,
        exchange: impl FnOnce(&mut group::Exchange),
    ) -> Result<u64> {
        self.group.inject(self.rank, sig.op, counters.seq)?;
        self.begin_uninjected(counters, sig, exchange)
    }

    /// [`begin`](Self::begin) for calls that meet an injected fault later (those queued
    /// on a communication stream).
    fn begin_uninjected(
        &self,
        counters: &mut Counters,
        sig: CallSignature,
        exchange: impl FnOnce(&mut group::Exchange),
    ) -> Result<u64> {
        // Recorded before anything can fail: a rank that reached a call shows it.
        counters.open = self
            .group
            .recorder(self.rank)
            .start(&CallRecord::collective(counters.seq, &sig));
        self.group.check_broken(self.rank, sig.op, counters.seq)?;
        let seq = counters.seq;
        counters.seq += 1;
        let op = sig.op;
        {
            // SAFETY: our own record, written before we arrive at this call's barrier.
            let ex = unsafe { self.group.own_exchange(self.rank, seq) };
            ex.sig = sig;
            exchange(ex);
        }
        self.barrier_step(counters, op, seq, Phase::Open)?;
        // SAFETY: every rank arrived at this call's first barrier.
        let sigs: Vec<&CallSignature> = (0..self.group.size())
            .map(|r| unsafe { &self.group.exchange(r, seq).sig })
            .collect();
        if !signatures_agree(&sigs) {
            return Err(Error::Mismatch {
                group: self.name().to_string(),
                seq,
                calls: sigs.into_iter().cloned().collect(),
            });
        }
        Ok(seq)
    }

    /// Runs one call under the counters lock (calls on a communicator never interleave)
    /// and records how the collective that `begin` started ended.
    fn call<T>(&self, body: impl FnOnce(&mut Counters) -> Result<T>) -> Result<T> {
        let counters = &mut *self.counters.lock();
        let result = body(counters);
        let open = std::mem::replace(&mut counters.open, Ticket::NONE);
        self.group.recorder(self.rank).end(open, result.is_ok());
        result
    }

    /// A call of a one-rank group that moves nothing: the flight record still shows it,
    /// completed, under its sequence number, as it shows every call a rank reached.
    fn alone(&self, sig: &CallSignature) -> Result<()> {
        self.call(|counters| {
            let call = CallRecord::collective(counters.seq, sig);
            counters.open = self.group.recorder(self.rank).start(&call);
            counters.seq += 1;
            Ok(())
        })
    }

    /// Records the start of this rank's next send or receive; returns its number.
    fn start_message(&self, op: OpKind, buf: (crate::DType, usize), peer: usize) -> (u64, Ticket) {
        let mut counters = self.counters.lock();
        let count = if op == OpKind::Send {
            &mut counters.sends
        } else {
            &mut counters.recvs
        };
        let seq = *count;
        *count += 1;
        let call = CallRecord::message(seq, op, buf.0, buf.1, peer);
        (seq, self.group.recorder(self.rank).start(&call))
    }

    /// Ends a call: peers may still be reading our buffers directly unless the data went
    /// through staging, so a direct call waits for them.
    fn finish(&self, counters: &mut Counters, op: OpKind, seq: u64, staged: bool) -> Result<()> {
        if staged {
            Ok(())
        } else {
            self.barrier_step(counters, op, seq, Phase::Close)
        }
    }

    fn barrier_step(
        &self,
        counters: &mut Counters,
        op: OpKind,
        seq: u64,
        phase: Phase,
    ) -> Result<()> {
        counters.epoch += 1;
        let spin = !self.queue.is_current_thread();
        self.group
            .barrier(self.rank, counters.epoch, (op, seq), spin, phase)
    }

    /// A peer's published record for call `seq`.
    fn peer(&self, rank: usize, seq: u64) -> &group::Exchange {
        // SAFETY: only called between `begin` (all ranks arrived) and the end of the
        // same call, while we have not arrived at the next call's first barrier.
        unsafe { self.group.exchange(rank, seq) }
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let kind = OpKind::AllReduce;
        let sig = self.check().all_reduce(&buf, op)?;
        // One rank: the result is the buffer as it is, in its stream's order, so nothing
        // is read, written or waited for (a device buffer's stream would otherwise be
        // synchronized twice, for nothing, as NCCL does not either).
        if self.group.size() == 1 {
            return self.alone(&sig);
        }
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            let call = Call::AllReduce(op);
            let shape = Shape::in_place(&call, &buf);
            return self.device_call(sig, &shape, None, buf);
        }
        let (len, dtype) = (buf.len(), buf.dtype());
        let ptr = buf.host_ptr_mut() as usize;
        self.call(|counters| {
            if buf.byte_len() <= SMALL_MESSAGE_BYTES {
                let seq = self.begin(counters, sig, |ex| stage(ex, buf.as_ref()))?;
                let n = self.group.size();
                crate::with_dtype!(dtype, T => {
                    let sources: Vec<*const T> =
                        (0..n).map(|r| self.peer(r, seq).staging.as_ptr().cast()).collect();
                    // SAFETY: agreed signatures mean every staging area holds `len` elements.
                    unsafe { reduce_raw::<T>(op, &sources, &[ptr as *mut T], len) }
                });
                return Ok(());
            }
            // Rank r reduces chunk r of every rank's buffer and writes the result into chunk r
            // of every buffer: each byte is read once and written once (the minimum), and
            // no rank touches another's chunk, so in-place is safe with two barriers.
            let seq = self.begin(counters, sig, |ex| ex.recv_ptr = ptr)?;
            let n = self.group.size();
            let (start, count) = chunk(len, n, self.rank);
            crate::with_dtype!(dtype, T => {
                let sources: Vec<*const T> =
                    (0..n).map(|r| at::<T>(self.peer(r, seq).recv_ptr, start)).collect();
                let outputs: Vec<*mut T> = sources.iter().map(|&p| p.cast_mut()).collect();
                // SAFETY: every rank's buffer has `len` elements (agreed signatures), and
                // during this phase chunk `self.rank` of every buffer is ours alone.
                unsafe { reduce_raw::<T>(op, &sources, &outputs, count) }
            });
            self.barrier_step(counters, kind, seq, Phase::Close)
        })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        let kind = OpKind::Broadcast;
        let sig = self.check().broadcast(&buf, root)?;
        // One rank is its own root: nothing to move (see `all_reduce`).
        if self.group.size() == 1 {
            return self.alone(&sig);
        }
        #[cfg(feature = "cuda")]
        if buf.cuda_stream().is_some() {
            let call = Call::Broadcast(root);
            let shape = Shape::in_place(&call, &buf);
            return self.device_call(sig, &shape, None, buf);
        }
        let bytes = buf.byte_len();
        let ptr = buf.host_ptr_mut() as usize;
        let is_root = self.rank == root;
        self.call(|counters| {
            if bytes <= SMALL_MESSAGE_BYTES {
                let seq = self.begin(counters, sig, |ex| {
                    if is_root {
                        stage(ex, buf.as_ref())
                    }
                })?;
                if !is_root {
                    let src = self.peer(root, seq).staging.as_ptr().cast::<u8>();
                    // SAFETY: the root staged `bytes` bytes (agreed dtype and count).
                    unsafe { std::ptr::copy_nonoverlapping(src, ptr as *mut u8, bytes) };
                }
                return Ok(());
            }
            let seq = self.begin(counters, sig, |ex| ex.send_ptr = ptr)?;
            if !is_root {
                let src = self.peer(root, seq).send_ptr as *const u8;
                // SAFETY: the root's buffer has `bytes` bytes and it waits for us below.
                unsafe { std::ptr::copy_nonoverlapping(src, ptr as *mut u8, bytes) };
            }
            self.barrier_step(counters, kind, seq, Phase::Close)
        })
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: Option<&[usize]>,
    ) -> Result<()> {
        let (sig, counts) = self.check().all_gather(&input, &output, counts)?;
        #[cfg(feature = "cuda")]
        if input.cuda_stream().is_some() {
            let call = Call::AllGather(None);
            let shape = Shape::blocks(&call, input.dtype(), &counts);
            return self.device_call(sig, &shape, Some(input), output);
        }
        let kind = sig.op;
        let esize = input.dtype().size_in_bytes();
        let small = counts.iter().max().copied().unwrap_or(0) * esize <= SMALL_MESSAGE_BYTES;
        let out = output.host_ptr_mut();
        self.call(|counters| {
            let seq = self.begin(counters, sig, |ex| publish_send(ex, input, small))?;
            for (r, offset) in offsets(&counts).into_iter().enumerate() {
                let peer = self.peer(r, seq);
                let src = if small {
                    peer.staging.as_ptr().cast::<u8>()
                } else {
                    peer.send_ptr as *const u8
                };
                // SAFETY: rank r published counts[r] elements (agreed counts); output holds
                // the sum of counts, checked above.
                unsafe {
                    std::ptr::copy_nonoverlapping(src, out.add(offset * esize), counts[r] * esize)
                };
            }
            self.finish(counters, kind, seq, small)
        })
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: Option<&[usize]>,
        op: ReduceOp,
    ) -> Result<()> {
        let (sig, counts) = self.check().reduce_scatter(&input, &output, counts, op)?;
        #[cfg(feature = "cuda")]
        if input.cuda_stream().is_some() {
            let call = Call::ReduceScatter(op, None);
            let shape = Shape::blocks(&call, input.dtype(), &counts);
            return self.device_call(sig, &shape, Some(input), output);
        }
        let kind = sig.op;
        let small = input.byte_len() <= SMALL_MESSAGE_BYTES;
        let out = output.host_ptr_mut() as usize;
        let offset = offsets(&counts)[self.rank];
        let count = counts[self.rank];
        self.call(|counters| {
            let seq = self.begin(counters, sig, |ex| publish_send(ex, input, small))?;
            let n = self.group.size();
            crate::with_dtype!(input.dtype(), T => {
                let sources: Vec<*const T> = (0..n)
                    .map(|r| {
                        let peer = self.peer(r, seq);
                        let base = if small { peer.staging.as_ptr() as usize } else { peer.send_ptr };
                        at::<T>(base, offset)
                    })
                    .collect();
                // SAFETY: every input holds `total` elements (agreed signatures) and our
                // output, a distinct buffer, holds `count`.
                unsafe { reduce_raw::<T>(op, &sources, &[out as *mut T], count) }
            });
            self.finish(counters, kind, seq, small)
        })
    }

    fn all_to_all_v(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        mut output: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let kind = OpKind::AllToAllV;
        let sig = self
            .check()
            .all_to_all_v(&input, send_counts, &output, recv_counts)?;
        #[cfg(feature = "cuda")]
        if input.cuda_stream().is_some() {
            let call = Call::AllToAll {
                send: send_counts.into(),
                recv: recv_counts.into(),
            };
            let shape = Shape::blocks(&call, input.dtype(), recv_counts);
            return self.device_call(sig, &shape, Some(input), output);
        }
        let esize = input.dtype().size_in_bytes();
        let in_ptr = input.host_ptr() as usize;
        let out = output.host_ptr_mut();
        self.call(|counters| {
            let seq = self.begin(counters, sig, |ex| ex.send_ptr = in_ptr)?;
            for (r, recv_offset) in offsets(recv_counts).into_iter().enumerate() {
                let peer = self.peer(r, seq);
                let peer_sends = peer.sig.counts.as_deref().unwrap_or_default();
                let send_offset: usize = peer_sends[..self.rank].iter().sum();
                // SAFETY: agreed signatures guarantee peer_sends[self.rank] == recv_counts[r]
                // and that the peer's input holds the sum of its send counts.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        at::<u8>(peer.send_ptr, send_offset * esize),
                        out.add(recv_offset * esize),
                        recv_counts[r] * esize,
                    )
                };
            }
            self.barrier_step(counters, kind, seq, Phase::Close)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.call(|counters| {
            let sig = self.check().signature(OpKind::Barrier, None, 0);
            self.begin(counters, sig, |_| {}).map(drop)
        })
    }

    fn split(&self, color: Option<u32>, key: u32, name: &str) -> Result<Option<LocalCommunicator>> {
        let kind = OpKind::Split;
        self.call(|counters| {
            let sig = self.check().signature(kind, None, 0);
            let seq = self.begin(counters, sig, |ex| ex.split = (color, key))?;
            let n = self.group.size();
            let members_of = |c: u32| {
                let mut members: Vec<usize> = (0..n)
                    .filter(|&r| self.peer(r, seq).split.0 == Some(c))
                    .collect();
                members.sort_by_key(|&r| (self.peer(r, seq).split.1, r));
                members
            };
            if let Some(c) = color {
                let members = members_of(c);
                // The lowest-ranked member creates the group for everyone in it.
                if members.iter().min() == Some(&self.rank) {
                    let world_ranks = members.iter().map(|&r| self.group.world_ranks[r]).collect();
                    let shared = GroupShared::new(
                        name.to_string(),
                        world_ranks,
                        self.group.world.clone(),
                        self.group.timeout,
                    );
                    for &m in &members {
                        *self.group.slot(m).split_result.lock() = Some(shared.clone());
                    }
                }
            }
            self.barrier_step(counters, kind, seq, Phase::Close)?;
            let Some(c) = color else { return Ok(None) };
            let shared = self.group.slot(self.rank).split_result.lock().take();
            let new_rank = members_of(c).iter().position(|&r| r == self.rank);
            match (shared, new_rank) {
                (Some(shared), Some(new_rank)) => {
                    Ok(Some(LocalCommunicator::new(shared, new_rank)))
                }
                _ => unreachable!("the leader fills every member's slot before the barrier"),
            }
        })
    }

    fn send(&self, buf: BufRef<'_>, dest: usize) -> Result<()> {
        self.check().peer(OpKind::Send, "destination", dest)?;
        let posted = self.post(buf, dest)?;
        self.finish_send(posted)
    }

    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        self.check().peer(OpKind::Recv, "source", src)?;
        let (seq, record) = self.start_message(OpKind::Recv, (buf.dtype(), buf.len()), src);
        let result = (self.group.inject(self.rank, OpKind::Recv, seq))
            .and_then(|()| self.receive_into(buf, src, seq));
        self.group.recorder(self.rank).end(record, result.is_ok());
        result
    }

    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        for op in ops.iter() {
            match op {
                P2p::Send { peer, .. } => self.check().peer(OpKind::Send, "destination", *peer)?,
                P2p::Recv { peer, .. } => self.check().peer(OpKind::Recv, "source", *peer)?,
            }
        }
        // Every send is posted before anything waits: a neighbour's receive then never
        // waits on a send queued behind our own receive, whatever order either lists.
        let mut posted = Vec::new();
        for op in ops.iter() {
            if let P2p::Send { buf, peer } = op {
                posted.push(self.post(*buf, *peer)?);
            }
        }
        // After a failure the remaining messages are still taken and the remaining sends
        // still awaited, so that every peer's batch completes too (each posted all of its
        // sends before receiving) and sees its own mismatch, if any.
        let mut first_error = None;
        for op in ops.iter_mut() {
            if let P2p::Recv { buf, peer } = op {
                let (seq, record) =
                    self.start_message(OpKind::Recv, (buf.dtype(), buf.len()), *peer);
                let result = (self.group.inject(self.rank, OpKind::Recv, seq))
                    .and_then(|()| self.receive_into(buf.reborrow(), *peer, seq));
                self.group.recorder(self.rank).end(record, result.is_ok());
                if let Err(e) = result {
                    first_error.get_or_insert(e);
                }
            }
        }
        for send in posted {
            if let Err(e) = self.finish_send(send) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Starts a receive from `src`; the handle waits for its message like `recv`.
    fn irecv(self: &Arc<Self>, mut buf: Buffer, src: usize) -> Result<P2pWork> {
        self.check().peer(OpKind::Recv, "source", src)?;
        // A broken group may hold the message of a send that already failed.
        self.group.check_broken(self.rank, OpKind::Recv, 0)?;
        // Posted ahead of its use: the device copy may start as soon as the buffer's
        // stream has run what was queued before this call, beside what it runs after.
        // Recorded before the message is numbered, so a failure here numbers nothing.
        let posted = buf
            .as_buf_ref()
            .ordered_on()
            .map(Stream::record)
            .transpose()?;
        let (seq, record) = self.start_message(OpKind::Recv, (buf.dtype(), buf.len()), src);
        if let Err(injected) = self.group.inject(self.rank, OpKind::Recv, seq) {
            self.group.recorder(self.rank).end(record, false);
            return Err(injected);
        }
        let mine = self
            .check()
            .signature(OpKind::Recv, Some(buf.dtype()), buf.len());
        let slot = self.group.start_receive(src, self.rank, mine.clone());
        let (core, withdrawn) = (self.clone(), (self.clone(), slot.clone()));
        // Nothing writes the buffer before the handle is waited on, so abandoning the
        // handle may drop it without waiting, once the receive is withdrawn.
        let finish = move || {
            let result = core
                .group
                .wait_received(src, core.rank, seq, &slot)
                .and_then(|msg| {
                    core.accept(msg, buf.as_buf_mut(), (src, seq), mine, posted.as_ref())
                });
            core.group.recorder(core.rank).end(record, result.is_ok());
            result.map(|()| Some(buf))
        };
        let withdraw = move || {
            let (core, slot) = withdrawn;
            core.group.withdraw_receive(src, core.rank, &slot);
            core.group.recorder(core.rank).end(record, false);
        };
        Ok(P2pWork::withdrawable(finish, withdraw))
    }

    /// Starts a send: records it and puts a copy of `buf` in `dest`'s mailbox.
    fn post(&self, buf: BufRef<'_>, dest: usize) -> Result<PostedSend> {
        let sig = self
            .check()
            .signature(OpKind::Send, Some(buf.dtype()), buf.len());
        let (seq, record) = self.start_message(OpKind::Send, (buf.dtype(), buf.len()), dest);
        let rejected = Arc::new(std::sync::OnceLock::new());
        let ticket = (self.group.inject(self.rank, OpKind::Send, seq))
            .and_then(|()| self.group.check_broken(self.rank, OpKind::Send, 0))
            .and_then(|()| buf.to_message())
            .map(|data| {
                let msg = Message {
                    data,
                    rejected: rejected.clone(),
                };
                self.group.post(self.rank, dest, msg)
            });
        match ticket {
            Ok(ticket) => Ok(PostedSend {
                sig,
                dest,
                seq,
                record,
                ticket,
                rejected,
            }),
            Err(e) => {
                self.group.recorder(self.rank).end(record, false);
                Err(e)
            }
        }
    }

    /// Waits until the receiver has taken a posted send; a receiver whose buffer did not
    /// match makes it the same `Mismatch` here.
    fn finish_send(&self, send: PostedSend) -> Result<()> {
        let result = self
            .group
            .wait_taken(self.rank, send.dest, send.ticket, send.seq)
            .and_then(|()| match send.rejected.get() {
                None => Ok(()),
                Some(receiver) => Err(Error::Mismatch {
                    group: self.name().to_string(),
                    seq: send.seq,
                    calls: vec![send.sig, receiver.clone()],
                }),
            });
        self.group
            .recorder(self.rank)
            .end(send.record, result.is_ok());
        result
    }

    /// The receive of message number `seq` from `src`.
    fn receive_into(&self, buf: BufMut<'_>, src: usize, seq: u64) -> Result<()> {
        // A broken group may hold the message of a send that already failed.
        self.group.check_broken(self.rank, OpKind::Recv, 0)?;
        let mine = self
            .check()
            .signature(OpKind::Recv, Some(buf.dtype()), buf.len());
        let msg = self.group.receive(src, self.rank, seq, &mine)?;
        self.accept(msg, buf, (src, seq), mine, None)
    }

    /// Copies a received message (number `seq` from `src`) into `buf`, or fails both
    /// sides if it did not match; `posted` as for `copy_from_message`.
    fn accept(
        &self,
        msg: Message,
        mut buf: BufMut<'_>,
        (src, seq): (usize, u64),
        mine: CallSignature,
        posted: Option<&Event>,
    ) -> Result<()> {
        if msg.rejected.get().is_some() {
            let mut sent =
                self.check()
                    .signature(OpKind::Send, Some(msg.data.dtype()), msg.data.len());
            sent.rank = src;
            return Err(Error::Mismatch {
                group: self.name().to_string(),
                seq,
                calls: vec![sent, mine],
            });
        }
        // Device memory stays on the devices: the message is a device copy.
        let comm = self.message_stream(&buf.as_ref())?;
        buf.copy_from_message(msg.data, comm.as_ref(), posted)
    }
}

/// A send whose message is in the receiver's mailbox, until the receiver takes it.
struct PostedSend {
    sig: CallSignature,
    dest: usize,
    seq: u64,
    record: Ticket,
    ticket: u64,
    rejected: Arc<std::sync::OnceLock<CallSignature>>,
}

/// Publishes a send buffer: a staged copy for small messages, else its address.
fn publish_send(ex: &mut group::Exchange, input: BufRef<'_>, staged: bool) {
    if staged {
        stage(ex, input)
    } else {
        ex.send_ptr = input.host_ptr() as usize
    }
}

/// Copies a send buffer into this rank's staging area.
fn stage(ex: &mut group::Exchange, data: BufRef<'_>) {
    let bytes = data.byte_len();
    ex.staging.clear();
    ex.staging.resize(bytes.div_ceil(8), 0);
    // SAFETY: `data` is valid for `bytes` bytes and the staging area was sized for them.
    unsafe {
        std::ptr::copy_nonoverlapping(data.host_ptr(), ex.staging.as_mut_ptr().cast::<u8>(), bytes)
    };
}
