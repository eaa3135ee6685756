//! State shared by the rank threads of one local group: per-rank exchange slots, the
//! barrier, liveness and point-to-point mailboxes.
//!
//! Exchange protocol (the reason the `unsafe` below is sound): for call number `seq`, a
//! rank writes only its own slot's `exchange[seq % 2]`, and only before it arrives at the
//! call's first barrier. Peers read that record only after seeing the arrival (Acquire),
//! and only until they arrive at the first barrier of call `seq + 1`. The owner writes
//! `exchange[seq % 2]` again at call `seq + 2`, which it can only reach after every peer
//! has arrived at call `seq + 1`'s first barrier, i.e. after they stopped reading.
//!
//! Buffers published for direct access follow the same rule through the closing barrier:
//! a rank leaves a call only once every peer reached it or is gone, and an opening
//! barrier is decided once for all ranks (completed, or aborted by a timeout), so no peer
//! touches a buffer after its owner returned. "Gone" means that no handle on the peer's
//! communicator is left: a handle inside a call keeps it alive, so a peer cannot be gone
//! between the barriers of a call it entered.

use crate::buffer::Buffer;
use crate::error::{CallSignature, Error, OpKind, Result};
use crate::flight_recorder::{FlightRecord, RankHistory, Recorder};
use ferrotron_device::{Device, Event};
use parking_lot::{Condvar, Mutex};
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// What every group of one `run_local` world reports to the launcher.
pub(crate) struct WorldShared {
    /// Ranks that saw a lost peer or a broken group: whatever error type their code
    /// returns, their failure is a consequence of another rank's, not a root cause.
    pub(crate) saw_lost_peer: Vec<AtomicBool>,
    /// Calls each rank's flight recorder keeps, in every group of the world.
    pub(crate) flight_recorder: usize,
    /// Failures armed for the world's calls (tests of failure handling).
    pub(crate) faults: Option<super::FaultInjector>,
}

impl WorldShared {
    #[cfg(test)]
    pub(crate) fn new(size: usize) -> Arc<WorldShared> {
        let recorder = crate::flight_recorder::DEFAULT_FLIGHT_RECORDER;
        WorldShared::with(size, recorder, None)
    }

    pub(crate) fn with(
        size: usize,
        flight_recorder: usize,
        faults: Option<super::FaultInjector>,
    ) -> Arc<WorldShared> {
        Arc::new(WorldShared {
            saw_lost_peer: (0..size).map(|_| AtomicBool::new(false)).collect(),
            flight_recorder,
            faults,
        })
    }
}

/// Which barrier of a call: after the opening one peers read and write each other's
/// buffers, after the closing one they no longer do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Bounded by the timeout: a rank may never come.
    Open,
    /// Unbounded: every rank past the opening barrier runs only copies and reductions
    /// before it arrives here, and a rank that left early could have its buffers written
    /// after it returned. A peer cannot be lost in between (its call holds a handle).
    Close,
}

/// How long [`GroupShared::wait_for`] may wait.
#[derive(Clone, Copy)]
pub(crate) enum Patience<'a> {
    /// Fails fast on a lost peer, and with `Timeout` after the group's timeout, unless the
    /// function, asked then, finds the wait complete after all.
    Bounded(&'a dyn Fn(&GroupShared) -> bool),
    /// Until `ready`, which must itself count lost peers.
    UntilReady,
}

/// What a rank publishes for one call.
pub(crate) struct Exchange {
    pub(crate) sig: CallSignature,
    /// Address of the rank's send buffer (host memory), for direct reads by peers.
    pub(crate) send_ptr: usize,
    /// Address of the rank's receive buffer, for in-place algorithms.
    pub(crate) recv_ptr: usize,
    /// A copy of the send data for small messages (u64 words keep every dtype aligned).
    pub(crate) staging: Vec<u64>,
    /// `(color, key)` for split.
    pub(crate) split: (Option<u32>, u32),
    /// A device collective ordered by events (`streamed`): recorded on the rank's
    /// communication stream after the work its buffers' streams had queued, which peers'
    /// moves into and out of those buffers wait for.
    pub(crate) ready: Option<Arc<Event>>,
    /// Recorded after the rank's own moves of that call, which the peers' streams wait
    /// for before they reuse their buffers. Written after the opening barrier (hence the
    /// lock) and read by peers after the closing one.
    pub(crate) done: Mutex<Option<Arc<Event>>>,
}

#[repr(align(128))]
pub(crate) struct Slot {
    /// The number of barriers this rank has arrived at.
    arrived: AtomicU64,
    dropped: AtomicBool,
    exchange: [UnsafeCell<Exchange>; 2],
    /// Filled by the split leader for this rank (written by another rank, so locked).
    pub(crate) split_result: Mutex<Option<Arc<GroupShared>>>,
}

