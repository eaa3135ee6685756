//! The emulated device's ordering checker: every read and write of emulated memory is
//! checked against the last conflicting accesses, as PyTorch's CUDA sanitizer checks
//! tensors, so a missing stream wait is an error on every machine instead of a race on a
//! GPU.
//!
//! The emulated device's streams run on worker threads (`crate::emulated`), so a missing
//! wait may change a result there, but only when the timing happens to expose it. The
//! checker finds it whatever the timing, by following what a GPU would guarantee: a
//! vector clock per agent
//! (how far into every agent's work its next call is ordered), where the agents are the
//! streams and the host threads.
//! - A call queued on a stream is ordered after the stream's earlier calls, after what
//!   the stream waited for (`Stream::wait` joins the event's clock), and after everything
//!   the queuing thread had seen complete and done itself (its clock).
//! - A thread sees work complete by waiting for it (`Stream::synchronize`,
//!   `Event::synchronize`) or by finding an event complete (`Event::is_complete`); what
//!   another thread saw does not count, so a missing wait is found whatever the timing.
//! - An access conflicts with an earlier one that overlaps it when either writes; it is
//!   ordered after it when its clock has reached the earlier call's position.
//!
//! Allocations are tracked from `alloc` (a write on the allocating stream) to the free (a
//! write of the whole allocation on the same stream; an unordered free is reported by the
//! stream's next call, as CUDA reports asynchronous errors). Pinned memory is tracked too:
//! device copies read and write it, and the host accesses it only through
//! `PinnedMemory`'s slices. Host threads order their own accesses among themselves (a
//! lock, a communicator's barrier) in ways the checker does not see: what they touch
//! from the host must reach them through a stream or an event.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// How far into each agent's calls something is ordered: `(agent, position)` pairs sorted
/// by agent; an agent not listed is at position 0 (nothing of it is ordered before).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(Vec<(u64, u64)>);

impl Clock {
    pub(crate) fn get(&self, agent: u64) -> u64 {
        match self.0.binary_search_by_key(&agent, |&(a, _)| a) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    fn advance(&mut self, agent: u64) -> u64 {
        match self.0.binary_search_by_key(&agent, |&(a, _)| a) {
            Ok(i) => {
                self.0[i].1 += 1;
                self.0[i].1
            }
            Err(i) => {
                self.0.insert(i, (agent, 1));
                1
            }
        }
    }

    fn join(&mut self, other: &Clock) {
        for &(agent, position) in &other.0 {
            match self.0.binary_search_by_key(&agent, |&(a, _)| a) {
                Ok(i) => self.0[i].1 = self.0[i].1.max(position),
                Err(i) => self.0.insert(i, (agent, position)),
            }
        }
    }
}

/// A range of memory one call reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    ptr: u64,
    /// `None`: to the end of the allocation `ptr` lies in.
    bytes: Option<usize>,
    write: bool,
}

impl Access {
    /// `bytes` bytes read from `ptr`.
    pub fn read(ptr: u64, bytes: usize) -> Access {
        Access {
            ptr,
            bytes: Some(bytes),
            write: false,
        }
    }

    /// `bytes` bytes written at `ptr`.
    pub fn write(ptr: u64, bytes: usize) -> Access {
        Access {
            ptr,
            bytes: Some(bytes),
            write: true,
        }
    }

    /// The bytes it names (none for [`rest`](Self::rest), whose extent is unknown).
    pub(crate) fn known_bytes(&self) -> u64 {
        self.bytes.unwrap_or(0) as u64
    }

    /// From `ptr` to the end of its allocation, read or written (`write`): for an
    /// argument whose extent the caller does not know (a kernel's input described only
    /// by its address).
    pub fn rest(ptr: u64, write: bool) -> Access {
        Access {
            ptr,
            bytes: None,
            write,
        }
    }
}

