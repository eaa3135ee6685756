//! Device math of the shape and index ops (transpose, permute, narrow, concat, embedding,
//! masked_fill, dropout). Device arrays are contiguous, so the shape ops copy: a strided
//! gather reads a view of an array (permute, narrow) and a strided scatter writes into a
//! view of one (concat, narrow's gradient).

use super::ops::{check_rank, contiguous_strides, PointwiseInput};
use super::{moves, GpuArray, Kernel, KernelArgs, Precision, Stored};
use crate::{Element, Error, Result};

kernels! {
    SHAPE_KERNELS:
    GATHER_STRIDED = "gather_strided": gather_strided_f32, gather_strided_f64;
    SCATTER_STRIDED = "scatter_strided": scatter_strided_f32, scatter_strided_f64;
    NARROW_BACKWARD = "narrow_backward": narrow_backward_f32, narrow_backward_f64;
    EMBEDDING = "embedding": embedding_f32, embedding_f64;
    EMBEDDING_BACKWARD = "embedding_backward": embedding_backward_f32, embedding_backward_f64;
    MASKED_FILL = "masked_fill": masked_fill_f32, masked_fill_f64;
    DROPOUT = "dropout": dropout_f32, dropout_f64;
    BIAS_DROPOUT_ADD = "bias_dropout_add": bias_dropout_add_f32, bias_dropout_add_f64;
}

/// The slots `gather_strided` and `scatter_strided` share (see `shape.cu`): p0 out, p1 x;
/// i0 elements iterated, i1 ndim, i2 the view's offset, i[3..11) the iterated `shape`,
/// i[11..19) the view's `strides`, i19 the format of `E`. The caller has checked the
/// rank.
fn strided_args<E: Stored>(
    out: u64,
    x: u64,
    shape: &[usize],
    offset: usize,
    strides: &[usize],
) -> KernelArgs {
    let mut args = KernelArgs::default();
    args.i[19] = E::FORMAT;
    args.p[..2].copy_from_slice(&[out, x]);
    args.i[0] = shape.iter().product::<usize>() as i64;
    args.i[1] = shape.len() as i64;
    args.i[2] = offset as i64;
    for (d, (&size, &stride)) in shape.iter().zip(strides).enumerate() {
        args.i[3 + d] = size as i64;
        args.i[11 + d] = stride as i64;
    }
    args
}

/// A new array of `shape` read from the view of `x` starting at `offset` with `strides`.
fn gather<E: Stored>(
    op: &'static str,
    x: &GpuArray<E>,
    shape: &[usize],
    offset: usize,
    strides: &[usize],
) -> Result<GpuArray<E>> {
    check_rank(op, shape)?;
    let out = GpuArray::<E>::uninit(op, x.device(), shape)?;
    let args = strided_args::<E>(out.ptr(), x.ptr(), shape, offset, strides);
    let cost = moves(out.bytes(), out.bytes());
    out.launch_build(&GATHER_STRIDED, E::build(), out.len(), &args, cost)?;
    Ok(out)
}

/// Writes `x` into the view of `out` (of `x`'s shape) starting at `offset` with `strides`.
fn scatter_into<E: Stored>(
    op: &'static str,
    out: &GpuArray<E>,
    x: &GpuArray<E>,
    offset: usize,
    strides: &[usize],
) -> Result<()> {
    check_rank(op, x.shape())?;
    let args = strided_args::<E>(out.ptr(), x.ptr(), x.shape(), offset, strides);
    let cost = moves(x.bytes(), x.bytes());
    out.launch_build(&SCATTER_STRIDED, E::build(), x.len(), &args, cost)
}

/// `x` with its dimensions reordered (`order`, already checked to be a permutation):
/// output dimension `i` is input dimension `order[i]`.
pub(crate) fn permute<E: Stored>(
    op: &'static str,
    x: &GpuArray<E>,
    order: &[usize],
) -> Result<GpuArray<E>> {
    let strides = contiguous_strides(x.shape());
    let shape: Vec<usize> = order.iter().map(|&d| x.shape()[d]).collect();
    let strides: Vec<usize> = order.iter().map(|&d| strides[d]).collect();
    gather(op, x, &shape, 0, &strides)
}