// SAFETY: `exchange` is accessed only under the protocol described in the module docs,
// which orders every write before every read through the `arrived` Release/Acquire pair.
unsafe impl Sync for Slot {}

/// Why a group became unusable.
#[derive(Clone)]
struct Breakage {
    message: String,
    /// The lost peer's group rank when that is the cause, so that every rank reports the
    /// same `PeerLost`.
    lost: Option<usize>,
}

/// Messages from one rank to another, with counters that let the sender wait until the
/// receiver has taken its message (sends are rendezvous on every backend).
#[derive(Default)]
struct Mailbox {
    pending: Mutex<Pending>,
    posted: AtomicU64,
    taken: AtomicU64,
}

/// What waits in a mailbox: messages nobody has taken yet, or receives started before
/// their message arrived, never both (whichever comes second is matched at once).
#[derive(Default)]
struct Pending {
    messages: VecDeque<Message>,
    receives: VecDeque<StartedReceive>,
}

/// A receive started with `irecv`: the receiver's call, and where its message goes.
struct StartedReceive {
    receiver: CallSignature,
    slot: ReceiveSlot,
}

/// Where a started receive's message lands, whichever rank's thread matches it.
pub(crate) type ReceiveSlot = Arc<Mutex<Option<Message>>>;

/// A message in flight between two ranks.
pub(crate) struct Message {
    pub(crate) data: Buffer,
    /// Set by a receiver whose buffer does not match the message (to its own call), so
    /// that the sender fails with the same `Mismatch` instead of succeeding alone.
    pub(crate) rejected: Arc<OnceLock<CallSignature>>,
}

pub(crate) struct GroupShared {
    pub(crate) name: String,
    pub(crate) world_ranks: Vec<usize>,
    pub(crate) world: Arc<WorldShared>,
    pub(crate) timeout: Duration,
    /// Computed once: asking the OS for the core count reads cgroup files (tens of µs).
    spin_window: Duration,
    slots: Vec<Slot>,
    /// Each rank's last calls: written by the rank, read by any peer without a lock.
    /// Outside the slots, whose layout the barrier's cache behaviour depends on.
    recorders: Vec<Recorder>,
    broken: Mutex<Option<Breakage>>,
    is_broken: AtomicBool,
    parked: AtomicUsize,
    /// Bumped by every wake-up, so a waiter can check its condition without holding
    /// `park_lock` and still never miss a wake-up (an event count).
    wake_generation: AtomicU64,
    /// The last opening barrier decided, as `epoch << 1 | aborted`: a rank that times
    /// out and the last rank to arrive race to decide it, and all follow the winner.
    decided: AtomicU64,
    park_lock: Mutex<()>,
    park_cv: Condvar,
    /// `mailboxes[src * size + dst]`.
    mailboxes: Vec<Mailbox>,
}

/// How long to busy-wait before yielding. A peer running on another core arrives within
/// a microsecond or two; a peer that is not running needs our core, so the window is a
/// bound on time (PAUSE costs anywhere from 10 to 150 cycles depending on the CPU), and
/// short when ranks outnumber cores.
fn spin_window(size: usize) -> Duration {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if size <= cores {
        Duration::from_micros(30)
    } else {
        Duration::from_micros(2)
    }
}

impl GroupShared {
    pub(crate) fn new(
        name: String,
        world_ranks: Vec<usize>,
        world: Arc<WorldShared>,
        timeout: Duration,
    ) -> Arc<GroupShared> {
        let size = world_ranks.len();
        let flight_recorder = world.flight_recorder;
        let empty = || {
            UnsafeCell::new(Exchange {
                sig: CallSignature {
                    rank: 0,
                    op: OpKind::Barrier,
                    dtype: None,
                    reduce: None,
                    count: 0,
                    root: None,
                    memory: Device::Cpu,
                    counts: None,
                    recv_counts: None,
                },
                send_ptr: 0,
                recv_ptr: 0,
                staging: Vec::new(),
                split: (None, 0),
                ready: None,
                done: Mutex::new(None),
            })
        };
        Arc::new(GroupShared {
            name,
            world_ranks,
            world,
            timeout,
            spin_window: spin_window(size),
            slots: (0..size)
                .map(|_| Slot {
                    arrived: AtomicU64::new(0),
                    dropped: AtomicBool::new(false),
                    exchange: [empty(), empty()],
                    split_result: Mutex::new(None),
                })
                .collect(),
            recorders: (0..size).map(|_| Recorder::new(flight_recorder)).collect(),
            broken: Mutex::new(None),
            is_broken: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            wake_generation: AtomicU64::new(0),
            decided: AtomicU64::new(0),
            park_lock: Mutex::new(()),
            park_cv: Condvar::new(),
            mailboxes: (0..size * size).map(|_| Mailbox::default()).collect(),
        })
    }

