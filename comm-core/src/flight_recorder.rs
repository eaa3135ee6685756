//! The flight recorder (after PyTorch's NCCL flight recorder): every communicator keeps
//! its last N calls, so that a timeout or a lost peer can say which rank stopped where.
//!
//! Each record holds the call's sequence number, op, dtype, reduction, element count,
//! root (or peer, for send and recv) and state: [`CallState::Started`] when the call
//! begins, then [`CallState::Completed`] or [`CallState::Failed`]. N comes from
//! [`FLIGHT_RECORDER_ENV`] (default [`DEFAULT_FLIGHT_RECORDER`]; 0 turns recording off)
//! or, on the local backend, from
//! [`LocalLauncher::flight_recorder`](crate::LocalLauncher::flight_recorder).
//!
//! * `local`: ranks share memory, so a rank that times out or loses a peer reads every
//!   rank's recorder and attaches the whole group's history to
//!   [`Error::Timeout`] and [`Error::PeerLost`]
//!   (`history`); their message summarises each rank's last call.
//! * `mpi`, `nccl`: a stuck peer cannot be asked. A rank whose call fails (NCCL's watchdog
//!   timeout or error, an MPI error) writes its own history to a file in
//!   [`FLIGHT_RECORDER_DIR_ENV`] (default: the system's temporary directory) and names the
//!   file in the error; collect every rank's file to see where each stopped.
//!
//! # Cost and concurrency
//! The records live in a ring allocated with the communicator: recording a call is a few
//! relaxed stores and a compare-and-swap, with no allocation and no lock. Only the owning
//! rank starts records, under the lock that already orders its communicator's calls; a
//! call's end is one compare-and-swap of its record's state, safe from any thread.
//! Readers never lock either: each record is a seqlock, so a read that overlaps a write is
//! retried (and skipped after a few attempts), and no reader can block the writer or be
//! blocked by it.

pub use crate::flight_record::{CallRecord, CallState, FlightRecord, RankHistory};

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, OpKind, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};

/// Environment variable setting how many calls each communicator keeps (`0`: none).
pub const FLIGHT_RECORDER_ENV: &str = "FERROTRON_FLIGHT_RECORDER";

/// Environment variable naming the directory where the `mpi` and `nccl` backends write a
/// failing rank's flight record (default: [`std::env::temp_dir`]).
pub const FLIGHT_RECORDER_DIR_ENV: &str = "FERROTRON_FLIGHT_RECORDER_DIR";

/// Calls kept per communicator when neither the API nor [`FLIGHT_RECORDER_ENV`] says.
pub const DEFAULT_FLIGHT_RECORDER: usize = 32;

/// The most calls a recorder keeps: a bound that catches a typo before it allocates.
pub const MAX_FLIGHT_RECORDER: usize = 1 << 20;

/// How many calls to keep, from [`FLIGHT_RECORDER_ENV`] or [`DEFAULT_FLIGHT_RECORDER`].
pub(crate) fn capacity_from_env() -> Result<usize> {
    match std::env::var(FLIGHT_RECORDER_ENV) {
        Err(_) => Ok(DEFAULT_FLIGHT_RECORDER),
        Ok(text) => text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= MAX_FLIGHT_RECORDER)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{FLIGHT_RECORDER_ENV}={text:?} is not a number of calls to keep per \
                     communicator: use e.g. 32, at most {MAX_FLIGHT_RECORDER}, or 0 to turn \
                     the flight recorder off"
                ))
            }),
    }
}

/// A started record, for marking its end. Cheap to copy; a disabled recorder hands out
/// [`Ticket::NONE`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    /// The record's id (0: not recorded).
    id: u64,
    slot: usize,
}

impl Ticket {
    pub(crate) const NONE: Ticket = Ticket { id: 0, slot: 0 };
}

/// One record of the ring. Every field is an atomic, so a read racing a write is never
/// undefined behaviour, only a torn record that the seqlock check rejects. One cache line
/// each: writing a record never disturbs another's line, nor another allocation's.
#[derive(Default)]
#[repr(align(64))]
struct Entry {
    /// The record's id (ids count from 1); 0 while it is being written.
    id: AtomicU64,
    /// `id << 2 | state code`: the end of a call swaps it, and only for its own id.
    state: AtomicU64,
    /// op, dtype, reduce and root/peer, packed (see [`pack`]).
    what: AtomicU64,
    count: AtomicU64,
    seq: AtomicU64,
}

