//! Device math of the row ops (softmax, log_softmax, layer_norm, cross_entropy): each
//! works on a tensor viewed as `[rows, width]` over its last dimension, with the kernels
//! of `kernels/rows.cu` (whose argument slots are restated at each caller).

use super::ops::{sum_dim, sum_parts, unary, PointwiseInput, PointwiseWrite, UnaryKind};
use super::{moves, GpuArray, Kernel, KernelArgs, Precision, Stored};
use crate::{Element, Result};
use ferrotron_device::Grid;

block_kernels! {
    ROW_KERNELS:
    SOFTMAX_ROWS = "softmax_rows": softmax_rows_f32, softmax_rows_f64;
    SOFTMAX_ROWS_BACKWARD = "softmax_rows_backward":
        softmax_rows_backward_f32, softmax_rows_backward_f64;
    LAYER_NORM_ROWS = "layer_norm_rows": layer_norm_rows_f32, layer_norm_rows_f64;
    LAYER_NORM_ROWS_BACKWARD = "layer_norm_rows_backward":
        layer_norm_rows_backward_f32, layer_norm_rows_backward_f64;
    CROSS_ENTROPY_ROWS = "cross_entropy_rows": cross_entropy_rows_f32, cross_entropy_rows_f64;
    CROSS_ENTROPY_ROWS_BACKWARD = "cross_entropy_rows_backward":
        cross_entropy_rows_backward_f32, cross_entropy_rows_backward_f64;
}

kernels! {
    COLUMN_KERNELS:
    LAYER_NORM_AFFINE_BACKWARD = "layer_norm_affine_backward":
        layer_norm_affine_backward_f32, layer_norm_affine_backward_f64;
}

/// Warps per block of the row kernels, each warp a row at a time.
const ROW_WARPS: usize = 4;

/// The row kernels' grid for `rows` rows: a warp per row, in blocks of [`ROW_WARPS`]
/// (at most 65,535 blocks, whose warps then take several rows each).
fn row_grid(rows: usize) -> Grid {
    Grid {
        blocks: rows.div_ceil(ROW_WARPS).clamp(1, 65_535) as u32,
        threads: (32 * ROW_WARPS) as u32,
    }
}

/// Launches the row kernel `kernel`'s build for `T` (written through `out`) over `rows`
/// rows, unless there are none.
fn launch_rows<T: Element, E: Copy + Default>(
    out: &GpuArray<E>,
    kernel: &Kernel,
    rows: usize,
    args: &KernelArgs,
    cost: super::Cost,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    out.launch_grid(kernel, Precision::of::<T>(), row_grid(rows), args, cost)
}

/// `(rows, width)` of `shape` viewed over its last dimension; no rows when the width is 0
/// (as on the CPU), which also keeps the kernels from reading an empty row.
fn rows_of(shape: &[usize]) -> (usize, usize) {
    let width = shape.last().copied().unwrap_or(1);
    let len: usize = shape.iter().product();
    (len.checked_div(width).unwrap_or(0), width)
}

/// Which normalisation `softmax_rows` computes, as numbered in `rows.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SoftmaxKind {
    Softmax = 0,
    LogSoftmax = 1,
}

/// How `softmax_rows` normalises a row: which form, of `scale · x`, over the whole row or
/// (`causal`, square matrices) the columns up to the row's position in its matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SoftmaxRows {
    pub kind: SoftmaxKind,
    pub scale: f64,
    pub causal: bool,
}

impl SoftmaxRows {
    /// `kind` over whole rows of `x` itself.
    pub fn plain(kind: SoftmaxKind) -> Self {
        SoftmaxRows {
            kind,
            scale: 1.0,
            causal: false,
        }
    }

    fn args(&self, rows: usize, width: usize) -> KernelArgs {
        let mut args = KernelArgs::default();
        args.i[..4].copy_from_slice(&[
            rows as i64,
            width as i64,
            self.kind as i64,
            i64::from(self.causal),
        ]);
        args.f[0] = self.scale;
        args
    }
}

/// Softmax or log-softmax over the last dimension of `x`, in any storage format, into
/// `out` in any, computed in `T` (16-bit read as stored, the result rounded once).
pub(crate) fn softmax_stored<T: Element, O: Stored>(
    out: &GpuArray<O>,
    x: PointwiseInput<'_>,
    how: SoftmaxRows,
) -> Result<()> {
    let (rows, width) = rows_of(x.shape);
    // p0 out, p1 x; i0 rows, i1 width, i2 kind, i3 causal, i4/i5 formats; f0 scale.
    let mut args = how.args(rows, width);
    args.p[..2].copy_from_slice(&[out.ptr(), x.ptr]);
    args.i[4..6].copy_from_slice(&[x.format, O::FORMAT]);
    let cost = moves(x.bytes::<T>(), out.bytes());
    launch_rows::<T, O>(out, &SOFTMAX_ROWS, rows, &args, cost)
}