    pub(crate) fn size(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn slot(&self, rank: usize) -> &Slot {
        &self.slots[rank]
    }

    /// Group rank `rank`'s flight recorder; only that rank starts records in it.
    pub(crate) fn recorder(&self, rank: usize) -> &Recorder {
        &self.recorders[rank]
    }

    /// Every rank's recent calls, read without a lock (empty when recording is off).
    pub(crate) fn flight_record(&self) -> FlightRecord {
        if self.world.flight_recorder == 0 {
            return FlightRecord::default();
        }
        FlightRecord {
            ranks: (0..self.size())
                .map(|r| RankHistory {
                    rank: r,
                    world_rank: self.world_ranks[r],
                    calls: self.recorders[r].calls(),
                })
                .collect(),
            file: None,
        }
    }

    /// This rank's own exchange record for `seq`.
    ///
    /// # Safety
    /// Only the owning rank may call this, and only before arriving at the first barrier
    /// of call `seq` (see the module docs).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn own_exchange(&self, rank: usize, seq: u64) -> &mut Exchange {
        // SAFETY: upheld by the caller per the exchange protocol.
        unsafe { &mut *self.slots[rank].exchange[(seq % 2) as usize].get() }
    }

    /// A peer's exchange record for `seq`.
    ///
    /// # Safety
    /// The caller must have seen `rank` arrive at call `seq`'s first barrier and must not
    /// yet have arrived at call `seq + 1`'s first barrier.
    pub(crate) unsafe fn exchange(&self, rank: usize, seq: u64) -> &Exchange {
        // SAFETY: upheld by the caller per the exchange protocol.
        unsafe { &*self.slots[rank].exchange[(seq % 2) as usize].get() }
    }

    /// Whether group rank `r` is gone: its communicator is dropped, so it can never
    /// arrive again. Its launcher closure returning is not enough: a thread it shared the
    /// communicator with (through an `Arc`) may be inside a call, using our buffers.
    fn is_lost(&self, r: usize) -> bool {
        self.slots[r].dropped.load(Ordering::Acquire)
    }

    pub(crate) fn mark_dropped(&self, rank: usize) {
        self.slots[rank].dropped.store(true, Ordering::Release);
        self.wake_all();
    }

    /// Fails a call of group rank `me` entering a broken group.
    pub(crate) fn check_broken(&self, me: usize, op: OpKind, seq: u64) -> Result<()> {
        match self.breakage() {
            None => Ok(()),
            Some(b) => {
                self.note_consequence(me);
                Err(self
                    .lost_error(&b, me, op, seq)
                    .unwrap_or_else(|| Error::Broken {
                        group: self.name.clone(),
                        cause: b.message,
                    }))
            }
        }
    }

    /// Marks group rank `me`'s failure as a consequence of another rank's, unless the
    /// group broke because `me` failed.
    fn note_consequence(&self, me: usize) {
        if self.breakage().is_some_and(|b| b.lost == Some(me)) {
            return;
        }
        self.world.saw_lost_peer[self.world_ranks[me]].store(true, Ordering::Release);
    }

    fn breakage(&self) -> Option<Breakage> {
        if self.is_broken.load(Ordering::Acquire) {
            self.broken.lock().clone()
        } else {
            None
        }
    }

    /// What a call of group rank `me` fails with in a group a lost rank broke: the loss
    /// of that peer, or, for the rank that failed itself, its own failure again.
    fn lost_error(&self, breakage: &Breakage, me: usize, op: OpKind, seq: u64) -> Option<Error> {
        breakage.lost.map(|rank| match rank == me {
            true => Error::Broken {
                group: self.name.clone(),
                cause: breakage.message.clone(),
            },
            false => self.peer_lost(op, seq, rank),
        })
    }

    fn peer_lost(&self, op: OpKind, seq: u64, rank: usize) -> Error {
        Error::PeerLost {
            group: self.name.clone(),
            op,
            seq,
            rank,
            world_rank: self.world_ranks[rank],
            history: Box::new(self.flight_record()),
        }
    }

    /// Fails call `seq` (an `op`) of group rank `me` if a fault is armed for it: the
    /// group breaks with `me` lost, so that the peers fail as they do when a rank
    /// really fails.
    pub(crate) fn inject(&self, me: usize, op: OpKind, seq: u64) -> Result<()> {
        let world_rank = self.world_ranks[me];
        let fires =
            (self.world.faults.as_ref()).is_some_and(|f| f.fire(world_rank, &self.name, op));
        if !fires {
            return Ok(());
        }
        let injected = Error::Injected {
            group: self.name.clone(),
            op,
            seq,
            rank: me,
            world_rank,
        };
        self.fail_own(me, &injected);
        Err(injected)
    }

