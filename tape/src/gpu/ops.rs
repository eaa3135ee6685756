//! The math of each op on device arrays, forward and backward; `crate::ops` dispatches
//! here for device tensors and records the backward on the tape.

use super::HalfFormat;
use super::{moves, stored_bytes, Cost, Gemm, GemmFormat, GpuArray, KernelArgs, Precision};
use super::{Stored, MAX_DIMS};
use crate::{Element, Error, Result};

/// Row-major (contiguous) strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// `shape` padded with leading 1s to `ndim` dimensions.
fn padded(shape: &[usize], ndim: usize) -> Vec<usize> {
    let mut out = vec![1; ndim - shape.len()];
    out.extend_from_slice(shape);
    out
}

/// A shape error for ranks the kernels' shape slots cannot describe.
pub(crate) fn check_rank(op: &'static str, shape: &[usize]) -> Result<()> {
    if shape.len() <= MAX_DIMS {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            &[shape],
            format!("device kernels handle at most {MAX_DIMS} dimensions"),
        ))
    }
}

/// Elementwise arithmetic, as numbered in `elementwise.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryKind {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
}

/// `a (op) b` on `device`, broadcast to `shape` (already checked compatible), in `T`;
/// the operands in any storage format (see [`binary_stored`]).
pub(crate) fn binary<T: Element>(
    op: &'static str,
    kind: BinaryKind,
    device: crate::Device,
    shape: &[usize],
    (a, b): (PointwiseInput<'_>, PointwiseInput<'_>),
) -> Result<GpuArray<T>> {
    let out = GpuArray::<T>::uninit(op, device, shape)?;
    binary_stored::<T, T>(op, kind, &out, a, b)?;
    Ok(out)
}

/// A device array as a pointwise kernel reads it: its address, shape and storage format
/// (see [`Stored`]).
#[derive(Clone, Copy)]
pub(crate) struct PointwiseInput<'a> {
    pub ptr: u64,
    pub shape: &'a [usize],
    pub format: i64,
}

impl PointwiseInput<'_> {
    /// Bytes of its elements as stored, read by a kernel computing in `T`.
    pub(crate) fn bytes<T>(&self) -> usize {
        stored_bytes::<T>(self.shape.iter().product(), self.format)
    }
}

impl<'a, E: Stored> From<&'a GpuArray<E>> for PointwiseInput<'a> {
    fn from(array: &'a GpuArray<E>) -> Self {
        PointwiseInput {
            ptr: array.ptr(),
            shape: array.shape(),
            format: E::FORMAT,
        }
    }
}

/// What a pointwise kernel writes into a fresh device array of any storage format (see
/// `crate::precision::written`).
pub(crate) trait PointwiseWrite {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()>;
}

/// `a (kind) b` as a pointwise kernel writing any storage format.
pub(crate) struct BinaryKernel<'a> {
    pub op: &'static str,
    pub kind: BinaryKind,
    pub a: PointwiseInput<'a>,
    pub b: PointwiseInput<'a>,
}

impl PointwiseWrite for BinaryKernel<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        binary_stored::<T, O>(self.op, self.kind, out, self.a, self.b)
    }
}

/// [`binary`] written into `out` (of the broadcast shape), which may be `a` itself: each
/// element is read before it is written.
pub(crate) fn binary_into<T: Element>(
    op: &'static str,
    kind: BinaryKind,
    out: &GpuArray<T>,
    a: &GpuArray<T>,
    b: &GpuArray<T>,
) -> Result<()> {
    binary_stored::<T, T>(op, kind, out, a.into(), b.into())
}

/// [`binary_into`] for operands and a result in any storage format, computed in `T`:
/// 16-bit operands are read as stored and the result rounded once as it is written.
pub(crate) fn binary_stored<T: Element, O: Stored>(
    op: &'static str,
    kind: BinaryKind,
    out: &GpuArray<O>,
    a: PointwiseInput<'_>,
    b: PointwiseInput<'_>,
) -> Result<()> {
    let shape = out.shape();
    check_rank(op, shape)?;
    let ndim = shape.len();
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), a.ptr, b.ptr]);
    args.i[0] = out.len() as i64;
    args.i[1] = kind as i64;
    args.i[2] = ndim as i64;
    for (slot, operand) in [(11, a.shape), (19, b.shape)] {
        let dims = padded(operand, ndim);
        let strides = contiguous_strides(&dims);
        for d in 0..ndim {
            args.i[3 + d] = shape[d] as i64;
            // Stride 0 repeats a broadcast dimension's single element.
            args.i[slot + d] = if dims[d] == 1 { 0 } else { strides[d] as i64 };
        }
    }
    args.i[27..30].copy_from_slice(&[a.format, b.format, O::FORMAT]);
    let cost = moves(a.bytes::<T>() + b.bytes::<T>(), out.bytes());
    out.launch_build(&super::BINARY, Precision::of::<T>(), out.len(), &args, cost)
}