/// A fixed ring of the last N calls of one rank in one group. The handle itself is never
/// written after creation, so it may sit next to hot data (a group's per-rank state).
pub(crate) struct Recorder {
    entries: Box<[Entry]>,
    cursor: Box<Cursor>,
}

/// The writer's position, which it moves on every call: on lines of its own, so that
/// peers spinning on nearby memory are not disturbed.
#[derive(Default)]
#[repr(align(128))]
struct Cursor {
    /// The id of the newest record (the number of records started).
    newest: AtomicU64,
    /// Where the next record goes.
    next_slot: AtomicUsize,
}

/// Attempts at reading a record that a writer keeps changing before giving up on it.
const READ_ATTEMPTS: usize = 64;
const NONE_CODE: u64 = 0xFF;

fn pack(call: &CallRecord) -> u64 {
    let code = |c: Option<u64>| c.unwrap_or(NONE_CODE);
    let party = call
        .root
        .or(call.peer)
        .map_or(0, |r| (r as u64).saturating_add(1).min(u64::from(u32::MAX)));
    call.op as u64
        | code(call.dtype.map(|d| d as u64)) << 8
        | code(call.reduce.map(|r| r as u64)) << 16
        | party << 32
}

fn unpack(what: u64, count: u64, seq: u64, state: CallState) -> Option<CallRecord> {
    let field = |shift: u32| (what >> shift) & 0xFF;
    let pick = |code: u64| (code != NONE_CODE).then_some(code as usize);
    let op = *OpKind::ALL.get(field(0) as usize)?;
    let dtype = match pick(field(8)) {
        None => None,
        Some(i) => Some(*DType::ALL.get(i)?),
    };
    let reduce = match pick(field(16)) {
        None => None,
        Some(i) => Some(*ReduceOp::ALL.get(i)?),
    };
    let party = (what >> 32).checked_sub(1).map(|r| r as usize);
    let (root, peer) = match op {
        OpKind::Send | OpKind::Recv => (None, party),
        _ => (party, None),
    };
    Some(CallRecord {
        seq,
        op,
        dtype,
        reduce,
        count: usize::try_from(count).unwrap_or(usize::MAX),
        root,
        peer,
        state,
    })
}

impl Recorder {
    /// A ring of `capacity` records (0: recording off).
    pub(crate) fn new(capacity: usize) -> Recorder {
        Recorder {
            entries: (0..capacity).map(|_| Entry::default()).collect(),
            cursor: Box::default(),
        }
    }

    /// How many calls the ring keeps.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Records `call` as started. One writer at a time: callers hold the lock that
    /// orders their communicator's calls.
    pub(crate) fn start(&self, call: &CallRecord) -> Ticket {
        let n = self.entries.len();
        if n == 0 {
            return Ticket::NONE;
        }
        let id = self.cursor.newest.load(Ordering::Relaxed) + 1;
        let slot = self.cursor.next_slot.load(Ordering::Relaxed);
        self.cursor
            .next_slot
            .store(if slot + 1 == n { 0 } else { slot + 1 }, Ordering::Relaxed);
        let entry = &self.entries[slot];
        // A seqlock write: readers that see any of the stores below also see the id
        // cleared (the fence), and a record only counts once its id is back.
        entry.id.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        entry
            .state
            .store(id << 2 | CallState::Started.code(), Ordering::Relaxed);
        entry.what.store(pack(call), Ordering::Relaxed);
        entry.count.store(call.count as u64, Ordering::Relaxed);
        entry.seq.store(call.seq, Ordering::Relaxed);
        entry.id.store(id, Ordering::Release);
        self.cursor.newest.store(id, Ordering::Release);
        Ticket { id, slot }
    }

    /// Records how the call of `ticket` ended, unless its record was overwritten since.
    pub(crate) fn end(&self, ticket: Ticket, ok: bool) {
        if ticket.id == 0 {
            return;
        }
        let state = if ok {
            CallState::Completed
        } else {
            CallState::Failed
        };
        let _ = self.entries[ticket.slot].state.compare_exchange(
            ticket.id << 2 | CallState::Started.code(),
            ticket.id << 2 | state.code(),
            Ordering::Release,
            Ordering::Relaxed,
        );
    }

    /// The recorded calls, oldest first. Never blocks: a record being rewritten is
    /// retried a few times, then left out.
    pub(crate) fn calls(&self) -> Vec<CallRecord> {
        let newest = self.cursor.newest.load(Ordering::Acquire);
        let written =
            usize::try_from(newest).map_or(self.entries.len(), |n| n.min(self.entries.len()));
        let mut calls: Vec<(u64, CallRecord)> = self.entries[..written]
            .iter()
            .filter_map(read_entry)
            .collect();
        calls.sort_by_key(|(id, _)| *id);
        calls.into_iter().map(|(_, call)| call).collect()
    }
}