/// The gradient of `y = softmax(x)` (or log-softmax) from `y` and `grad` = d(loss)/dy,
/// both read as stored, as a kernel writing any storage format.
pub(crate) struct SoftmaxBackward<'a> {
    pub grad: PointwiseInput<'a>,
    pub y: PointwiseInput<'a>,
    pub how: SoftmaxRows,
}

impl PointwiseWrite for SoftmaxBackward<'_> {
    fn write<T: Element, O: Stored>(&self, dx: &GpuArray<O>) -> Result<()> {
        let (rows, width) = rows_of(self.y.shape);
        // p0 dx, p1 g, p2 y; i4 y's format, i5 g's, i6 dx's; the rest as in `softmax`.
        let mut args = self.how.args(rows, width);
        args.p[..3].copy_from_slice(&[dx.ptr(), self.grad.ptr, self.y.ptr]);
        args.i[4..7].copy_from_slice(&[self.y.format, self.grad.format, O::FORMAT]);
        let cost = moves(self.grad.bytes::<T>() + self.y.bytes::<T>(), dx.bytes());
        launch_rows::<T, O>(dx, &SOFTMAX_ROWS_BACKWARD, rows, &args, cost)
    }
}

/// What the layer-norm backward reuses from the forward: the input as stored and each
/// row's mean and reciprocal standard deviation (`[rows]`).
#[derive(Clone, Copy)]
pub(crate) struct LayerNormSaved<'a, T> {
    pub x: PointwiseInput<'a>,
    pub mean: &'a GpuArray<T>,
    pub rstd: &'a GpuArray<T>,
}

/// Layer norm over the last dimension of `x` with optional `weight` and `bias`, each in
/// any storage format, into `out` in any, computed in `T` (16-bit read as stored, the
/// result rounded once); each row's mean and 1/√(var + eps) into `mean` and `rstd`.
pub(crate) fn layer_norm_stored<T: Element, O: Stored>(
    out: &GpuArray<O>,
    (x, weight, bias): LayerNormInputs<'_>,
    (mean, rstd): (&GpuArray<T>, &GpuArray<T>),
    eps: f64,
) -> Result<()> {
    let (rows, width) = rows_of(x.shape);
    // p0 out, p1 x, p2 weight (0: none), p3 bias (0: none), p4 mean, p5 rstd;
    // i0 rows, i1 width, i2..i5 formats of x, weight, bias, out; f0 eps.
    let mut args = KernelArgs::default();
    args.p[..6].copy_from_slice(&[
        out.ptr(),
        x.ptr,
        weight.map_or(0, |w| w.ptr),
        bias.map_or(0, |b| b.ptr),
        mean.ptr(),
        rstd.ptr(),
    ]);
    args.i[..6].copy_from_slice(&[
        rows as i64,
        width as i64,
        x.format,
        weight.map_or(0, |w| w.format),
        bias.map_or(0, |b| b.format),
        O::FORMAT,
    ]);
    args.f[0] = eps;
    let affine = [weight, bias]
        .iter()
        .flatten()
        .map(|p| p.bytes::<T>())
        .sum::<usize>();
    let cost = moves(
        x.bytes::<T>() + affine,
        out.bytes() + mean.bytes() + rstd.bytes(),
    );
    launch_rows::<T, O>(out, &LAYER_NORM_ROWS, rows, &args, cost)
}

/// Layer norm's input, weight and bias as its kernel reads them.
pub(crate) type LayerNormInputs<'a> = (
    PointwiseInput<'a>,
    Option<PointwiseInput<'a>>,
    Option<PointwiseInput<'a>>,
);

/// The gradient of layer norm with respect to its input, given `grad` = d(loss)/d(out),
/// reading it, the input and `weight` as stored, as a kernel writing any storage format.
pub(crate) struct LayerNormInputGrad<'a, T> {
    pub grad: PointwiseInput<'a>,
    pub saved: LayerNormSaved<'a, T>,
    pub weight: Option<PointwiseInput<'a>>,
}