/// Sums a broadcast gradient in any storage format (16-bit read as stored) down to an
/// operand's `shape`, in `T`. Adjacent summed dimensions are one reduction (a bias's
/// gradient over `[sequence, batch, hidden]` sums `[sequence·batch, hidden]` once), taken
/// from the last so the others' indices stay put; a gradient with nothing to sum is
/// widened.
pub(crate) fn sum_to_stored<T: Element>(
    device: crate::Device,
    grad: PointwiseInput<'_>,
    shape: &[usize],
) -> Result<GpuArray<T>> {
    let target = padded(shape, grad.shape.len());
    // (extent, summed) of each run of dimensions; a size-1 dimension joins any run.
    let mut runs: Vec<(usize, bool)> = Vec::new();
    for (&size, &kept) in grad.shape.iter().zip(&target) {
        let summed = kept == 1 && size != 1;
        match runs.last_mut() {
            Some((extent, was)) if *was == summed || size == 1 || *extent == 1 => {
                if size != 1 {
                    *was = summed;
                }
                *extent *= size;
            }
            _ => runs.push((size, summed)),
        }
    }
    let extents: Vec<usize> = runs.iter().map(|&(extent, _)| extent).collect();
    let mut out: Option<GpuArray<T>> = None;
    for (d, &(_, summed)) in runs.iter().enumerate().rev() {
        if summed {
            let input = match &out {
                Some(partial) => partial.into(),
                None => PointwiseInput {
                    shape: &extents,
                    ..grad
                },
            };
            let mut kept = input.shape.to_vec();
            kept[d] = 1;
            out = Some(sum_dim_stored(device, input, d, 1.0)?.reshaped(&kept));
        }
    }
    match out {
        Some(out) => Ok(out.reshaped(shape)),
        None => {
            let out = GpuArray::<T>::uninit("sum_to", device, shape)?;
            let input = PointwiseInput { shape, ..grad };
            unary_stored::<T, T>(UnaryKind::Scale, &out, input, None, 1.0)?;
            Ok(out)
        }
    }
}

/// Pointwise functions, as numbered in `elementwise.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnaryKind {
    Scale = 0,
    Exp = 1,
    Log = 2,
    Tanh = 3,
    Relu = 4,
    GeluErf = 5,
    GeluTanh = 6,
}

/// `f(x)` elementwise (`factor` is used by `Scale`).
pub(crate) fn unary<T: Element>(
    kind: UnaryKind,
    x: &GpuArray<T>,
    factor: f64,
) -> Result<GpuArray<T>> {
    let out = GpuArray::<T>::uninit("unary", x.device(), x.shape())?;
    unary_stored::<T, T>(kind, &out, x.into(), None, factor)?;
    Ok(out)
}

/// A bias added along the last dimension of a unary function's input, the sum rounded
/// to `sum_format` as `add` would store it (`unary_input` in elementwise.cu): `f(x + b)`
/// in one kernel with the numbers of two.
#[derive(Clone, Copy)]
pub(crate) struct AddedBias<'a> {
    pub bias: PointwiseInput<'a>,
    pub sum_format: i64,
}

impl AddedBias<'_> {
    /// Sets the bias's slots; the bytes the kernel reads of it.
    fn set<T>(bias: Option<&Self>, args: &mut KernelArgs) -> usize {
        let Some(added) = bias else { return 0 };
        args.p[3] = added.bias.ptr;
        let len = added.bias.shape.iter().product::<usize>() as i64;
        args.i[4..7].copy_from_slice(&[added.bias.format, len, added.sum_format]);
        added.bias.bytes::<T>()
    }
}

/// [`unary`] of `x` (plus `bias`) in any storage format into `out` in any, computed in
/// `T` (see [`binary_stored`]).
pub(crate) fn unary_stored<T: Element, O: Stored>(
    kind: UnaryKind,
    out: &GpuArray<O>,
    x: PointwiseInput<'_>,
    bias: Option<&AddedBias<'_>>,
    factor: f64,
) -> Result<()> {
    let mut args = KernelArgs::default();
    args.p[..2].copy_from_slice(&[out.ptr(), x.ptr]);
    args.i[..4].copy_from_slice(&[out.len() as i64, kind as i64, x.format, O::FORMAT]);
    args.f[0] = factor;
    let read_bias = AddedBias::set::<T>(bias, &mut args);
    let cost = moves(x.bytes::<T>() + read_bias, out.bytes());
    out.launch_build(&super::UNARY, Precision::of::<T>(), out.len(), &args, cost)
}