/// Elements `start..start + len` of `x` along `dim` (already checked in range).
pub(crate) fn narrow<E: Stored>(
    op: &'static str,
    x: &GpuArray<E>,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<GpuArray<E>> {
    let strides = contiguous_strides(x.shape());
    let mut shape = x.shape().to_vec();
    shape[dim] = len;
    gather(op, x, &shape, start * strides[dim], &strides)
}

/// Gradient of `narrow` for an input of `shape`: `grad` (read as stored) placed at
/// `start` along `dim`, zeros elsewhere, in one kernel that writes each element once, in
/// any storage format.
pub(crate) struct NarrowBackward<'a> {
    pub grad: PointwiseInput<'a>,
    pub dim: usize,
    pub start: usize,
}

impl super::ops::PointwiseWrite for NarrowBackward<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        let (_, extent, inner) = super::ops::around(out.shape(), self.dim);
        let len = self.grad.shape[self.dim];
        let mut args = KernelArgs::default();
        args.p[..2].copy_from_slice(&[out.ptr(), self.grad.ptr]);
        let extents = [out.len(), inner, extent, self.start, len];
        args.i[..5].copy_from_slice(&extents.map(|v| v as i64));
        args.i[5..7].copy_from_slice(&[self.grad.format, O::FORMAT]);
        let cost = moves(self.grad.bytes::<T>(), out.bytes());
        out.launch_build(
            &NARROW_BACKWARD,
            Precision::of::<T>(),
            out.len(),
            &args,
            cost,
        )
    }
}

/// `parts` joined along `dim`; their other dimensions (already checked) agree.
pub(crate) fn concat<E: Stored>(
    op: &'static str,
    parts: &[&GpuArray<E>],
    dim: usize,
) -> Result<GpuArray<E>> {
    let Some(first) = parts.first() else {
        return Err(Error::invalid(op, "needs at least one tensor"));
    };
    let mut shape = first.shape().to_vec();
    shape[dim] = parts.iter().map(|part| part.shape()[dim]).sum();
    check_rank(op, &shape)?;
    // Uninitialised is enough: the parts' sizes along `dim` add up, so they cover it.
    let out = GpuArray::<E>::uninit(op, first.device(), &shape)?;
    let strides = contiguous_strides(&shape);
    let mut start = 0;
    for part in parts {
        scatter_into(op, &out, part, start * strides[dim], &strides)?;
        start += part.shape()[dim];
    }
    Ok(out)
}

/// Rows of `table` `[vocab, hidden]` picked by `ids` (checked in range by the caller),
/// laid out as `shape` (the ids' shape, then `hidden`), in the table's format.
pub(crate) fn embedding<E: Stored>(
    table: &GpuArray<E>,
    ids: &GpuArray<i64>,
    shape: &[usize],
) -> Result<GpuArray<E>> {
    let out = GpuArray::<E>::uninit("embedding", table.device(), shape)?;
    // Slots of `embedding` (index.cu): p0 out, p1 table, p2 ids; i0 rows, i1 hidden, i2
    // the format of `E`.
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), table.ptr(), ids.ptr()]);
    args.i[..3].copy_from_slice(&[ids.len() as i64, table.shape()[1] as i64, E::FORMAT]);
    let cost = moves(out.bytes() + ids.bytes(), out.bytes());
    out.launch_build(&EMBEDDING, E::build(), out.len(), &args, cost)?;
    Ok(out)
}

/// Gradient of `embedding` for a table of `table_shape`: each row of `grad` (read as
/// stored) added into the row of its id (repeated ids accumulate), in `T`.
pub(crate) fn embedding_backward<T: Element>(
    device: crate::Device,
    grad: PointwiseInput<'_>,
    ids: &GpuArray<i64>,
    table_shape: &[usize],
) -> Result<GpuArray<T>> {
    let table_grad = GpuArray::full("embedding backward", device, table_shape, T::zero())?;
    // Slots of `embedding_backward` (index.cu): p0 table_grad, p1 grad, p2 ids; i0 rows,
    // i1 hidden, i2 grad's format.
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[table_grad.ptr(), grad.ptr, ids.ptr()]);
    args.i[..3].copy_from_slice(&[ids.len() as i64, table_shape[1] as i64, grad.format]);
    // Each row of `grad` is added into its id's row: read, and a table row read and
    // written, once.
    let rows = grad.shape.iter().product::<usize>() * std::mem::size_of::<T>();
    let cost = moves(grad.bytes::<T>() + rows + ids.bytes(), rows);
    let items = grad.shape.iter().product();
    table_grad.launch(&EMBEDDING_BACKWARD, items, &args, cost)?;
    Ok(table_grad)
}

