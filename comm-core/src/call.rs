//! What one collective call was: its kind and each rank's arguments, as the cross-rank
//! check compares them, errors report them and the flight recorder keeps them.

use crate::dtype::{DType, ReduceOp};
use ferrotron_device::Device;
use std::fmt;

/// Which collective (or point-to-point operation) a call was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce,
    /// `broadcast`.
    Broadcast,
    /// `all_gather` (equal counts).
    AllGather,
    /// `all_gather_v` (per-rank counts).
    AllGatherV,
    /// `reduce_scatter` (equal counts).
    ReduceScatter,
    /// `reduce_scatter_v` (per-rank counts).
    ReduceScatterV,
    /// `all_to_all_v`.
    AllToAllV,
    /// `barrier`.
    Barrier,
    /// `split`.
    Split,
    /// `send`.
    Send,
    /// `recv`.
    Recv,
    /// `exchange`: a batch of sends and receives (NCCL records it as one call; the other
    /// backends record each transfer as a `send` or `recv`).
    Exchange,
}

impl OpKind {
    /// Every operation kind, in a fixed order.
    pub const ALL: [OpKind; 12] = [
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::AllGatherV,
        OpKind::ReduceScatter,
        OpKind::ReduceScatterV,
        OpKind::AllToAllV,
        OpKind::Barrier,
        OpKind::Split,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Exchange,
    ];

    /// snake_case name as in the API.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::AllGatherV => "all_gather_v",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::ReduceScatterV => "reduce_scatter_v",
            OpKind::AllToAllV => "all_to_all_v",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Exchange => "exchange",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one rank asked for in a collective: compared across ranks before any data moves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CallSignature {
    /// The rank within the group.
    pub rank: usize,
    /// The collective.
    pub op: OpKind,
    /// Element type, when the operation carries data.
    pub dtype: Option<DType>,
    /// Reduction operator, for reductions.
    pub reduce: Option<ReduceOp>,
    /// Element count of the rank's send buffer (its receive buffer for broadcast/recv).
    pub count: usize,
    /// Root rank, for rooted operations.
    pub root: Option<usize>,
    /// Where the rank's buffers live; ranks of one call must agree on host vs device.
    pub memory: Device,
    /// Per-rank counts, for the `_v` operations (identical on every rank, except for
    /// `all_to_all_v` where they are this rank's send counts).
    pub counts: Option<Vec<usize>>,
    /// This rank's receive counts, for `all_to_all_v`.
    pub recv_counts: Option<Vec<usize>>,
}

impl fmt::Display for CallSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.op)?;
        if let Some(d) = self.dtype {
            write!(f, " dtype={d}")?;
        }
        if let Some(r) = self.reduce {
            write!(f, " op={r}")?;
        }
        write!(f, " count={}", self.count)?;
        if self.memory != Device::Cpu {
            write!(f, " memory={}", self.memory)?;
        }
        if let Some(root) = self.root {
            write!(f, " root={root}")?;
        }
        if let Some(c) = &self.counts {
            write!(f, " counts={c:?}")?;
        }
        if let Some(c) = &self.recv_counts {
            write!(f, " recv_counts={c:?}")?;
        }
        Ok(())
    }
}