/// The gradient of `y = f(x)` given `grad` = d(loss)/dy, as a kernel reading `grad` as
/// stored and writing any storage format.
///
/// `kept` is what the derivative reads, in any storage format: the output for exp and
/// tanh, the input for the others (unread by a scale), to which `bias` is added.
pub(crate) struct UnaryBackward<'a> {
    pub kind: UnaryKind,
    pub grad: PointwiseInput<'a>,
    pub kept: PointwiseInput<'a>,
    pub bias: Option<AddedBias<'a>>,
    pub factor: f64,
}

impl PointwiseWrite for UnaryBackward<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        let (kind, grad, kept) = (self.kind, self.grad, self.kept);
        let mut args = KernelArgs::default();
        args.p[..3].copy_from_slice(&[out.ptr(), grad.ptr, kept.ptr]);
        args.i[..3].copy_from_slice(&[out.len() as i64, kind as i64, kept.format]);
        args.i[7..9].copy_from_slice(&[grad.format, O::FORMAT]);
        args.f[0] = self.factor;
        let read_bias = AddedBias::set::<T>(self.bias.as_ref(), &mut args);
        let read_kept = if kind == UnaryKind::Scale {
            0
        } else {
            kept.bytes::<T>() + read_bias
        };
        let cost = moves(grad.bytes::<T>() + read_kept, out.bytes());
        out.launch_build(
            &super::UNARY_BACKWARD,
            Precision::of::<T>(),
            out.len(),
            &args,
            cost,
        )
    }
}

/// `(outer, dim, inner)` extents of `shape` around dimension `dim`.
pub(crate) fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

/// Into how many runs to split a summed dimension of `extent` elements when `outputs`
/// sums are wanted: one thread per output leaves the device idle when there are few
/// outputs (a full sum has one), so each output's run is shared by enough threads to fill
/// it, and the partial sums are summed again. 1 means no split.
pub(crate) fn sum_parts(outputs: usize, extent: usize) -> usize {
    const THREADS: usize = 1 << 16;
    const MIN_RUN: usize = 32;
    if outputs >= THREADS || extent < 2 * MIN_RUN {
        1
    } else {
        (THREADS / outputs.max(1)).min(extent / MIN_RUN)
    }
}

/// Launches `reduce_dim` over `x` (in any storage format) viewed as `[outer, extent,
/// inner]` into `[outer, parts, inner]` in `T` (`kind`: 0 sum, 2 max, as in `reduce.cu`).
fn launch_reduce<T: Element>(
    device: crate::Device,
    x: PointwiseInput<'_>,
    (outer, extent, inner): (usize, usize, usize),
    parts: usize,
    kind: i64,
    scale: f64,
    argmax: Option<&GpuArray<i64>>,
) -> Result<GpuArray<T>> {
    let out = GpuArray::<T>::uninit("reduce", device, &[outer, parts, inner])?;
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), x.ptr, argmax.map_or(0, GpuArray::ptr)]);
    args.i[..6].copy_from_slice(&[
        outer as i64,
        extent as i64,
        inner as i64,
        kind,
        parts as i64,
        x.format,
    ]);
    args.f[0] = scale;
    let written = out.bytes() + argmax.map_or(0, GpuArray::bytes);
    let cost = moves(x.bytes::<T>(), written);
    out.launch(&super::REDUCE_DIM, outer * parts * inner, &args, cost)?;
    Ok(out)
}

/// `scale ·` the sum over dimension `dim`, which is removed (the caller reshapes for
/// `keepdim`).
pub(crate) fn sum_dim<T: Element>(x: &GpuArray<T>, dim: usize, scale: f64) -> Result<GpuArray<T>> {
    sum_dim_stored(x.device(), x.into(), dim, scale)
}

