//! A flight record: the recent calls of a group's ranks, as errors carry them and the
//! [`flight_recorder`](crate::flight_recorder) reads them out of its rings.

use crate::call::{CallSignature, OpKind};
use crate::dtype::{DType, ReduceOp};
use std::fmt;
use std::path::PathBuf;

/// Where a recorded call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallState {
    /// The rank entered the call and has not left it: it is waiting, or it was when the
    /// record was read.
    Started,
    /// The call returned successfully.
    Completed,
    /// The call returned an error.
    Failed,
}

impl CallState {
    /// Lower-case name (`started`, `completed`, `failed`).
    pub fn name(self) -> &'static str {
        match self {
            CallState::Started => "started",
            CallState::Completed => "completed",
            CallState::Failed => "failed",
        }
    }

    /// The state's code in a record's packed word (the recorder's ring).
    pub(crate) fn code(self) -> u64 {
        match self {
            CallState::Started => 1,
            CallState::Completed => 2,
            CallState::Failed => 3,
        }
    }

    pub(crate) fn from_code(code: u64) -> Option<CallState> {
        match code {
            1 => Some(CallState::Started),
            2 => Some(CallState::Completed),
            3 => Some(CallState::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One recorded call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct CallRecord {
    /// The call's number in its group, as errors name it (`call #seq`): collectives count
    /// from 0 in issue order; sends and receives count their own messages.
    pub seq: u64,
    /// The operation.
    pub op: OpKind,
    /// Element type, when the operation carries data.
    pub dtype: Option<DType>,
    /// Reduction operator, for reductions.
    pub reduce: Option<ReduceOp>,
    /// Element count of this rank's send buffer (its receive buffer for broadcast/recv).
    pub count: usize,
    /// Root rank, for rooted operations.
    pub root: Option<usize>,
    /// The other rank, for send (destination) and recv (source).
    pub peer: Option<usize>,
    /// Where the call stood when the record was read.
    pub state: CallState,
}

impl CallRecord {
    /// The record of collective number `seq` with signature `sig`, just started.
    pub(crate) fn collective(seq: u64, sig: &CallSignature) -> CallRecord {
        CallRecord {
            seq,
            op: sig.op,
            dtype: sig.dtype,
            reduce: sig.reduce,
            count: sig.count,
            root: sig.root,
            peer: None,
            state: CallState::Started,
        }
    }

    /// The record of message number `seq` sent to (or received from) `peer`.
    pub(crate) fn message(
        seq: u64,
        op: OpKind,
        dtype: DType,
        count: usize,
        peer: usize,
    ) -> CallRecord {
        CallRecord {
            seq,
            op,
            dtype: Some(dtype),
            reduce: None,
            count,
            root: None,
            peer: Some(peer),
            state: CallState::Started,
        }
    }

    /// The call without its state: `all_reduce #2 (f32 × 256, sum)`.
    fn describe(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.op, self.seq)?;
        let Some(dtype) = self.dtype else {
            return Ok(());
        };
        write!(f, " ({dtype} × {}", self.count)?;
        if let Some(reduce) = self.reduce {
            write!(f, ", {reduce}")?;
        }
        if let Some(root) = self.root {
            write!(f, ", root {root}")?;
        }
        match (self.op, self.peer) {
            (OpKind::Recv, Some(peer)) => write!(f, ", from {peer}")?,
            (_, Some(peer)) => write!(f, ", to {peer}")?,
            _ => {}
        }
        f.write_str(")")
    }
}

impl fmt::Display for CallRecord {
    /// `all_reduce #2 (f32 × 256, sum): started`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f)?;
        write!(f, ": {}", self.state)
    }
}

/// One rank's recent calls in one group.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankHistory {
    /// The rank within the group.
    pub rank: usize,
    /// The same rank in the world.
    pub world_rank: usize,
    /// Its last calls, oldest first (at most the recorder's capacity).
    pub calls: Vec<CallRecord>,
}

impl RankHistory {
    /// The rank's most recent call, if it made any.
    pub fn last(&self) -> Option<&CallRecord> {
        self.calls.last()
    }

    fn who(&self) -> String {
        format!("rank {} (world rank {})", self.rank, self.world_rank)
    }
}

impl fmt::Display for RankHistory {
    /// One line: the rank, its calls oldest first (a state only where it is not
    /// `completed`), and the state of the last one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.who())?;
        let Some((last, earlier)) = self.calls.split_last() else {
            return f.write_str(": no calls recorded");
        };
        write!(f, ", last {} call(s): ", self.calls.len())?;
        for call in earlier {
            call.describe(f)?;
            if call.state != CallState::Completed {
                write!(f, " [{}]", call.state)?;
            }
            f.write_str(", ")?;
        }
        write!(f, "{last}")
    }
}

/// The recent calls of a group's ranks, as an error carries them: every rank on the
/// local backend, this rank alone (and the file it was written to) on `mpi` and `nccl`.
/// Empty when the recorder is off.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FlightRecord {
    /// Per rank, by group rank.
    pub ranks: Vec<RankHistory>,
    /// The file this rank's record was written to (`mpi` and `nccl`).
    pub file: Option<PathBuf>,
}

impl FlightRecord {
    /// Whether nothing was recorded (the recorder is off, or the backend keeps none).
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty() && self.file.is_none()
    }

    /// The history of group rank `rank`, if recorded.
    pub fn rank(&self, rank: usize) -> Option<&RankHistory> {
        self.ranks.iter().find(|h| h.rank == rank)
    }

    /// A few lines for error messages: each rank's last call and its state, ranks with
    /// the same last call on one line (so the rank that stopped elsewhere stands out),
    /// and the file, if any. Empty when nothing was recorded.
    pub fn summary(&self) -> impl fmt::Display + '_ {
        Summary(self)
    }
}

impl fmt::Display for FlightRecord {
    /// One line per rank (see [`RankHistory`]'s `Display`), then the file, if any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut lines = self
            .ranks
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>();
        if let Some(file) = &self.file {
            lines.push(format!("written to {}", file.display()));
        }
        f.write_str(&lines.join("\n"))
    }
}

struct Summary<'a>(&'a FlightRecord);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let record = self.0;
        if !record.ranks.is_empty() {
            // Ranks grouped by their last call, in order of their lowest rank.
            let mut groups: Vec<(Option<&CallRecord>, Vec<usize>)> = Vec::new();
            for history in &record.ranks {
                let last = history.last();
                match groups.iter_mut().find(|(call, _)| *call == last) {
                    Some((_, ranks)) => ranks.push(history.rank),
                    None => groups.push((last, vec![history.rank])),
                }
            }
            f.write_str("\nflight recorder, each rank's last call in this group:")?;
            for (call, ranks) in groups {
                let label = if ranks.len() == 1 { "rank" } else { "ranks" };
                write!(f, "\n  {label} {}: ", rank_ranges(&ranks))?;
                match call {
                    Some(call) => write!(f, "{call}")?,
                    None => f.write_str("no calls recorded")?,
                }
            }
        }
        if let Some(file) = &record.file {
            write!(
                f,
                "\nflight recorder: this rank's last calls are in {}; collect every rank's \
                 file to see where each one stopped",
                file.display()
            )?;
        }
        Ok(())
    }
}

/// `0-2, 5, 7-8` for ranks `[0, 1, 2, 5, 7, 8]` (sorted).
fn rank_ranges(ranks: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::rank_ranges;

    #[test]
    fn rank_ranges_compress_runs() {
        assert_eq!(rank_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(rank_ranges(&[4]), "4");
    }
}
