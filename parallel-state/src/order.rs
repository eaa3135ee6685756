//! Parallel axes and the order string that lays them out over ranks.

use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// One parallel dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Tensor parallel: splits each weight matrix.
    Tp,
    /// Context parallel: splits the sequence.
    Cp,
    /// Expert parallel: splits the experts of a mixture-of-experts layer.
    Ep,
    /// Data parallel: replicates the model over batches.
    Dp,
    /// Pipeline parallel: splits the layers into stages.
    Pp,
}

impl Axis {
    /// Every axis, in Megatron's default order.
    pub const ALL: [Axis; 5] = [Axis::Tp, Axis::Cp, Axis::Ep, Axis::Dp, Axis::Pp];

    /// The token used in order strings and group names (`"tp"`, …).
    pub fn token(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.token())
    }
}

/// How axes map onto consecutive ranks: the leftmost axis varies fastest, as in
/// Megatron-Core's `order` argument.
///
/// With `"tp-cp-ep-dp-pp"` (the default), neighbouring ranks share a tensor-parallel
/// group and the pipeline stage changes slowest. Tokens are case-insensitive. Axes left
/// out are appended at the end (they must then have size 1).
///
/// ```
/// use ferrotron_parallel_state::{Axis, Order};
/// let order: Order = "tp-pp-dp".parse()?;
/// assert_eq!(order.axes(), &[Axis::Tp, Axis::Pp, Axis::Dp]);
/// assert_eq!(Order::default().to_string(), "tp-cp-ep-dp-pp");
/// assert!("tp-tp".parse::<Order>().is_err());
/// # Ok::<(), ferrotron_parallel_state::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Order {
    axes: Vec<Axis>,
}

impl Order {
    /// The axes as written, fastest-varying first.
    pub fn axes(&self) -> &[Axis] {
        &self.axes
    }

    /// Whether the order names `axis`.
    pub fn contains(&self, axis: Axis) -> bool {
        self.axes.contains(&axis)
    }

    /// The axes as written followed by the ones left out, in [`Axis::ALL`] order: the
    /// complete layout Megatron builds from a partial order string.
    pub(crate) fn completed(&self) -> Vec<Axis> {
        let mut axes = self.axes.clone();
        axes.extend(Axis::ALL.iter().filter(|a| !self.contains(**a)));
        axes
    }
}

impl Default for Order {
    fn default() -> Order {
        Order {
            axes: Axis::ALL.to_vec(),
        }
    }
}

impl FromStr for Order {
    type Err = Error;

    fn from_str(text: &str) -> Result<Order> {
        let mut axes = Vec::new();
        for token in text.split('-') {
            let lower = token.trim().to_ascii_lowercase();
            let axis = Axis::ALL
                .into_iter()
                .find(|a| a.token() == lower)
                .ok_or_else(|| Error::UnknownOrderToken {
                    token: token.to_string(),
                    order: text.to_string(),
                })?;
            if axes.contains(&axis) {
                return Err(Error::RepeatedOrderToken {
                    token: token.to_string(),
                    order: text.to_string(),
                });
            }
            axes.push(axis);
        }
        Ok(Order { axes })
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tokens: Vec<&str> = self.axes.iter().map(|a| a.token()).collect();
        f.write_str(&tokens.join("-"))
    }
}