/// [`sum_dim`] of `x` on `device` in any storage format (16-bit read as stored), summed
/// in `T`.
pub(crate) fn sum_dim_stored<T: Element>(
    device: crate::Device,
    x: PointwiseInput<'_>,
    dim: usize,
    scale: f64,
) -> Result<GpuArray<T>> {
    let mut shape = x.shape.to_vec();
    shape.remove(dim);
    let (outer, mut extent, inner) = around(x.shape, dim);
    let mut partial: Option<GpuArray<T>> = None;
    loop {
        let parts = sum_parts(outer * inner, extent);
        let last = parts == 1;
        let factor = if last { scale } else { 1.0 };
        let input = partial.as_ref().map_or(x, PointwiseInput::from);
        let summed = launch_reduce(
            device,
            input,
            (outer, extent, inner),
            parts,
            0,
            factor,
            None,
        )?;
        if last {
            return Ok(summed.reshaped(&shape));
        }
        partial = Some(summed);
        extent = parts;
    }
}

/// The maximum over dimension `dim` of `x` (16-bit storage read as stored), which is
/// removed, and the index of each maximum (the first of equals), for the backward.
pub(crate) fn max_dim<T: Element>(
    device: crate::Device,
    x: PointwiseInput<'_>,
    dim: usize,
) -> Result<(GpuArray<T>, GpuArray<i64>)> {
    let mut shape = x.shape.to_vec();
    shape.remove(dim);
    let argmax = GpuArray::<i64>::uninit("reduce", device, &shape)?;
    let out = launch_reduce(device, x, around(x.shape, dim), 1, 2, 1.0, Some(&argmax))?;
    Ok((out.reshaped(&shape), argmax))
}

/// Gradient of a reduction over `dim` of an input of `shape`: `grad` (without the
/// dimension) spread back, times `scale` (1 for sum, 1/n for mean), or routed to each
/// maximum when `argmax` is given.
pub(crate) fn reduce_dim_backward<T: Element>(
    grad: &GpuArray<T>,
    shape: &[usize],
    dim: usize,
    scale: f64,
    argmax: Option<&GpuArray<i64>>,
) -> Result<GpuArray<T>> {
    let op = "reduce backward";
    let (outer, extent, inner) = around(shape, dim);
    let out = GpuArray::<T>::uninit(op, grad.device(), shape)?;
    let mut args = KernelArgs::default();
    args.p[..3].copy_from_slice(&[out.ptr(), grad.ptr(), argmax.map_or(0, |a| a.ptr())]);
    args.i[..3].copy_from_slice(&[outer, extent, inner].map(|v| v as i64));
    args.f[0] = scale;
    let kernel = if argmax.is_some() {
        &super::MAX_BACKWARD
    } else {
        &super::EXPAND_DIM
    };
    let cost = moves(
        grad.bytes() + argmax.map_or(0, GpuArray::bytes),
        out.bytes(),
    );
    out.launch(kernel, out.len(), &args, cost)?;
    Ok(out)
}

/// A row-major product operand: its device address and whether the op reads it
/// transposed (its stored shape is then `[cols, rows]` of the logical matrix).
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: u64,
    pub transposed: bool,
    /// Elements between consecutive matrices of a batch (0: shared by the batch).
    pub batch_stride: usize,
    /// Elements between consecutive stored rows, where not the stored row's length (a
    /// matrix inside a wider array, read in place).
    pub ld: Option<usize>,
}

/// Where a product's row-major result goes inside `out`: `offset` elements in, rows
/// `ld` elements apart, consecutive matrices `batch_stride` apart.
#[derive(Clone, Copy)]
pub(crate) struct Destination {
    pub offset: usize,
    pub ld: usize,
    pub batch_stride: usize,
}