/// `x` with `value` where `mask` (1 = fill, broadcast to `x`'s shape) is set, `x` in any
/// storage format and `out` in any, computed in `T` (see `ops::binary_stored`).
pub(crate) fn masked_fill_stored<T: Element, O: Stored>(
    out: &GpuArray<O>,
    x: PointwiseInput<'_>,
    mask: &GpuArray<u8>,
    value: f64,
) -> Result<()> {
    let op = "masked_fill";
    check_rank(op, x.shape)?;
    let ndim = x.shape.len();
    let mut dims = vec![1; ndim - mask.ndim()];
    dims.extend_from_slice(mask.shape());
    let strides = contiguous_strides(&dims);
    // Slots of `masked_fill` (index.cu): p0 out, p1 x, p2 mask; i0 n, i1 ndim, i[2..10)
    // x's shape, i[10..18) the mask's strides, i18 x's format, i19 out's; f0 value.
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), x.ptr, mask.ptr()]);
    args.i[0] = out.len() as i64;
    args.i[1] = ndim as i64;
    for d in 0..ndim {
        args.i[2 + d] = x.shape[d] as i64;
        args.i[10 + d] = if dims[d] == 1 { 0 } else { strides[d] as i64 };
    }
    args.i[18..20].copy_from_slice(&[x.format, O::FORMAT]);
    args.f[0] = value;
    let cost = moves(x.bytes::<T>() + mask.bytes(), out.bytes());
    out.launch_build(&MASKED_FILL, Precision::of::<T>(), out.len(), &args, cost)
}

/// `x` times `scale` where `keep` (of `x`'s shape) is set and times 0 elsewhere (also
/// the gradient of dropout), `x` in any storage format into `out` in any, computed in
/// `T`.
pub(crate) fn dropout_stored<T: Element, O: Stored>(
    out: &GpuArray<O>,
    x: PointwiseInput<'_>,
    keep: &GpuArray<u8>,
    scale: f64,
) -> Result<()> {
    // Slots of `dropout` (index.cu): p0 out, p1 x, p2 keep; i0 n, i1 x's format, i2
    // out's; f0 scale.
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), x.ptr, keep.ptr()]);
    args.i[..3].copy_from_slice(&[out.len() as i64, x.format, O::FORMAT]);
    args.f[0] = scale;
    let cost = moves(x.bytes::<T>() + keep.bytes(), out.bytes());
    out.launch_build(&DROPOUT, Precision::of::<T>(), out.len(), &args, cost)
}

/// `residual + dropout(x + bias)` into `out` (`bias_dropout_add` in index.cu): `bias`
/// with the format `x + bias` is rounded to, `keep` with dropout's scale and the format
/// of the dropped branch; every array in any storage format, computed in `T`.
pub(crate) fn bias_dropout_add_stored<T: Element, O: Stored>(
    out: &GpuArray<O>,
    x: PointwiseInput<'_>,
    bias: Option<(PointwiseInput<'_>, i64)>,
    keep: Option<(&GpuArray<u8>, f64, i64)>,
    residual: PointwiseInput<'_>,
) -> Result<()> {
    let mut args = KernelArgs::default();
    args.p[..5].copy_from_slice(&[
        out.ptr(),
        x.ptr,
        bias.map_or(0, |(b, _)| b.ptr),
        residual.ptr,
        keep.map_or(0, |(k, _, _)| k.ptr()),
    ]);
    let width = bias.map_or(1, |(b, _)| b.shape.iter().product::<usize>());
    args.i[..8].copy_from_slice(&[
        out.len() as i64,
        width as i64,
        x.format,
        bias.map_or(0, |(b, _)| b.format),
        residual.format,
        O::FORMAT,
        bias.map_or(0, |(_, f)| f),
        keep.map_or(0, |(_, _, f)| f),
    ]);
    args.f[0] = keep.map_or(1.0, |(_, scale, _)| scale);
    let read = x.bytes::<T>()
        + residual.bytes::<T>()
        + bias.map_or(0, |(b, _)| b.bytes::<T>())
        + keep.map_or(0, |(k, _, _)| k.bytes());
    let cost = moves(read, out.bytes());
    out.launch_build(
        &BIAS_DROPOUT_ADD,
        Precision::of::<T>(),
        out.len(),
        &args,
        cost,
    )
}
