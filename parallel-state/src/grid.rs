//! The arithmetic behind Megatron's `generate_masked_orthogonal_rank_groups`, one rank
//! or one group at a time.
//!
//! Ranks form a mixed-radix number whose digits are the axis coordinates, the first axis
//! of the order being the least significant. A *family* of groups keeps some axes (the
//! mask) free and fixes the others: the fixed digits, read as a mixed-radix number of
//! their own, are the group's index; the free digits are the rank's position inside it.

use crate::order::Axis;

/// Sizes and strides of the axes of one rank generator, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grid {
    dims: Vec<Dim>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dim {
    axis: Axis,
    size: usize,
    stride: usize,
}

impl Grid {
    /// `axes` lists every axis once, fastest first; the caller has checked that the
    /// sizes multiply to the world size without overflow.
    pub(crate) fn new(axes: &[Axis], size_of: impl Fn(Axis) -> usize) -> Grid {
        let mut stride = 1;
        let dims = axes
            .iter()
            .map(|&axis| {
                let dim = Dim {
                    axis,
                    size: size_of(axis),
                    stride,
                };
                stride *= dim.size;
                dim
            })
            .collect();
        Grid { dims }
    }

    pub(crate) fn size(&self, axis: Axis) -> usize {
        self.dim(axis).map_or(1, |d| d.size)
    }

    pub(crate) fn stride(&self, axis: Axis) -> usize {
        self.dim(axis).map_or(0, |d| d.stride)
    }

    /// Coordinate of `local` (a rank relative to the layout's offset) along `axis`.
    pub(crate) fn coordinate(&self, local: usize, axis: Axis) -> usize {
        self.dim(axis).map_or(0, |d| (local / d.stride) % d.size)
    }

    /// The family of groups spanned by `free` axes.
    pub(crate) fn family(&self, free: &[Axis]) -> Family {
        let (masked, unmasked) = self.dims.iter().partition(|d| free.contains(&d.axis));
        Family { masked, unmasked }
    }

    fn dim(&self, axis: Axis) -> Option<&Dim> {
        self.dims.iter().find(|d| d.axis == axis)
    }
}

/// All groups along some free axes; see the module docs.
#[derive(Clone, Debug)]
pub(crate) struct Family {
    masked: Vec<Dim>,
    unmasked: Vec<Dim>,
}

impl Family {
    pub(crate) fn group_size(&self) -> usize {
        self.masked.iter().map(|d| d.size).product()
    }

    pub(crate) fn group_count(&self) -> usize {
        self.unmasked.iter().map(|d| d.size).product()
    }

    /// Which group `local` is in, and its position there: O(number of axes).
    pub(crate) fn locate(&self, local: usize) -> (usize, usize) {
        (
            digits_of(&self.unmasked, local),
            digits_of(&self.masked, local),
        )
    }

    /// Local ranks of group `index` (< `group_count()`), in Megatron's order, which is
    /// ascending: O(group size).
    pub(crate) fn group(&self, index: usize) -> Vec<usize> {
        let base = place(&self.unmasked, index);
        (0..self.group_size())
            .map(|position| base + place(&self.masked, position))
            .collect()
    }
}

/// The coordinates of `local` along `dims`, read as a mixed-radix number.
fn digits_of(dims: &[Dim], local: usize) -> usize {
    let mut value = 0;
    let mut radix = 1;
    for d in dims {
        value += (local / d.stride) % d.size * radix;
        radix *= d.size;
    }
    value
}

/// The inverse of [`digits_of`]: the rank offset of the mixed-radix number `value`.
fn place(dims: &[Dim], mut value: usize) -> usize {
    let mut offset = 0;
    for d in dims {
        offset += (value % d.size) * d.stride;
        value /= d.size;
    }
    offset
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example in Megatron's docstring for the masked generator: sizes
    /// [tp, dp, pp] = [2, 3, 4] and the dp mask give dp_group[0] = [0, 2, 4],
    /// dp_group[1] = [1, 3, 5] and dp_group[7] = [19, 21, 23].
    #[test]
    fn docstring_dp_groups() {
        let grid = Grid::new(&[Axis::Tp, Axis::Dp, Axis::Pp], |a| match a {
            Axis::Tp => 2,
            Axis::Dp => 3,
            _ => 4,
        });
        let dp = grid.family(&[Axis::Dp]);
        assert_eq!(dp.group_count(), 8);
        assert_eq!(dp.group(0), vec![0, 2, 4]);
        assert_eq!(dp.group(1), vec![1, 3, 5]);
        assert_eq!(dp.group(7), vec![19, 21, 23]);
        assert_eq!(dp.locate(21), (7, 1));
    }
}