    /// Breaks the group because group rank `me` failed its share of a call with `cause`:
    /// its peers' calls fail with a lost peer naming it, its own later calls with a
    /// broken group naming `cause`.
    pub(crate) fn fail_own(&self, me: usize, cause: &Error) {
        let mut broken = self.broken.lock();
        broken.get_or_insert_with(|| Breakage {
            message: cause.to_string(),
            lost: Some(me),
        });
        self.is_broken.store(true, Ordering::Release);
        drop(broken);
        self.wake_all();
    }

    /// Breaks the group because group rank `lost` is gone or failed its share of call
    /// `seq`; returns the error every rank of the call reports.
    pub(crate) fn declare_lost(&self, op: OpKind, seq: u64, lost: usize) -> Error {
        let err = self.peer_lost(op, seq, lost);
        self.break_with(&err);
        err
    }

    /// Marks the group unusable: its ranks' barrier counts no longer agree.
    pub(crate) fn break_with(&self, err: &Error) {
        let mut broken = self.broken.lock();
        if broken.is_none() {
            let lost = match err {
                Error::PeerLost { rank, .. } => Some(*rank),
                _ => None,
            };
            *broken = Some(Breakage {
                message: err.to_string(),
                lost,
            });
        }
        self.is_broken.store(true, Ordering::Release);
        drop(broken);
        self.wake_all();
    }

    fn wake_all(&self) {
        self.wake_generation.fetch_add(1, Ordering::SeqCst);
        let _guard = self.park_lock.lock();
        self.park_cv.notify_all();
    }

    /// Arrives at barrier number `epoch` (1-based, per rank) and waits for every rank.
    /// `spin` is false for background (progress-thread) calls: their latency matters
    /// less than leaving the cores to the ranks' compute.
    pub(crate) fn barrier(
        &self,
        rank: usize,
        epoch: u64,
        call: (OpKind, u64),
        spin: bool,
        phase: Phase,
    ) -> Result<()> {
        let (op, seq) = call;
        self.slots[rank].arrived.store(epoch, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) > 0 {
            self.wake_all();
        }
        match phase {
            Phase::Open => {
                let completed = |g: &GroupShared| g.decide(epoch, false);
                self.wait_for(
                    rank,
                    op,
                    seq,
                    spin,
                    |g| g.missing(epoch).next().is_none(),
                    |g| g.missing(epoch).collect(),
                    Patience::Bounded(&completed),
                )?;
                if self.decide(epoch, true) {
                    return Ok(());
                }
                // A peer timed out here before the last rank arrived: nobody may use the
                // buffers it published.
                self.note_consequence(rank);
                Err(Error::Broken {
                    group: self.name.clone(),
                    cause: self.breakage().map_or_else(
                        || format!("a peer timed out in call {seq} ({op})"),
                        |b| b.message,
                    ),
                })
            }
            Phase::Close => {
                self.wait_for(
                    rank,
                    op,
                    seq,
                    spin,
                    |g| (0..g.size()).all(|r| !g.is_missing(r, epoch) || g.is_lost(r)),
                    |_| Vec::new(),
                    Patience::UntilReady,
                )?;
                if let Some(err) = self
                    .breakage()
                    .and_then(|b| self.lost_error(&b, rank, op, seq))
                {
                    self.note_consequence(rank);
                    return Err(err);
                }
                match (0..self.size()).find(|&r| self.is_missing(r, epoch)) {
                    None => Ok(()),
                    Some(lost) => {
                        let err = self.declare_lost(op, seq, lost);
                        self.note_consequence(rank);
                        Err(err)
                    }
                }
            }
        }
    }

    /// Decides opening barrier `epoch` as completed (every rank arrived) or aborted (a
    /// rank timed out), unless it is decided already; returns whether it completed.
    fn decide(&self, epoch: u64, completed: bool) -> bool {
        let proposal = epoch << 1 | u64::from(!completed);
        let mut current = self.decided.load(Ordering::Acquire);
        loop {
            match (current >> 1).cmp(&epoch) {
                // Later barriers happen only after this one completed.
                std::cmp::Ordering::Greater => return true,
                std::cmp::Ordering::Equal => return current & 1 == 0,
                std::cmp::Ordering::Less => {}
            }
            match self.decided.compare_exchange_weak(
                current,
                proposal,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return completed,
                Err(actual) => current = actual,
            }
        }
    }

    fn is_missing(&self, rank: usize, epoch: u64) -> bool {
        // SeqCst, not Acquire: with the arriving rank's SeqCst store of `arrived` and load
        // of `parked`, and a parking waiter's increment of `parked` and this load, one of
        // the two must see the other, so an arrival never skips waking a parked waiter.
        self.slots[rank].arrived.load(Ordering::SeqCst) < epoch
    }