impl<E: Element> PointwiseWrite for LayerNormInputGrad<'_, E> {
    // Computed in the statistics' type `E`, the tensor's element type `written` passes.
    fn write<T: Element, O: Stored>(&self, dx: &GpuArray<O>) -> Result<()> {
        let (saved, weight) = (self.saved, self.weight);
        let (rows, width) = rows_of(saved.x.shape);
        // p0 dx, p1 g, p2 x, p3 weight (0: none), p4 mean, p5 rstd; i0 rows, i1 width,
        // i2 x's format, i3 weight's, i4 g's, i5 dx's.
        let mut args = KernelArgs::default();
        args.p[..6].copy_from_slice(&[
            dx.ptr(),
            self.grad.ptr,
            saved.x.ptr,
            weight.map_or(0, |w| w.ptr),
            saved.mean.ptr(),
            saved.rstd.ptr(),
        ]);
        args.i[..6].copy_from_slice(&[
            rows as i64,
            width as i64,
            saved.x.format,
            weight.map_or(0, |w| w.format),
            self.grad.format,
            O::FORMAT,
        ]);
        let stats = saved.mean.bytes() + saved.rstd.bytes();
        let inputs = self.grad.bytes::<E>() + saved.x.bytes::<E>();
        let read = inputs + weight.map_or(0, |w| w.bytes::<E>()) + stats;
        launch_rows::<E, O>(
            dx,
            &LAYER_NORM_ROWS_BACKWARD,
            rows,
            &args,
            moves(read, dx.bytes()),
        )
    }
}

/// The gradients of layer norm's weight and bias, in that order.
pub(crate) type AffineGrads<T> = (Option<GpuArray<T>>, Option<GpuArray<T>>);

/// The gradients of layer norm's weight and bias (`[width]`), each only when asked for.
pub(crate) fn layer_norm_affine_grads<T: Element>(
    grad: PointwiseInput<'_>,
    saved: LayerNormSaved<'_, T>,
    need_weight: bool,
    need_bias: bool,
) -> Result<AffineGrads<T>> {
    let op = "layer_norm backward";
    let (rows, width) = rows_of(saved.x.shape);
    let wanted = usize::from(need_weight) + usize::from(need_bias);
    if wanted == 0 {
        return Ok((None, None));
    }
    // Each part sums a run of rows into partial sums side by side, [wanted, parts,
    // width], which one `sum_dim` then sums over the parts (see `sum_parts`).
    let parts = sum_parts(width, rows);
    let partials = GpuArray::<T>::uninit(op, saved.mean.device(), &[wanted, parts, width])?;
    let second = partials.ptr() + (parts * width * std::mem::size_of::<T>()) as u64;
    let (dweight, dbias) = match (need_weight, need_bias) {
        (true, true) => (partials.ptr(), second),
        (true, false) => (partials.ptr(), 0),
        _ => (0, partials.ptr()),
    };
    // p0 dweight (0: not needed), p1 dbias (0: not needed), p2 g, p3 x, p4 mean, p5 rstd;
    // i0 width, i1 rows, i2 parts, i3 x's format, i4 g's.
    let mut args = KernelArgs::default();
    args.p[..6].copy_from_slice(&[
        dweight,
        dbias,
        grad.ptr,
        saved.x.ptr,
        saved.mean.ptr(),
        saved.rstd.ptr(),
    ]);
    args.i[..5].copy_from_slice(&[
        width as i64,
        rows as i64,
        parts as i64,
        saved.x.format,
        grad.format,
    ]);
    let stats = saved.mean.bytes() + saved.rstd.bytes();
    let cost = moves(
        grad.bytes::<T>() + saved.x.bytes::<T>() + stats,
        partials.bytes(),
    );
    partials.launch(&LAYER_NORM_AFFINE_BACKWARD, parts * width, &args, cost)?;
    let totals = sum_dim(&partials, 1, 1.0)?;
    let total = |k: usize| Some(totals.window(k * width, &[width]));
    Ok(match (need_weight, need_bias) {
        (true, true) => (total(0), total(1)),
        (true, false) => (total(0), None),
        _ => (None, total(0)),
    })
}

/// The targets of a cross-entropy: one label per row (validated on the host), the
/// ignored label and the label smoothing.
#[derive(Clone)]
pub(crate) struct Targets {
    pub labels: GpuArray<i64>,
    pub ignore_index: Option<i64>,
    pub smoothing: f64,
    /// The classes smoothing spreads over when the logits are one shard of them (0: the
    /// logits' own width).
    pub all_classes: usize,
}

impl Targets {
    /// Fills slots i2 (whether a label is ignored), i3 (which) and f0 (smoothing), shared
    /// by both cross-entropy kernels.
    fn fill(&self, args: &mut KernelArgs) {
        args.i[2] = i64::from(self.ignore_index.is_some());
        args.i[3] = self.ignore_index.unwrap_or(0);
        args.f[0] = self.smoothing;
        args.f[2] = self.all_classes as f64;
    }