/// One recorded access: who made it, where in its agent's calls, and what it was.
#[derive(Clone, Copy, Debug)]
struct Record {
    start: u64,
    end: u64,
    write: bool,
    agent: u64,
    position: u64,
    op: &'static str,
}

impl Record {
    fn describe(&self, base: u64) -> String {
        format!(
            "`{}` on {} (its call {}) {} bytes {}..{}",
            self.op,
            agent_name(self.agent),
            self.position,
            if self.write { "writing" } else { "reading" },
            self.start - base,
            self.end - base,
        )
    }
}

/// Host threads' agent numbers have this bit set; streams' do not.
const HOST_BIT: u64 = 1 << 63;

fn agent_name(agent: u64) -> String {
    if agent & HOST_BIT != 0 {
        format!("host thread {}", agent & !HOST_BIT)
    } else {
        format!("emulated stream {agent}")
    }
}

/// This thread's agent number, given on first use and forgotten when the thread ends.
fn this_thread() -> u64 {
    struct Agent(u64);
    impl Drop for Agent {
        fn drop(&mut self) {
            STATE.lock().clocks.remove(&self.0);
        }
    }
    thread_local! {
        static AGENT: Agent = Agent(HOST_BIT | NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
    }
    static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
    // A thread past its thread-locals' destruction (freeing memory on its way out) is
    // thread 0, one agent for all such threads, whose clock nothing else joins.
    AGENT.try_with(|agent| agent.0).unwrap_or(HOST_BIT)
}

/// A tracked allocation and the accesses a later one may conflict with.
struct Allocation {
    id: u64,
    bytes: u64,
    kind: &'static str,
    /// At most [`RECORDS_KEPT`], allocated with the allocation: records never grow, so
    /// counting allocators see device memory, not bookkeeping (clocks, a few words per
    /// stream, are copied per call).
    records: Vec<Record>,
}

/// The accesses kept per allocation; past it the oldest goes (which may hide a race,
/// never invent one).
const RECORDS_KEPT: usize = 8;

#[derive(Default)]
struct State {
    /// Every live agent's clock: streams' and host threads'.
    clocks: HashMap<u64, Clock>,
    /// By first address.
    allocations: BTreeMap<u64, Allocation>,
    next_allocation: u64,
    next_stream: u64,
    /// A stream's unordered free, reported by its next call.
    sticky: HashMap<u64, Error>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(Default::default);

/// A new stream's agent number.
pub(crate) fn new_stream() -> u64 {
    crate::counters::bookkeeping(|| {
        let mut state = STATE.lock();
        state.next_stream += 1;
        let agent = state.next_stream;
        state.clocks.insert(agent, Clock::default());
        agent
    })
}

/// Forgets a dropped stream's clock (its recorded accesses stay: nothing ordered them).
/// A pending unordered free of the stream is forgotten with it: nothing calls on the
/// stream any more to report it.
pub(crate) fn drop_stream(agent: u64) {
    crate::counters::bookkeeping(|| {
        let mut state = STATE.lock();
        state.clocks.remove(&agent);
        state.sticky.remove(&agent);
    })
}

/// Queues a call `op` on stream `agent` that makes `accesses`: checks each against the
/// conflicting accesses before it and records it. The first unordered pair is the error;
/// the accesses are recorded either way, and callers return the error without running
/// the call.
pub(crate) fn queue(agent: u64, op: &'static str, accesses: &[Access]) -> Result<()> {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        let mut state = STATE.lock();
        if let Some(error) = state.sticky.remove(&agent) {
            return Err(error);
        }
        state.queue(thread, agent, op, accesses)
    })
}

/// Declares that this thread itself reads or writes `accesses` of emulated memory (a
/// communicator's host code over emulated buffers, say): each must be ordered after the
/// conflicting device work before it by a host wait of this thread
/// (`Stream::synchronize`, `Event::synchronize`, or an event found complete), or it is
/// [`Error::Unordered`]. Memory the emulated device did not allocate is not checked.
pub fn host_access(op: &'static str, accesses: &[Access]) -> Result<()> {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        STATE.lock().host_access(thread, op, accesses)
    })
}

