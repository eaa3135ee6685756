//! Typed errors: every message says what is wrong and what would be valid.

use thiserror::Error;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What can go wrong when describing a layout or building its groups.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A world or parallel size of zero.
    #[error("{what} is 0; every size must be at least 1")]
    ZeroSize {
        /// Which size (e.g. `"tp"`, `"world size"`).
        what: &'static str,
    },

    /// The world does not split into whole copies of one model replica.
    #[error(
        "world size {world} is not divisible by {what} = {product}; \
         that product must divide {world} (one of {divisors}), \
         or the world size must be a multiple of {product}",
        divisors = join(&divisors(*world))
    )]
    NotDivisible {
        /// Number of ranks in the layout.
        world: usize,
        /// Which product failed, e.g. `"tp·pp·cp (2·3·1)"`.
        what: String,
        /// Its value.
        product: usize,
    },

    /// A token of the order string that names no axis.
    #[error("unknown axis {token:?} in order {order:?}; the axes are tp, cp, ep, dp and pp, joined by '-' (e.g. \"tp-cp-ep-dp-pp\")")]
    UnknownOrderToken {
        /// The offending token.
        token: String,
        /// The whole order string.
        order: String,
    },

    /// An axis named twice in the order string.
    #[error(
        "axis {token:?} appears more than once in order {order:?}; name each axis at most once"
    )]
    RepeatedOrderToken {
        /// The repeated axis.
        token: String,
        /// The whole order string.
        order: String,
    },

    /// An axis with more than one rank that the order string leaves out.
    #[error("{axis} has size {size} but order {order:?} does not name it; add {axis:?} to the order (e.g. \"tp-cp-ep-dp-pp\") or set its size to 1")]
    MissingOrderAxis {
        /// The missing axis.
        axis: &'static str,
        /// Its size.
        size: usize,
        /// The order string.
        order: String,
    },

    /// The expert layout disagrees with the dense one in a way Megatron rejects.
    #[error("expert layout does not fit the dense layout: {reason}")]
    ExpertMismatch {
        /// What disagrees and how to fix it.
        reason: String,
    },

    /// A pipeline stage index beyond the pipeline.
    #[error("{group} stage {stage} does not exist: pp = {pp}, so stages are 0..={last}", last = pp - 1)]
    StageOutOfRange {
        /// `"embedding"` or `"position-embedding"`.
        group: &'static str,
        /// The requested stage.
        stage: usize,
        /// Pipeline size.
        pp: usize,
    },

    /// A rank the layout does not cover.
    #[error("rank {rank} is outside the layout, which covers ranks {first}..={last}")]
    RankOutOfRange {
        /// The rank asked about.
        rank: usize,
        /// First rank of the layout (its offset).
        first: usize,
        /// Last rank of the layout.
        last: usize,
    },

    /// Coordinates beyond an axis.
    #[error("coordinate {axis} = {value} is out of range; {axis} has size {size}")]
    CoordinateOutOfRange {
        /// The axis.
        axis: &'static str,
        /// The coordinate given.
        value: usize,
        /// The axis size.
        size: usize,
    },

    /// The world communicator has fewer ranks than the layout needs.
    #[error("the world communicator has {world} ranks but the layout needs {needed} (rank offset + world size); launch {needed} or more ranks")]
    WorldTooSmall {
        /// Ranks in the world communicator.
        world: usize,
        /// Ranks the layout needs.
        needed: usize,
    },

    /// A layout too large for communicator split colours and keys, which are `u32`.
    #[error("a layout of {world} ranks is too large: group indices must fit in u32")]
    WorldTooLarge {
        /// Ranks in the layout.
        world: usize,
    },

    /// A group name that is not registered.
    #[error("no group named {name:?}; known groups: {known}", known = join(known))]
    UnknownGroup {
        /// The requested name.
        name: String,
        /// Registered names.
        known: Vec<String>,
    },

    /// A group this rank does not belong to.
    #[error("rank {rank} is not a member of group {name:?}")]
    NotAMember {
        /// The group name.
        name: String,
        /// This rank's world rank.
        rank: usize,
    },

    /// A user-defined group name that is already taken.
    #[error("a group named {name:?} already exists; pick another name")]
    DuplicateGroupName {
        /// The name.
        name: String,
    },

    /// A user-defined rank list that cannot form a group.
    #[error("group {name:?} cannot be formed: {reason}")]
    InvalidGroupRanks {
        /// The group name.
        name: String,
        /// What is wrong with its ranks.
        reason: String,
    },

    /// A collective check found a group that does not match the layout.
    #[error("group {group:?} on rank {rank}: expected {expected}, got {actual}")]
    GroupCheck {
        /// The group name.
        group: String,
        /// World rank that saw the mismatch.
        rank: usize,
        /// What the layout predicts.
        expected: String,
        /// What the communicator produced.
        actual: String,
    },

    /// A communication failure while building or using groups.
    #[error(transparent)]
    Comm(#[from] ferrotron_comm_core::Error),
}

fn divisors(n: usize) -> Vec<usize> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

fn join<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(|item| item.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_are_sorted_and_complete() {
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), vec![1, 2, 4, 8, 16]);
        assert_eq!(divisors(1), vec![1]);
    }

    #[test]
    fn not_divisible_lists_valid_products() {
        let message = Error::NotDivisible {
            world: 10,
            what: "tp·pp·cp (4·1·1)".into(),
            product: 4,
        }
        .to_string();
        assert!(message.contains("1, 2, 5, 10"), "{message}");
    }
}