    fn missing(&self, epoch: u64) -> impl Iterator<Item = usize> + '_ {
        (0..self.size()).filter(move |&r| self.is_missing(r, epoch))
    }

    /// Waits (as group rank `me`) until `ready` holds: spins, then yields, then parks in
    /// short slices. With [`Patience::Bounded`] every slow-path round also checks for lost
    /// peers (among `waiting_on`) and the timeout.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn wait_for(
        &self,
        me: usize,
        op: OpKind,
        seq: u64,
        spin: bool,
        mut ready: impl FnMut(&GroupShared) -> bool,
        waiting_on: impl Fn(&GroupShared) -> Vec<usize>,
        patience: Patience<'_>,
    ) -> Result<()> {
        let start = Instant::now();
        let window = if spin {
            self.spin_window
        } else {
            Duration::ZERO
        };
        loop {
            for _ in 0..16 {
                if ready(self) {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= window {
                break;
            }
        }
        let mut rounds = 0u32;
        loop {
            if ready(self) {
                return Ok(());
            }
            let mut slice = Duration::from_millis(2);
            if let Patience::Bounded(completed) = patience {
                // A peer lost mid-call fails everyone at once; a peer's timeout does not:
                // the ranks waiting with it time out on their own clocks and name the
                // missing.
                if let Some(err) = self
                    .breakage()
                    .and_then(|b| self.lost_error(&b, me, op, seq))
                {
                    // Unless the barrier completed since `ready` was checked and a peer
                    // past it then failed its device share: peers past it use our buffers
                    // and wait for us at the closing barrier, which reports the loss.
                    // Deciding also keeps a late arrival from passing once we leave.
                    if completed(self) {
                        return Ok(());
                    }
                    self.note_consequence(me);
                    return Err(err);
                }
                // Liveness first, then who is still missing: a peer's arrival
                // happens-before its departure, so a peer that arrived and then left
                // (finished its part and dropped its communicator) is never mistaken for a
                // lost one. The reverse order raced: a stale "missing" list, then a
                // departure seen later.
                let lost: Vec<usize> = (0..self.size()).filter(|&r| self.is_lost(r)).collect();
                if !lost.is_empty() && ready(self) {
                    return Ok(());
                }
                if let Some(lost) = waiting_on(self).into_iter().find(|r| lost.contains(r)) {
                    let err = self.declare_lost(op, seq, lost);
                    self.note_consequence(me);
                    return Err(err);
                }
                let waited = start.elapsed();
                if waited >= self.timeout {
                    if completed(self) {
                        return Ok(());
                    }
                    let missing = waiting_on(self);
                    let err = Error::Timeout {
                        group: self.name.clone(),
                        op,
                        seq,
                        missing_world: missing.iter().map(|&r| self.world_ranks[r]).collect(),
                        missing,
                        waited,
                        history: Box::new(self.flight_record()),
                    };
                    self.break_with(&err);
                    return Err(err);
                }
                slice = slice.min(self.timeout - waited);
            }
            rounds += 1;
            if rounds < 64 {
                std::thread::yield_now();
                continue;
            }
            // Park; peers wake us on arrival, and the slice bounds how late we notice a
            // peer that died without waking anyone. `ready` runs outside `park_lock`
            // because it may itself wake others (a receive does); a wake-up between the
            // check and the wait shows as a new generation, so it is not lost.
            self.parked.fetch_add(1, Ordering::SeqCst);
            let generation = self.wake_generation.load(Ordering::SeqCst);
            if !ready(self) {
                let mut guard = self.park_lock.lock();
                if self.wake_generation.load(Ordering::SeqCst) == generation {
                    self.park_cv.wait_for(&mut guard, slice);
                }
            }
            self.parked.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Hands `msg` to `dst` without waiting: to its oldest started receive, else into
    /// its mailbox; [`GroupShared::wait_taken`] waits for it to be taken.
    pub(crate) fn post(&self, src: usize, dst: usize, msg: Message) -> u64 {
        let mailbox = &self.mailboxes[src * self.size() + dst];
        let ticket = {
            let mut pending = mailbox.pending.lock();
            let ticket = mailbox.posted.fetch_add(1, Ordering::SeqCst);
            match pending.receives.pop_front() {
                Some(started) => {
                    Self::take(mailbox, &msg, &started.receiver);
                    *started.slot.lock() = Some(msg);
                }
                None => pending.messages.push_back(msg),
            }
            ticket
        };
        self.wake_all();
        ticket
    }

    /// Waits, as a collective waits, until `dst` has taken the message `post` numbered
    /// `ticket`.
    pub(crate) fn wait_taken(&self, src: usize, dst: usize, ticket: u64, seq: u64) -> Result<()> {
        let mailbox = &self.mailboxes[src * self.size() + dst];
        self.wait_for(
            src,
            OpKind::Send,
            seq,
            true,
            |_| mailbox.taken.load(Ordering::Acquire) > ticket,
            |_| vec![dst],
            Patience::Bounded(&|_| false),
        )
    }

    /// Marks `msg` taken by `receiver`: rejected first when its dtype or length differs,
    /// so that the sender never sees a mismatched message taken without the rejection.
    fn take(mailbox: &Mailbox, msg: &Message, receiver: &CallSignature) {
        if Some(msg.data.dtype()) != receiver.dtype || msg.data.len() != receiver.count {
            let _ = msg.rejected.set(receiver.clone());
        }
        mailbox.taken.fetch_add(1, Ordering::AcqRel);
    }

    /// Starts a receive from `src` to `dst` without waiting: it takes the oldest waiting
    /// message now, or the next one posted, before any later receive does.
    pub(crate) fn start_receive(
        &self,
        src: usize,
        dst: usize,
        receiver: CallSignature,
    ) -> ReceiveSlot {
        let mailbox = &self.mailboxes[src * self.size() + dst];
        let slot = ReceiveSlot::default();
        let taken = {
            let mut pending = mailbox.pending.lock();
            match pending.messages.pop_front() {
                Some(msg) => {
                    Self::take(mailbox, &msg, &receiver);
                    *slot.lock() = Some(msg);
                    true
                }
                None => {
                    let slot = slot.clone();
                    pending
                        .receives
                        .push_back(StartedReceive { receiver, slot });
                    false
                }
            }
        };
        if taken {
            self.wake_all();
        }
        slot
    }

    /// Takes back a receive `start_receive` started and nobody will wait for, so that
    /// the next message from `src` waits for `dst`'s next receive instead of landing in
    /// a slot nobody reads (and its sender learning it was delivered). A message already
    /// matched to it was delivered, as a completed receive's is: it stays taken.
    pub(crate) fn withdraw_receive(&self, src: usize, dst: usize, slot: &ReceiveSlot) {
        let mailbox = &self.mailboxes[src * self.size() + dst];
        let mut pending = mailbox.pending.lock();
        pending
            .receives
            .retain(|started| !Arc::ptr_eq(&started.slot, slot));
    }

    /// Waits, as a collective waits, for the message of a receive `start_receive`
    /// started.
    pub(crate) fn wait_received(
        &self,
        src: usize,
        dst: usize,
        seq: u64,
        slot: &ReceiveSlot,
    ) -> Result<Message> {
        self.wait_for_message(src, dst, seq, || slot.lock().take())
    }

    /// Takes the next message from `src` to `dst`, waiting as a collective would. Started
    /// receives take their messages first: while one waits, no message waits.
    pub(crate) fn receive(
        &self,
        src: usize,
        dst: usize,
        seq: u64,
        receiver: &CallSignature,
    ) -> Result<Message> {
        let mailbox = &self.mailboxes[src * self.size() + dst];
        self.wait_for_message(src, dst, seq, || {
            let message = mailbox.pending.lock().messages.pop_front()?;
            Self::take(mailbox, &message, receiver);
            self.wake_all();
            Some(message)
        })
    }

    /// Waits, as a collective waits on `src`, until `take` yields the message.
    fn wait_for_message(
        &self,
        src: usize,
        dst: usize,
        seq: u64,
        mut take: impl FnMut() -> Option<Message>,
    ) -> Result<Message> {
        let mut taken = None;
        self.wait_for(
            dst,
            OpKind::Recv,
            seq,
            true,
            |_| {
                if taken.is_none() {
                    taken = take();
                }
                taken.is_some()
            },
            |_| vec![src],
            Patience::Bounded(&|_| false),
        )?;
        // `wait_for` returns Ok only once `ready` saw a message, which it keeps in `taken`.
        taken.ok_or_else(|| Error::Config("internal: receive finished without a message".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A receive's readiness check wakes the sender. It used to run under `park_lock`,
    /// so a message that arrived just as the receiver parked deadlocked the receiver on
    /// its own lock (a 1-in-20 hang of the 8-rank collectives test on CI). The check
    /// below reports ready, and wakes, exactly when the waiter is about to park.
    #[test]
    fn a_readiness_check_that_wakes_others_cannot_deadlock_a_parking_waiter() {
        let group = GroupShared::new(
            "world".into(),
            vec![0],
            WorldShared::new(1),
            Duration::from_secs(5),
        );
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let mut took = false;
            let result = group.wait_for(
                0,
                OpKind::Recv,
                0,
                false,
                |g| {
                    // Like a receive, which keeps the message it took: ready stays ready.
                    if !took && g.parked.load(Ordering::SeqCst) > 0 {
                        took = true;
                        g.wake_all();
                    }
                    took
                },
                |_| Vec::new(),
                Patience::Bounded(&|_| false),
            );
            let _ = done.send(result.is_ok());
        });
        let ready = finished
            .recv_timeout(Duration::from_secs(20))
            .expect("the waiter deadlocked instead of returning");
        assert!(ready);
    }

    fn two_rank_group(timeout: Duration) -> Arc<GroupShared> {
        GroupShared::new("world".into(), vec![0, 1], WorldShared::new(2), timeout)
    }

    /// Between the barriers of a call a peer may still write into our buffers, so the
    /// closing barrier waits for it however long it takes (it only copies and reduces).
    #[test]
    fn a_closing_barrier_waits_for_a_slow_peer_past_the_timeout() {
        let group = two_rank_group(Duration::from_millis(50));
        let call = (OpKind::AllReduce, 0);
        let slow = Duration::from_millis(200);
        let (left, slow_arrived) = std::thread::scope(|s| {
            let fast = s.spawn(|| {
                group.barrier(0, 1, call, true, Phase::Open)?;
                group.barrier(0, 2, call, true, Phase::Close)?;
                Ok::<_, Error>(Instant::now())
            });
            let late = s.spawn(|| {
                group.barrier(1, 1, call, true, Phase::Open)?;
                std::thread::sleep(slow);
                let arrived = Instant::now();
                group.barrier(1, 2, call, true, Phase::Close)?;
                Ok::<_, Error>(arrived)
            });
            (fast.join().unwrap(), late.join().unwrap())
        });
        let (left, slow_arrived) = (left.unwrap(), slow_arrived.unwrap());
        assert!(left >= slow_arrived, "rank 0 left before its peer was done");
    }

    /// A rank that times out at an opening barrier returns and may free its buffers, so
    /// a peer arriving just after must not go on to use them.
    #[test]
    fn a_rank_arriving_after_its_peer_timed_out_does_not_proceed() {
        let group = two_rank_group(Duration::from_millis(50));
        let call = (OpKind::AllReduce, 0);
        let (first, late) = std::thread::scope(|s| {
            let first = s.spawn(|| group.barrier(0, 1, call, true, Phase::Open));
            let late = s.spawn(|| {
                // Arrive only once rank 0 has given up on us.
                while group.decided.load(Ordering::Acquire) == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                group.barrier(1, 1, call, true, Phase::Open)
            });
            (first.join().unwrap(), late.join().unwrap())
        });
        assert!(matches!(first, Err(Error::Timeout { .. })), "{first:?}");
        assert!(matches!(late, Err(Error::Broken { .. })), "{late:?}");
    }

    /// The review's use-after-free: rank 0 gives a clone of its communicator to a thread
    /// that runs a large (direct) all-reduce, then returns an error. The thread writes its
    /// share into rank 1's buffer between the call's barriers, so rank 1 must not return
    /// before the thread reached the closing barrier, however long its share takes. The
    /// thread runs the all-reduce's own steps so that its share is deterministically late:
    /// it writes once rank 1 returned, or after 300 ms. Rank 1's buffer outlives the
    /// world, so on a regression a late write is seen, not undefined behaviour.
    #[test]
    fn a_closing_barrier_waits_for_a_clone_of_a_rank_whose_closure_returned() {
        use crate::buffer::BufMut;
        use crate::communicator::{Communicator, CommunicatorExt};
        use crate::dtype::{reduce_raw, ReduceOp};
        use crate::local::{chunk, LocalLauncher};
        const LEN: usize = 1 << 15; // 128 KiB of f32: the direct path
        const SHARE_DELAY: Duration = Duration::from_millis(300);
        let victim = Mutex::new(vec![1.0f32; LEN]);
        let rank1_returned = AtomicBool::new(false);
        // (whether rank 1 had returned when the clone wrote its share, the clone's result)
        let clone_outcome = Mutex::new(None);
        let outcomes = std::thread::scope(|scope| {
            LocalLauncher::new(2)
                .unwrap()
                .timeout(Duration::from_secs(10))
                .run_each(|comm| {
                    let group = comm.core.group.clone();
                    if comm.rank() == 1 {
                        // Enter only once the clone has: rank 1 then waits for it at the
                        // closing barrier, not the opening one.
                        while group.slots[0].arrived.load(Ordering::SeqCst) == 0 {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        let mut buf = victim.lock();
                        let result = comm.all_reduce_slice(&mut buf[..], ReduceOp::Sum);
                        rank1_returned.store(true, Ordering::SeqCst);
                        return result;
                    }
                    let comm = Arc::new(comm);
                    let clone = Arc::clone(&comm);
                    // Disconnects when this closure returns.
                    let (_closure_alive, closure_returned) = mpsc::channel::<()>();
                    let (returned, outcome) = (&rank1_returned, &clone_outcome);
                    scope.spawn(move || {
                        let core = &clone.core;
                        let mut own = vec![2.0f32; LEN];
                        let mut buf = BufMut::from(&mut own);
                        let ptr = buf.host_ptr_mut() as usize;
                        let sig = core.check().all_reduce(&buf, ReduceOp::Sum).unwrap();
                        let counters = &mut *core.counters.lock();
                        let seq = core.begin(counters, sig, |ex| ex.recv_ptr = ptr).unwrap();
                        // A slow share, started only once rank 0's closure returned.
                        let _ = closure_returned.recv();
                        let deadline = Instant::now() + SHARE_DELAY;
                        while !returned.load(Ordering::SeqCst) && Instant::now() < deadline {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        let rank1_had_returned = returned.load(Ordering::SeqCst);
                        let (start, count) = chunk(LEN, 2, 0);
                        let rows: Vec<*const f32> = (0..2)
                            .map(|r| (core.peer(r, seq).recv_ptr as *const f32).wrapping_add(start))
                            .collect();
                        let outputs: Vec<*mut f32> = rows.iter().map(|&p| p.cast_mut()).collect();
                        // SAFETY: both buffers hold LEN elements and are still alive (rank
                        // 1's outlives the world); chunk 0 is this rank's alone.
                        unsafe { reduce_raw::<f32>(ReduceOp::Sum, &rows, &outputs, count) };
                        let closed =
                            core.barrier_step(counters, OpKind::AllReduce, seq, Phase::Close);
                        *outcome.lock() = Some((rank1_had_returned, closed));
                    });
                    Err(Error::Config("rank 0 gives up".into()))
                })
        });
        let (rank1_had_returned, closed) = clone_outcome.into_inner().unwrap();
        assert!(
            !rank1_had_returned,
            "rank 1 returned while rank 0's clone was still writing into its buffer"
        );
        assert!(closed.is_ok(), "{closed:?}");
        assert!(outcomes[1].is_ok(), "{:?}", outcomes[1].as_ref().err());
        assert!(victim.into_inner().iter().all(|&x| x == 3.0));
    }

    /// A rank whose device share fails declares itself lost after passing the opening
    /// barrier, then waits at the closing one for every peer that passed it too. A peer
    /// still in that opening barrier's slow path (readiness checked, loss not yet) used
    /// to see the loss and return `PeerLost` from a barrier that had completed: it never
    /// arrived at the closing barrier, so the failing rank waited there until the peer's
    /// communicator was dropped, and a third rank could still be writing into the peer's
    /// buffers after it returned. Rank 1 runs the opening barrier's own wait with a
    /// readiness check that, once rank 1 has parked, lets rank 0 pass and fail exactly
    /// between rank 1's readiness check and its check for a lost peer.
    #[test]
    fn a_rank_in_a_completed_opening_barrier_goes_on_when_a_peer_then_fails_its_share() {
        let group = two_rank_group(Duration::from_secs(10));
        let call = (OpKind::AllReduce, 0);
        let (op, seq) = call;
        let (release, released) = mpsc::channel::<()>();
        let (failed, has_failed) = mpsc::channel::<()>();
        let (opened, closed, failing) = std::thread::scope(|s| {
            // Rank 0 as `device_call` runs it when its share fails.
            let shared = &group;
            let failing = s.spawn(move || {
                let group = shared;
                released.recv().unwrap();
                group.barrier(0, 1, call, true, Phase::Open)?;
                group.fail_own(0, &Error::Config("its share failed".into()));
                failed.send(()).unwrap();
                group.barrier(0, 2, call, true, Phase::Close)
            });
            // Rank 1: `barrier(1, 1, call, false, Phase::Open)`, step by step.
            group.slots[1].arrived.store(1, Ordering::SeqCst);
            let (mut parked, mut let_through) = (false, false);
            let opened = group
                .wait_for(
                    1,
                    op,
                    seq,
                    false,
                    |g| {
                        let ready = g.missing(1).next().is_none();
                        // The first check after a park starts a slow-path round.
                        if parked && !let_through {
                            let_through = true;
                            release.send(()).unwrap();
                            has_failed.recv().unwrap();
                        }
                        parked |= g.parked.load(Ordering::SeqCst) > 0;
                        ready
                    },
                    |g| g.missing(1).collect(),
                    Patience::Bounded(&|g| g.decide(1, false)),
                )
                .map(|()| group.decide(1, true));
            let closed = match opened {
                Ok(true) => Some(group.barrier(1, 2, call, false, Phase::Close)),
                _ => None,
            };
            // Rank 1's communicator is dropped once its call returned: on a regression
            // that is what lets rank 0 leave its closing barrier.
            group.mark_dropped(1);
            (opened, closed, failing.join().unwrap())
        });
        assert!(
            matches!(opened, Ok(true)),
            "rank 1 left an opening barrier that completed with {opened:?}, so it never \
             reached the closing barrier where rank 0 waited for it"
        );
        // Rank 1 loses rank 0; rank 0 sees its own failure again.
        let closed = closed.unwrap();
        assert!(
            matches!(closed, Err(Error::PeerLost { rank: 0, .. })),
            "{closed:?}"
        );
        assert!(
            matches!(&failing, Err(Error::Broken { cause, .. }) if cause.contains("its share failed")),
            "{failing:?}"
        );
    }
}