/// Stream `agent`'s clock now, for an event recorded there.
pub(crate) fn record(agent: u64) -> Clock {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        let mut state = STATE.lock();
        // Recording is queued like a call: it follows what this thread did before.
        let mine = state.clocks.get(&thread).cloned().unwrap_or_default();
        let clock = state.clocks.entry(agent).or_default();
        clock.join(&mine);
        clock.clone()
    })
}

/// Stream `agent` waits for `event`.
pub(crate) fn wait(agent: u64, event: &Clock) {
    crate::counters::bookkeeping(|| {
        STATE.lock().clocks.entry(agent).or_default().join(event);
    })
}

/// Stream `agent`'s clock now (how far into every agent's work its queued calls are
/// ordered), for a host wait that waits for exactly those calls.
pub(crate) fn stream_clock(agent: u64) -> Clock {
    crate::counters::bookkeeping(|| STATE.lock().clocks.get(&agent).cloned().unwrap_or_default())
}

/// This thread has seen stream `agent`'s work up to `clock` (taken by [`stream_clock`])
/// complete; returns the stream's pending error.
pub(crate) fn synchronize_stream(agent: u64, clock: &Clock) -> Result<()> {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        let mut state = STATE.lock();
        state.clocks.entry(thread).or_default().join(clock);
        match state.sticky.remove(&agent) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    })
}

/// What this thread has seen complete and done so far.
pub(crate) fn thread_clock() -> Clock {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        STATE
            .lock()
            .clocks
            .get(&thread)
            .cloned()
            .unwrap_or_default()
    })
}

/// This thread has seen the work before an event complete.
pub(crate) fn synchronize_event(event: &Clock) {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        STATE.lock().clocks.entry(thread).or_default().join(event);
    })
}

/// Tracks `bytes` bytes at `ptr`, just allocated by stream `agent` (`None`: by the host,
/// as pinned memory is).
pub(crate) fn allocated(agent: Option<u64>, kind: &'static str, ptr: u64, bytes: usize) {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        let mut state = STATE.lock();
        state.next_allocation += 1;
        let id = state.next_allocation;
        let allocation = Allocation {
            id,
            bytes: bytes as u64,
            kind,
            records: Vec::with_capacity(RECORDS_KEPT),
        };
        state.allocations.insert(ptr, allocation);
        // A stream-ordered allocation is a write in its stream's order: another stream must
        // not use the memory before that point. Fresh memory conflicts with nothing yet.
        if let Some(agent) = agent {
            let _ = state.queue(thread, agent, "alloc", &[Access::write(ptr, bytes)]);
        }
    })
}

/// Stops tracking the allocation at `ptr`, freed in stream `agent`'s order (`None`: by this
/// thread, once its copies are waited for). An unordered free becomes the pending error of
/// the freeing stream (of the host's: of every stream that used the memory), and `false`
/// tells the caller to leak the memory rather than free it under work that may still use
/// it.
pub(crate) fn freed(agent: Option<u64>, ptr: u64) -> bool {
    crate::counters::bookkeeping(|| {
        let thread = this_thread();
        let mut state = STATE.lock();
        let Some(allocation) = state.allocations.get(&ptr) else {
            return true;
        };
        let users: Vec<u64> = allocation.records.iter().map(|r| r.agent).collect();
        let access = [Access::write(ptr, allocation.bytes as usize)];
        let result = match agent {
            Some(agent) => state.queue(thread, agent, "free", &access),
            // Pinned memory: after the copies its owner waited for, which must be all of them.
            None => state.host_access(thread, "free", &access),
        };
        state.allocations.remove(&ptr);
        let Err(error) = result else {
            return true;
        };
        let streams = match agent {
            Some(agent) => vec![agent],
            None => users.into_iter().filter(|&user| user != thread).collect(),
        };
        for stream in streams {
            state.sticky.entry(stream).or_insert_with(|| error.clone());
        }
        false
    })
}