fn read_entry(entry: &Entry) -> Option<(u64, CallRecord)> {
    for _ in 0..READ_ATTEMPTS {
        let id = entry.id.load(Ordering::Acquire);
        if id != 0 {
            let state = entry.state.load(Ordering::Relaxed);
            let what = entry.what.load(Ordering::Relaxed);
            let count = entry.count.load(Ordering::Relaxed);
            let seq = entry.seq.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if entry.id.load(Ordering::Relaxed) == id && state >> 2 == id {
                let state = CallState::from_code(state & 3)?;
                return unpack(what, count, seq, state).map(|call| (id, call));
            }
        }
        std::hint::spin_loop();
    }
    None
}

/// What the `mpi` and `nccl` backends know when a call fails: this rank's record.
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
pub(crate) struct Dump<'a> {
    pub(crate) backend: &'static str,
    pub(crate) group: &'a str,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) world_rank: usize,
    pub(crate) recorder: &'a Recorder,
}

#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
impl Dump<'_> {
    /// Writes this rank's record to a file (see [`Dump::write_to`]) in
    /// [`FLIGHT_RECORDER_DIR_ENV`] or the temporary directory, and names it in `error`.
    /// With the recorder off, `error` is returned as it is.
    pub(crate) fn attach(&self, error: Error) -> Error {
        if self.recorder.capacity() == 0 {
            return error;
        }
        let dir = std::env::var_os(FLIGHT_RECORDER_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let written = self.write_to(&dir, &error);
        self.name_in(error, written)
    }

    /// This rank's record alone (empty when the recorder is off).
    pub(crate) fn record(&self) -> FlightRecord {
        if self.recorder.capacity() == 0 {
            return FlightRecord::default();
        }
        FlightRecord {
            ranks: vec![self.history()],
            file: None,
        }
    }

    /// This rank's history.
    pub(crate) fn history(&self) -> RankHistory {
        RankHistory {
            rank: self.rank,
            world_rank: self.world_rank,
            calls: self.recorder.calls(),
        }
    }

    /// Writes `ferrotron-flight-<group>-rank<R>-pid<P>.txt` into `dir` (created if
    /// missing): who this rank is, the error, and its calls oldest first.
    pub(crate) fn write_to(&self, dir: &Path, error: &Error) -> std::io::Result<PathBuf> {
        let group: String = self
            .group
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let pid = std::process::id();
        let path = dir.join(format!(
            "ferrotron-flight-{group}-rank{}-pid{pid}.txt",
            self.rank
        ));
        let history = self.history();
        let mut text = format!(
            "ferrotron flight record\nbackend: {}\ngroup: {}\nrank: {} of {} (world rank {})\n\
             pid: {pid}\nerror: {error}\ncalls, oldest first ({} kept at most):\n",
            self.backend,
            self.group,
            self.rank,
            self.size,
            self.world_rank,
            self.recorder.capacity()
        );
        for call in &history.calls {
            text.push_str(&format!("  {call}\n"));
        }
        if history.calls.is_empty() {
            text.push_str("  none\n");
        }
        std::fs::create_dir_all(dir)?;
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// `error` naming where this rank's record went (or why it could not be written).
    pub(crate) fn name_in(&self, error: Error, written: std::io::Result<PathBuf>) -> Error {
        let note = match &written {
            Ok(path) => format!(
                "; flight recorder: this rank's last calls are in {}; collect every rank's \
                 file to see where each one stopped",
                path.display()
            ),
            Err(e) => format!(
                "; flight recorder: could not write this rank's last calls ({e}); set \
                 {FLIGHT_RECORDER_DIR_ENV} to a writable directory. Its last call: {}",
                self.history()
                    .last()
                    .map_or_else(|| "none".to_string(), ToString::to_string)
            ),
        };
        match error {
            Error::Timeout {
                group,
                op,
                seq,
                missing,
                missing_world,
                waited,
                ..
            } => Error::Timeout {
                group,
                op,
                seq,
                missing,
                missing_world,
                waited,
                history: Box::new(FlightRecord {
                    ranks: vec![self.history()],
                    file: written.ok(),
                }),
            },
            Error::PeerLost {
                group,
                op,
                seq,
                rank,
                world_rank,
                ..
            } => Error::PeerLost {
                group,
                op,
                seq,
                rank,
                world_rank,
                history: Box::new(FlightRecord {
                    ranks: vec![self.history()],
                    file: written.ok(),
                }),
            },
            Error::Mpi(message) => Error::Mpi(message + &note),
            Error::Nccl {
                call,
                group,
                message,
            } => Error::Nccl {
                call,
                group,
                message: message + &note,
            },
            Error::Cuda { call, message } => Error::Cuda {
                call,
                message: message + &note,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_all_arrays() {
        for (i, op) in OpKind::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i);
        }
        for (i, dtype) in DType::ALL.iter().enumerate() {
            assert_eq!(*dtype as usize, i);
        }
        for (i, reduce) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!(*reduce as usize, i);
        }
    }

    fn call(seq: u64) -> CallRecord {
        CallRecord {
            seq,
            op: OpKind::Broadcast,
            dtype: Some(DType::BF16),
            reduce: None,
            count: 1000 + seq as usize,
            root: Some(3),
            peer: None,
            state: CallState::Started,
        }
    }

    #[test]
    fn a_ring_keeps_the_last_calls_in_order_with_their_states() {
        let ring = Recorder::new(3);
        assert!(ring.calls().is_empty());
        let tickets: Vec<Ticket> = (0..5).map(|seq| ring.start(&call(seq))).collect();
        ring.end(tickets[2], true);
        ring.end(tickets[3], false);
        // An overwritten record's end changes nothing.
        ring.end(tickets[0], false);
        let calls = ring.calls();
        assert_eq!(calls.iter().map(|c| c.seq).collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(
            calls.iter().map(|c| c.state).collect::<Vec<_>>(),
            [CallState::Completed, CallState::Failed, CallState::Started]
        );
        assert_eq!(calls[2], call(4));
        let send = CallRecord::message(7, OpKind::Send, DType::U8, 5, 1);
        ring.start(&send);
        assert_eq!(ring.calls().last(), Some(&send));
        assert_eq!(send.to_string(), "send #7 (u8 × 5, to 1): started");
        assert_eq!(
            call(4).to_string(),
            "broadcast #4 (bf16 × 1004, root 3): started"
        );
    }

    #[test]
    fn a_disabled_ring_records_nothing() {
        let ring = Recorder::new(0);
        let ticket = ring.start(&call(0));
        ring.end(ticket, true);
        assert!(ring.calls().is_empty());
    }

    #[test]
    fn a_failing_rank_writes_its_record_and_names_the_file() {
        let ring = Recorder::new(4);
        let first = ring.start(&call(0));
        ring.end(first, true);
        ring.start(&call(1));
        let dump = Dump {
            backend: "nccl",
            group: "tp/0",
            rank: 2,
            size: 4,
            world_rank: 6,
            recorder: &ring,
        };
        let dir = std::env::temp_dir().join(format!("ferrotron-fr-test-{}", std::process::id()));
        let timeout = Error::Timeout {
            group: "tp/0".into(),
            op: OpKind::Broadcast,
            seq: 1,
            missing: Vec::new(),
            missing_world: Vec::new(),
            waited: std::time::Duration::from_secs(1),
            history: Box::default(),
        };
        let written = dump.write_to(&dir, &timeout);
        let path = written.as_ref().unwrap().clone();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            name,
            format!("ferrotron-flight-tp_0-rank2-pid{}.txt", std::process::id())
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("rank: 2 of 4 (world rank 6)"), "{text}");
        assert!(
            text.contains("broadcast #0 (bf16 × 1000, root 3): completed"),
            "{text}"
        );
        assert!(
            text.contains("broadcast #1 (bf16 × 1001, root 3): started"),
            "{text}"
        );
        let Error::Timeout { history, .. } = dump.name_in(timeout, written) else {
            panic!("a timeout stays a timeout")
        };
        assert_eq!(history.file.as_deref(), Some(path.as_path()));
        assert_eq!(history.ranks[0].calls.len(), 2);
        let message = history.summary().to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");

        let mpi = dump.name_in(Error::Mpi("MPI_Allreduce failed".into()), Ok(path.clone()));
        assert!(
            mpi.to_string().contains(&path.display().to_string()),
            "{mpi}"
        );
        let unwritable = dump.name_in(
            Error::Mpi("MPI_Allreduce failed".into()),
            Err(std::io::Error::other("read-only")),
        );
        let text = unwritable.to_string();
        assert!(
            text.contains("read-only") && text.contains("broadcast #1"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
