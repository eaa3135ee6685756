//! The one split rule every mapping uses, and the copies that turn a tensor split along
//! any dimension into the contiguous per-rank blocks collectives move.

use crate::error::{Error, Result};

/// Per-rank lengths when a dimension of `len` elements is divided among `parts` ranks.
///
/// The rule is the balanced one of `torch.tensor_split` and `numpy.array_split`: the
/// first `len % parts` ranks get one element more than the others, so parts differ by at
/// most one and every part is non-empty whenever `len >= parts`.
///
/// Why not the "ceil chunks, short last one" rule of `compute_split_shapes` (10 over 4 →
/// `[3, 3, 3, 1]`)? It can leave the last rank nearly idle (13 over 4 → `[4, 4, 4, 1]`),
/// and for lengths like 9 over 4 it would give an empty last part (`[3, 3, 3, 0]`) unless
/// patched with a second rule. The balanced rule has the same largest part,
/// `ceil(len / parts)`, the largest smallest part, and one formula for every case.
///
/// `len < parts` is an error, because some rank would get nothing; mappings that take
/// explicit per-rank sizes accept empty parts.
///
/// ```
/// use ferrotron_mappings::split_sizes;
///
/// assert_eq!(split_sizes(10, 4)?, vec![3, 3, 2, 2]);
/// assert_eq!(split_sizes(9, 4)?, vec![3, 2, 2, 2]);
/// assert_eq!(split_sizes(8, 4)?, vec![2, 2, 2, 2]);
/// assert!(split_sizes(3, 4).is_err());
/// # Ok::<(), ferrotron_mappings::Error>(())
/// ```
pub fn split_sizes(len: usize, parts: usize) -> Result<Vec<usize>> {
    split_sizes_for("split_sizes", len, parts)
}

pub(crate) fn split_sizes_for(op: &'static str, len: usize, parts: usize) -> Result<Vec<usize>> {
    if parts == 0 || len < parts {
        return Err(Error::TooShortToSplit { op, len, parts });
    }
    let (base, longer) = (len / parts, len % parts);
    Ok((0..parts).map(|p| base + usize::from(p < longer)).collect())
}

/// Where each part starts: the exclusive prefix sums of `sizes`.
pub(crate) fn offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |start, &size| {
            let here = *start;
            *start += size;
            Some(here)
        })
        .collect()
}

/// A row-major tensor seen around one dimension as `[outer, len, inner]`, where `outer`
/// is the product of the dimensions before it and `inner` of those after it.
///
/// A part along the dimension is `outer` strided runs, not one contiguous block, except
/// along the first dimension; collectives move contiguous per-rank blocks, so parts are
/// packed into blocks before sending and unpacked after receiving.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DimLayout {
    outer: usize,
    inner: usize,
}

impl DimLayout {
    /// The layout of `shape` around `dim`.
    pub(crate) fn new(op: &'static str, shape: &[usize], dim: usize) -> Result<DimLayout> {
        if dim >= shape.len() {
            return Err(Error::DimOutOfRange {
                op,
                dim,
                shape: shape.to_vec(),
            });
        }
        Ok(DimLayout {
            outer: shape[..dim].iter().product(),
            inner: shape[dim + 1..].iter().product(),
        })
    }

    /// Elements in each rank's block when ranks hold `sizes` along the dimension.
    pub(crate) fn counts(&self, sizes: &[usize]) -> Vec<usize> {
        sizes.iter().map(|s| self.outer * s * self.inner).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_rule() {
        assert_eq!(split_sizes(10, 4).ok(), Some(vec![3, 3, 2, 2]));
        assert_eq!(split_sizes(4, 4).ok(), Some(vec![1; 4]));
        assert_eq!(split_sizes(7, 1).ok(), Some(vec![7]));
        assert!(matches!(
            split_sizes(0, 1),
            Err(Error::TooShortToSplit {
                len: 0,
                parts: 1,
                ..
            })
        ));
        assert!(split_sizes(5, 0).is_err());
    }
}