impl State {
    fn queue(
        &mut self,
        thread: u64,
        agent: u64,
        op: &'static str,
        accesses: &[Access],
    ) -> Result<()> {
        let mine = self.clocks.get(&thread).cloned().unwrap_or_default();
        let clock = self.clocks.entry(agent).or_default();
        clock.join(&mine);
        let position = clock.advance(agent);
        let clock = &self.clocks[&agent];
        access(
            &mut self.allocations,
            (agent, position, clock),
            op,
            accesses,
        )
    }

    fn host_access(&mut self, thread: u64, op: &'static str, accesses: &[Access]) -> Result<()> {
        let clock = self.clocks.entry(thread).or_default();
        let position = clock.advance(thread);
        let clock = &self.clocks[&thread];
        access(
            &mut self.allocations,
            (thread, position, clock),
            op,
            accesses,
        )
    }
}

/// Checks and records `accesses` of call `op`, made by `agent` as its call `position`,
/// ordered after what `clock` says; the first unordered pair is the error.
fn access(
    allocations: &mut BTreeMap<u64, Allocation>,
    (agent, position, clock): (u64, u64, &Clock),
    op: &'static str,
    accesses: &[Access],
) -> Result<()> {
    let mut first_error = None;
    for access in accesses {
        let Some((&base, allocation)) = allocations.range_mut(..=access.ptr).next_back() else {
            continue;
        };
        if access.ptr >= base + allocation.bytes.max(1) {
            continue; // not tracked memory (the host's own, say)
        }
        let start = access.ptr;
        let end = match access.bytes {
            Some(bytes) => start.saturating_add(bytes as u64),
            None => base + allocation.bytes,
        };
        if start == end {
            continue;
        }
        let new = Record {
            start,
            end,
            write: access.write,
            agent,
            position,
            op,
        };
        let result = if end > base + allocation.bytes {
            Err(allocation.overrun(base, &new))
        } else {
            allocation.check(base, &new, clock)
        };
        if let Err(error) = result {
            first_error.get_or_insert(error);
        }
        allocation.insert(new);
    }
    first_error.map_or(Ok(()), Err)
}

impl Allocation {
    /// The first earlier access that conflicts with `new` and is not ordered before it.
    fn check(&self, base: u64, new: &Record, clock: &Clock) -> Result<()> {
        let unordered = self.records.iter().find(|r| {
            r.start < new.end
                && new.start < r.end
                && (r.write || new.write)
                && r.agent != new.agent
                && clock.get(r.agent) < r.position
        });
        match unordered {
            None => Ok(()),
            Some(earlier) => Err(Error::Unordered {
                memory: self.name(),
                earlier: earlier.describe(base),
                later: new.describe(base),
            }),
        }
    }

    /// `new` reaches past the allocation's end.
    fn overrun(&self, base: u64, new: &Record) -> Error {
        Error::Invalid {
            op: "emulated device",
            reason: format!(
                "{} is past the end of {}; keep every access inside its allocation",
                new.describe(base),
                self.name()
            ),
        }
    }

    fn name(&self) -> String {
        format!("{} #{} ({} bytes)", self.kind, self.id, self.bytes)
    }

    /// Records `new`, dropping what it makes redundant: the same agent's accesses inside
    /// its range that are no stronger (a later call of one agent is ordered after its
    /// earlier ones), and everything inside a write's range (checked against it already:
    /// whatever is ordered after the write is ordered after them).
    fn insert(&mut self, new: Record) {
        self.records.retain(|r| {
            let inside = new.start <= r.start && r.end <= new.end;
            !(inside && (new.write || (r.agent == new.agent && !r.write)))
        });
        if self.records.len() == RECORDS_KEPT {
            self.records.remove(0);
        }
        self.records.push(new);
    }
}