    /// `(rows, classes)` of `logits`: one row per label, even when there are no classes
    /// (then every label is ignored and every loss is 0).
    fn rows_of(&self, logits: PointwiseInput<'_>) -> (usize, usize) {
        (self.labels.len(), logits.shape.last().copied().unwrap_or(1))
    }
}

/// Per-row cross-entropy losses of `logits` on `device` (`[rows]`, 0 for ignored rows;
/// 16-bit logits read as stored, the losses in `T`), and each row's log-sum-exp for the
/// backward.
pub(crate) fn cross_entropy<T: Element>(
    device: crate::Device,
    logits: PointwiseInput<'_>,
    targets: &Targets,
) -> Result<(GpuArray<T>, GpuArray<T>)> {
    let op = "cross_entropy";
    let (rows, classes) = targets.rows_of(logits);
    let loss = GpuArray::<T>::uninit(op, device, &[rows])?;
    let lse = GpuArray::<T>::uninit(op, device, &[rows])?;
    // p0 loss, p1 lse, p2 logits, p3 labels; i0 rows, i1 classes, i2 has ignore,
    // i3 ignored label, i4 the logits' format; f0 smoothing.
    let mut args = KernelArgs::default();
    args.p[..4].copy_from_slice(&[loss.ptr(), lse.ptr(), logits.ptr, targets.labels.ptr()]);
    args.i[..2].copy_from_slice(&[rows as i64, classes as i64]);
    targets.fill(&mut args);
    args.i[4] = logits.format;
    let cost = moves(
        logits.bytes::<T>() + targets.labels.bytes(),
        loss.bytes() + lse.bytes(),
    );
    launch_rows::<T, T>(&loss, &CROSS_ENTROPY_ROWS, rows, &args, cost)?;
    Ok((loss, lse))
}

/// `Σ losses` as a 0-d array, or their mean over `mean_over` rows (the rows not ignored,
/// which may be fewer than the losses).
pub(crate) fn sum_losses<T: Element>(
    losses: &GpuArray<T>,
    mean_over: Option<usize>,
) -> Result<GpuArray<T>> {
    let total = sum_dim(losses, 0, 1.0)?;
    match mean_over {
        None => Ok(total),
        Some(count) => unary(UnaryKind::Scale, &total, 1.0 / count as f64),
    }
}

/// The gradient of the cross-entropy with respect to `logits`, as a kernel writing any
/// storage format. `upstream` is d(loss)/d of each row's loss (`per_row`) or of their
/// sum, divided by `divisor` (the counted rows of a mean, else 1).
pub(crate) struct CrossEntropyBackward<'a, T> {
    pub upstream: &'a GpuArray<T>,
    pub per_row: bool,
    pub divisor: f64,
    /// The logits as stored.
    pub logits: PointwiseInput<'a>,
    pub lse: &'a GpuArray<T>,
    pub targets: &'a Targets,
}

impl<E: Element> PointwiseWrite for CrossEntropyBackward<'_, E> {
    fn write<T: Element, O: Stored>(&self, dx: &GpuArray<O>) -> Result<()> {
        let Self {
            upstream,
            per_row,
            divisor,
            logits,
            lse,
            targets,
        } = *self;
        cross_entropy_backward_into(dx, upstream, per_row, divisor, (logits, lse), targets)
    }
}

fn cross_entropy_backward_into<T: Element, O: Stored>(
    dx: &GpuArray<O>,
    upstream: &GpuArray<T>,
    per_row: bool,
    divisor: f64,
    (logits, lse): (PointwiseInput<'_>, &GpuArray<T>),
    targets: &Targets,
) -> Result<()> {
    let (rows, classes) = targets.rows_of(logits);
    // p0 dx, p1 logits, p2 lse, p3 labels, p4 upstream; i0 rows, i1 classes, i2 has
    // ignore, i3 ignored label, i4 per row, i5 dx's format, i6 the logits'; f0
    // smoothing, f1 divisor.
    let mut args = KernelArgs::default();
    args.p[..5].copy_from_slice(&[
        dx.ptr(),
        logits.ptr,
        lse.ptr(),
        targets.labels.ptr(),
        upstream.ptr(),
    ]);
    args.i[..2].copy_from_slice(&[rows as i64, classes as i64]);
    targets.fill(&mut args);
    args.i[4] = i64::from(per_row);
    args.i[5..7].copy_from_slice(&[O::FORMAT, logits.format]);
    args.f[1] = divisor;
    let upstream_bytes = if per_row { upstream.bytes() } else { 0 };
    let read = logits.bytes::<T>() + lse.bytes() + targets.labels.bytes() + upstream_bytes;
    let cost = moves(read, dx.bytes());
    launch_rows::<T, O>(dx, &CROSS_ENTROPY_ROWS_BACKWARD, rows, &args, cost)
}