/// `op(a)[m,k] · op(b)[k,n]` for each of `batch` row-major matrices (`dims` is
/// `[m, n, k, batch]`), into a new array of `shape`, through the column-major GEMM: a
/// row-major matrix is its transpose in column-major order, so `C = A·B` is computed as
/// `Cᵀ = Bᵀ·Aᵀ` without moving data.
pub(crate) fn matmul<T: Element>(
    device: crate::Device,
    shape: &[usize],
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<GpuArray<T>> {
    product_in::<T>(device, shape, GemmFormat::of::<T>(), a, b, dims)
}

/// [`matmul`] with A and B in `format`'s types and the result in `T`, where an empty
/// inner dimension makes zeros.
fn product_in<T: Element>(
    device: crate::Device,
    shape: &[usize],
    format: GemmFormat,
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<GpuArray<T>> {
    let out = GpuArray::<T>::uninit("matmul", device, shape)?;
    if dims[2] == 0 {
        // An empty sum: cuBLAS may leave C untouched, so write the zeros ourselves.
        out.fill(T::zero())?;
        return Ok(out);
    }
    product_into(out, format, a, b, dims)
}

/// [`matmul`] of two 16-bit matrices of one format, accumulated in f32 and rounded once
/// into a 16-bit result (cuBLAS's GemmEx with f32 compute): no widened copy of either
/// operand. Needs `k > 0`.
pub(crate) fn matmul_16_bit<H: HalfFormat>(
    device: crate::Device,
    shape: &[usize],
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<GpuArray<H>> {
    let format = match H::KIND {
        0 => GemmFormat::Bf16,
        _ => GemmFormat::F16,
    };
    product_into(
        GpuArray::<H>::uninit("matmul", device, shape)?,
        format,
        a,
        b,
        dims,
    )
}

/// [`matmul`] of two 16-bit matrices of one format into an unrounded f32 result (GemmEx
/// with an f32 C). `T` must be f32: cuBLAS writes no other type from 16-bit operands.
pub(crate) fn matmul_16_bit_widening<H: HalfFormat, T: Element>(
    device: crate::Device,
    shape: &[usize],
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<GpuArray<T>> {
    if T::DTYPE != ferrotron_comm_core::DType::F32 {
        return Err(Error::invalid(
            "matmul",
            format!(
                "a product of 16-bit matrices is written in f32, not {}",
                T::DTYPE
            ),
        ));
    }
    let format = match H::KIND {
        0 => GemmFormat::Bf16IntoF32,
        _ => GemmFormat::F16IntoF32,
    };
    product_in::<T>(device, shape, format, a, b, dims)
}

/// Runs the GEMM writing `op(a)·op(b)` into `out` (row-major, elements in `format`).
fn product_into<E: Copy + Default>(
    out: GpuArray<E>,
    format: GemmFormat,
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<GpuArray<E>> {
    let [m, n, ..] = dims;
    let whole = Destination {
        offset: 0,
        ld: n,
        batch_stride: m * n,
    };
    if out.len() > 0 {
        gemm_into((out.device(), out.ptr()), whole, format, a, b, dims)?;
    }
    Ok(out)
}

/// Runs the GEMM writing `op(a)·op(b)` (`dims` `[m, n, k, batch]`, k ≥ 1) into `to` of
/// the array at `out` (device, address), whose elements are in `format`'s result type.
pub(crate) fn gemm_into(
    (device, out): (crate::Device, u64),
    to: Destination,
    format: GemmFormat,
    a: Operand,
    b: Operand,
    dims: [usize; 4],
) -> Result<()> {
    let (operand, result) = format.bytes();
    let address = out + (to.offset * result) as u64;
    let mut gemm = row_major_gemm(format, address, a, b, dims);
    (gemm.ldc, gemm.stride_c) = (to.ld, to.batch_stride);
    let [m, n, k, batch] = dims;
    let cost = Cost {
        read: (operand * (m * k + k * n) * batch) as u64,
        written: (result * m * n * batch) as u64,
        flops: (2 * m * n * k * batch) as u64,
    };
    let backend = super::backend("matmul", device)?;
    let on_device = Error::on_device("matmul", device);
    let span = ferrotron_device::profile::begin(backend.stream()).map_err(&on_device)?;
    // The emulated device's modelled timeline times the product by its cost.
    ferrotron_device::timeline::charge_kernel(cost.read + cost.written, cost.flops);
    // SAFETY: the extents follow from the operands' checked shapes.
    let done = unsafe { backend.gemm(&gemm) };
    ferrotron_device::timeline::clear_charge();
    done?;
    if let Some(span) = span {
        (span.end(backend.stream(), "gemm", format.name(), cost)).map_err(&on_device)?;
    }
    Ok(())
}

/// The column-major GEMM writing the row-major product `op(a)·op(b)` into `out`.
fn row_major_gemm(
    format: GemmFormat,
    out: u64,
    a: Operand,
    b: Operand,
    [m, n, k, batch]: [usize; 4],
) -> Gemm {
    Gemm {
        format,
        transpose_a: b.transposed,
        transpose_b: a.transposed,
        m: n,
        n: m,
        k,
        alpha: 1.0,
        a: b.ptr,
        lda: b.ld.unwrap_or(if b.transposed { k } else { n }),
        stride_a: b.batch_stride,
        b: a.ptr,
        ldb: a.ld.unwrap_or(if a.transposed { m } else { k }),
        stride_b: a.batch_stride,
        beta: 0.0,
        c: out,
        ldc: n,
        stride_c: m * n,
        batch,
    }
}
