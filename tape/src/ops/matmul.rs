//! Matrix products: 2-D, batched 3-D, and a 3-D batch times a shared 2-D matrix.
//! Transposed operands are free: [`Tensor::transpose`] is a strided view and the GEMM
//! (ndarray's matrixmultiply) reads any strides. Large CPU products are split over the
//! calling thread's [`num_threads`](crate::num_threads).

use half::{bf16, f16};
use ndarray::linalg::general_mat_mul;
use std::sync::Arc;

use ndarray::{Array2, Array3, ArrayD, ArrayView2, ArrayView3, ArrayViewMut2, Axis, Ix2, Ix3};

use super::{device_grads, on_device};
use crate::gpu::ops::{self as device_ops, Operand};
use crate::gpu::GpuArray;
use crate::precision::{promoted, Half, HalfFloat, Packed};
use crate::tape::{record, record_tensor};
use crate::threads::{num_threads, run_pieces};
use crate::{DType, Element, Error, Result, Tensor};

const OP: &str = "matmul";

impl<T: Element> Tensor<T> {
    /// Matrix product. Shapes: `[m,k]·[k,n] → [m,n]`, `[b,m,k]·[b,k,n] → [b,m,n]`, and
    /// `[b,m,k]·[k,n] → [b,m,n]` (the matrix is shared across the batch).
    pub fn matmul(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        if let Some(out) = self.matmul_16_bit(other, false, None)? {
            return Ok(out);
        }
        if let Some(arrays) = on_device(OP, [self, other])? {
            return self.matmul_on_device(other, arrays, false, None);
        }
        let a = self.cpu(OP)?;
        let b = other.cpu(OP)?;
        let bad = |reason: &str| Error::shape(OP, &[a.shape(), b.shape()], reason);
        let (k_a, k_b) = match (a.ndim(), b.ndim()) {
            (2 | 3, 2 | 3) => (a.shape()[a.ndim() - 1], b.shape()[b.ndim() - 2]),
            _ => return Err(bad("operands must be 2-D or 3-D")),
        };
        if k_a != k_b {
            return Err(bad("inner dimensions differ"));
        }
        let out = match (a.ndim(), b.ndim()) {
            (2, 2) => product(&view2(a.view())?, &view2(b.view())?).into_dyn(),
            (3, 2) => batch_times_matrix(view3(a.view())?, view2(b.view())?).into_dyn(),
            (3, 3) if a.shape()[0] == b.shape()[0] => {
                batched(view3(a.view())?, view3(b.view())?).into_dyn()
            }
            (3, 3) => return Err(bad("batch sizes differ")),
            _ => {
                return Err(bad(
                    "a 2-D matrix times a 3-D batch is not supported; transpose the product",
                ))
            }
        };
        record(OP, &[self, other], out.into_shared(), || {
            // The operands as stored (a 16-bit one widened again in backward).
            let (a, b) = (self.detach(), other.detach());
            let rounding = gradient_format(self, other);
            Box::new(move |grad: ArrayD<T>, needs: &[bool]| {
                let grad = match rounding {
                    Some(format) => Half::narrow_cpu(OP, format, &grad)?.widen_cpu(OP)?,
                    None => grad.into_shared(),
                };
                let (a, b) = (a.cpu(OP)?, b.cpu(OP)?);
                let (a, b) = (a.view(), b.view());
                let (grad_a, grad_b) = match (a.ndim(), b.ndim()) {
                    (2, 2) => {
                        let (a, b, g) = (view2(a)?, view2(b)?, view2(grad.view())?);
                        (
                            needs[0].then(|| product(&g, &b.t()).into_dyn()),
                            needs[1].then(|| product(&a.t(), &g).into_dyn()),
                        )
                    }
                    (3, 2) => {
                        let (a, b, g) = (view3(a)?, view2(b)?, view3(grad.view())?);
                        (
                            needs[0].then(|| batch_times_matrix(g, b.t()).into_dyn()),
                            needs[1].then(|| batch_transpose_times_batch(a, g).into_dyn()),
                        )
                    }
                    _ => {
                        let (a, b, g) = (view3(a)?, view3(b)?, view3(grad.view())?);
                        (
                            needs[0].then(|| batched(g, swap_last(b)).into_dyn()),
                            needs[1].then(|| batched(swap_last(a), g).into_dyn()),
                        )
                    }
                };
                Ok(vec![grad_a, grad_b])
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// `self · otherᵀ`, `other`'s last two dimensions swapped: `[m,k]·[n,k]ᵀ → [m,n]`,
    /// `[b,m,k]·[n,k]ᵀ → [b,m,n]` and `[b,m,k]·[b,n,k]ᵀ → [b,m,n]`. This is a linear
    /// layer's `x·Wᵀ` with `W: [out, in]` (PyTorch's `F.linear`) and attention's `q·kᵀ`.
    /// It equals `self.matmul(&other.transpose(..)?)`, but on a device, whose arrays are
    /// always contiguous and where a transpose is a copy, the GEMM reads `other` as
    /// stored, forward and backward.
    pub fn matmul_transposed(&self, other: &Tensor<T>) -> Result<Tensor<T>> {
        const OP: &str = "matmul_transposed";
        let ndim = other.ndim();
        if ndim < 2 {
            return Err(Error::shape(
                OP,
                &[self.shape(), other.shape()],
                "the transposed operand must be 2-D or 3-D",
            ));
        }
        if let Some(out) = self.matmul_16_bit(other, true, None)? {
            return Ok(out);
        }
        match on_device(OP, [self, other])? {
            Some(arrays) => self.matmul_on_device(other, arrays, true, None),
            // A CPU transpose is a strided view, which the GEMM reads in place.
            None => self.matmul(&other.transpose(ndim - 2, ndim - 1)?),
        }
    }

    /// [`matmul_transposed`](Self::matmul_transposed) of two device tensors whose
    /// backward hands `self`'s gradient to `hook` as soon as it is queued, then queues
    /// `other`'s, then takes `self`'s gradient from what `hook` returned: a linear
    /// layer's input gradient all-reduced over the tensor-parallel group while the weight
    /// gradient's GEMM runs (Megatron's asynchronous tensor-parallel all-reduce). The
    /// values are those of `matmul_transposed` with `hook` applied to the gradient;
    /// [`Error::UnsupportedDevice`] on the CPU, where nothing would overlap.
    pub fn matmul_transposed_overlapped(
        &self,
        other: &Tensor<T>,
        hook: Arc<dyn InputGradHook<T>>,
    ) -> Result<Tensor<T>> {
        if other.ndim() < 2 {
            return Err(Error::shape(
                OP,
                &[self.shape(), other.shape()],
                "the transposed operand must be 2-D or 3-D",
            ));
        }
        if let Some(out) = self.matmul_16_bit(other, true, Some(&hook))? {
            return Ok(out);
        }
        match on_device(OP, [self, other])? {
            Some(arrays) => self.matmul_on_device(other, arrays, true, Some(&hook)),
            None => Err(Error::UnsupportedDevice {
                op: "matmul_transposed_overlapped",
                device: self.device(),
            }),
        }
    }
}

/// What a product's backward does with its first operand's gradient before it queues the
/// second's ([`Tensor::matmul_transposed_overlapped`]).
pub trait InputGradHook<T: Element>: Send + Sync {
    /// Starts work on `grad` (a non-blocking collective, say) and returns what finishes
    /// it, called once the second operand's gradient is queued; its result is the first
    /// operand's gradient, of `grad`'s shape.
    fn start(&self, grad: Tensor<T>) -> Result<PendingGrad<T>>;
}

/// The rest of an [`InputGradHook`]'s work.
pub type PendingGrad<T> = Box<dyn FnOnce() -> Result<Tensor<T>> + Send>;

fn view2<T: Element>(view: ndarray::ArrayViewD<'_, T>) -> Result<ArrayView2<'_, T>> {
    let shape = view.shape().to_vec();
    view.into_dimensionality::<Ix2>()
        .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))
}

fn view3<T: Element>(view: ndarray::ArrayViewD<'_, T>) -> Result<ArrayView3<'_, T>> {
    let shape = view.shape().to_vec();
    view.into_dimensionality::<Ix3>()
        .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))
}

fn swap_last<T>(view: ArrayView3<'_, T>) -> ArrayView3<'_, T> {
    view.permuted_axes([0, 2, 1])
}

/// Below this many multiply-adds per thread a product stays on the calling thread: a
/// helper thread costs tens of microseconds to start, 2²¹ multiply-adds about as long.
const MIN_WORK_PER_THREAD: usize = 1 << 21;

/// How many threads a product of `work` multiply-adds uses.
fn threads_for(work: usize) -> usize {
    num_threads().min(work / MIN_WORK_PER_THREAD).max(1)
}

/// `a·b` as a new matrix.
fn product<T: Element>(a: &ArrayView2<'_, T>, b: &ArrayView2<'_, T>) -> Array2<T> {
    let threads = threads_for(a.nrows() * a.ncols() * b.ncols());
    if threads == 1 {
        return a.dot(b);
    }
    let mut c = Array2::zeros((a.nrows(), b.ncols()));
    product_into(a, b, T::zero(), c.view_mut(), threads);
    c
}

/// `c ← a·b + beta·c` on `threads` threads, each taking a band of c's rows (or columns,
/// when c is wider than tall). Bands are multiples of 8 rows or columns, the GEMM kernel's
/// tile edge, so every element is computed exactly as on one thread.
fn product_into<T: Element>(
    a: &ArrayView2<'_, T>,
    b: &ArrayView2<'_, T>,
    beta: T,
    mut c: ArrayViewMut2<'_, T>,
    threads: usize,
) {
    if threads <= 1 {
        general_mat_mul(T::one(), a, b, beta, &mut c);
        return;
    }
    let (m, n) = c.dim();
    let by_rows = m >= n;
    let band = m.max(n).div_ceil(threads).next_multiple_of(8);
    let pieces: Vec<_> = if by_rows {
        let bands = a.axis_chunks_iter(Axis(0), band);
        (bands.zip(c.axis_chunks_iter_mut(Axis(0), band)))
            .map(|(a, c)| (a, b.view(), c))
            .collect()
    } else {
        let bands = b.axis_chunks_iter(Axis(1), band);
        (bands.zip(c.axis_chunks_iter_mut(Axis(1), band)))
            .map(|(b, c)| (a.view(), b, c))
            .collect()
    };
    run_pieces(pieces, |(a, b, mut c)| {
        general_mat_mul(T::one(), &a, &b, beta, &mut c)
    });
}

/// `[b,m,k]·[b,k,n]`, one GEMM per batch entry, the batch split over threads.
fn batched<T: Element>(a: ArrayView3<'_, T>, b: ArrayView3<'_, T>) -> Array3<T> {
    let (batch, m, k) = a.dim();
    let n = b.shape()[2];
    let mut out = Array3::zeros((batch, m, n));
    let threads = threads_for(batch * m * k * n).min(batch).max(1);
    let per_thread = batch.div_ceil(threads).max(1);
    let chunks = (a.axis_chunks_iter(Axis(0), per_thread))
        .zip(b.axis_chunks_iter(Axis(0), per_thread))
        .zip(out.axis_chunks_iter_mut(Axis(0), per_thread));
    run_pieces(chunks.collect(), |((a, b), mut out)| {
        for ((a, b), mut c) in a.outer_iter().zip(b.outer_iter()).zip(out.outer_iter_mut()) {
            general_mat_mul(T::one(), &a, &b, T::zero(), &mut c);
        }
    });
    out
}

/// `[b,m,k]·[k,n]`: a single GEMM over `b·m` rows when the batch is contiguous.
fn batch_times_matrix<T: Element>(a: ArrayView3<'_, T>, b: ArrayView2<'_, T>) -> Array3<T> {
    let (batch, m, k) = a.dim();
    let n = b.shape()[1];
    if let Ok(rows) = a.into_shape_with_order((batch * m, k)) {
        if let Ok(out) = product(&rows, &b).into_shape_with_order((batch, m, n)) {
            return out;
        }
    }
    let mut out = Array3::zeros((batch, m, n));
    let threads = threads_for(m * k * n);
    for (a, c) in a.outer_iter().zip(out.outer_iter_mut()) {
        product_into(&a, &b, T::zero(), c, threads);
    }
    out
}

/// `Σ_i a_iᵀ·g_i` for `a: [b,m,k]`, `g: [b,m,n]`: the gradient of a matrix shared by a batch.
fn batch_transpose_times_batch<T: Element>(
    a: ArrayView3<'_, T>,
    g: ArrayView3<'_, T>,
) -> Array2<T> {
    let (batch, m, k) = a.dim();
    let n = g.shape()[2];
    if let (Ok(a2), Ok(g2)) = (
        a.into_shape_with_order((batch * m, k)),
        g.into_shape_with_order((batch * m, n)),
    ) {
        return product(&a2.t(), &g2);
    }
    let mut out = Array2::zeros((k, n));
    let threads = threads_for(m * k * n);
    for (a, g) in a.axis_iter(Axis(0)).zip(g.axis_iter(Axis(0))) {
        product_into(&a.t(), &g, T::one(), out.view_mut(), threads);
    }
    out
}

/// The format a product's incoming gradient is read in by its backward GEMMs: that of
/// two 16-bit operands of one format (the tape keeps the product's gradient so already).
/// Their device GEMMs read 16-bit operands and write each input's gradient in its
/// gradient format: 16-bit for an activation, f32 for a parameter (Megatron's fp32
/// main-grad GEMMs). The CPU rounds the same way, so every device computes the same
/// gradients.
fn gradient_format<T: Element>(a: &Tensor<T>, b: &Tensor<T>) -> Option<DType> {
    let format = promoted(&[a, b]);
    (T::DTYPE == DType::F32 && matches!(format, DType::BF16 | DType::F16)).then_some(format)
}

/// A device product `[batch, m, k]·[batch, k, n]`: its extents, whether B is stored
/// transposed (`[batch, n, k]`), and the elements between consecutive matrices of A, B
/// and the result (0 for one matrix, or a batch folded into rows).
struct Geometry {
    transposed_b: bool,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    stride_a: usize,
    stride_b: usize,
    stride_c: usize,
    out_shape: Vec<usize>,
}

impl Geometry {
    /// The product of `a` and `b` as stored (B transposed if `transposed_b`).
    fn of(sa: &[usize], stored_b: &[usize], transposed_b: bool) -> Result<Geometry> {
        let bad = |reason: &str| Error::shape(OP, &[sa, stored_b], reason);
        let mut sb = stored_b.to_vec();
        if transposed_b && sb.len() >= 2 {
            let last = sb.len() - 1;
            sb.swap(last - 1, last);
        }
        // [batch, m, k] · [k, n] is one [batch·m, k] · [k, n] product: fold the batch.
        let (batch, m, k, n) = match (sa.len(), sb.len()) {
            (2, 2) => (1, sa[0], sa[1], sb[1]),
            (3, 2) => (1, sa[0] * sa[1], sa[2], sb[1]),
            (3, 3) if sa[0] == sb[0] => (sa[0], sa[1], sa[2], sb[2]),
            (3, 3) => return Err(bad("batch sizes differ")),
            (2, 3) => {
                return Err(bad(
                    "a 2-D matrix times a 3-D batch is not supported; transpose the product",
                ))
            }
            _ => return Err(bad("operands must be 2-D or 3-D")),
        };
        if k != sb[sb.len() - 2] {
            return Err(bad("inner dimensions differ"));
        }
        let mut out_shape = sa[..sa.len() - 1].to_vec();
        out_shape.push(n);
        let (stride_a, stride_b, stride_c) = if batch > 1 {
            (m * k, k * n, m * n)
        } else {
            (0, 0, 0)
        };
        Ok(Geometry {
            transposed_b,
            batch,
            m,
            k,
            n,
            stride_a,
            stride_b,
            stride_c,
            out_shape,
        })
    }

    /// `dims` of the forward product `A·B`.
    fn dims(&self) -> [usize; 4] {
        [self.m, self.n, self.k, self.batch]
    }

    fn operands(&self, a: u64, b: u64) -> (Operand, Operand) {
        (
            operand(a, false, self.stride_a),
            operand(b, self.transposed_b, self.stride_b),
        )
    }

    /// `dA = G·Bᵀ` and `dB = Aᵀ·G` per batch entry (folded batches sum into dB), each by
    /// `gemm(shape, x, y, dims)` on the arrays at `a`, `b` and `g`. For B stored
    /// transposed as S, `dA = G·S` and `dS = Gᵀ·A`: no transpose is ever copied.
    fn backward<E>(
        &self,
        (a, shape_a): (u64, &[usize]),
        (b, shape_b): (u64, &[usize]),
        g: u64,
        needs: &[bool],
        gemm: impl Fn(usize, &[usize], Operand, Operand, [usize; 4]) -> Result<E>,
    ) -> Result<Vec<Option<E>>> {
        let Geometry { batch, m, k, n, .. } = *self;
        let stride_g = self.stride_c;
        let grad_a = needs[0]
            .then(|| {
                let b = operand(b, !self.transposed_b, self.stride_b);
                gemm(0, shape_a, operand(g, false, stride_g), b, [m, k, n, batch])
            })
            .transpose()?;
        let grad_b = needs[1]
            .then(|| match self.transposed_b {
                false => gemm(
                    1,
                    shape_b,
                    operand(a, true, self.stride_a),
                    operand(g, false, stride_g),
                    [k, n, m, batch],
                ),
                true => gemm(
                    1,
                    shape_b,
                    operand(g, true, stride_g),
                    operand(a, false, self.stride_a),
                    [n, k, m, batch],
                ),
            })
            .transpose()?;
        Ok(vec![grad_a, grad_b])
    }

    /// [`backward`](Self::backward) of two `H` operands on a device: GEMMs of 16-bit
    /// operands and the gradient in `H` (as the tape keeps it) into each input's
    /// gradient format, `formats`: `H` for an activation, f32 for a parameter (Megatron's
    /// fp32 main-grad GEMMs). `None` where the operands are not device storage of `H`.
    fn backward_16_bit<H: HalfFloat, T: Element>(
        &self,
        a: &Tensor<T>,
        b: &Tensor<T>,
        grad: &Tensor<T>,
        needs: &[bool],
        formats: [DType; 2],
    ) -> Result<Option<Vec<Option<Tensor<T>>>>> {
        let (Some(Packed::Gpu(x)), Some(Packed::Gpu(y))) =
            (a.half().and_then(H::packed), b.half().and_then(H::packed))
        else {
            return Ok(None);
        };
        let device = a.device();
        let stored = match grad.half().and_then(H::packed) {
            Some(_) => grad.clone(),
            None => grad.stored_as(OP, H::DTYPE)?,
        };
        let Some(Packed::Gpu(g)) = stored.half().and_then(H::packed) else {
            return Err(Error::UnsupportedDevice {
                op: OP,
                device: grad.device(),
            });
        };
        self.backward(
            (x.ptr(), a.shape()),
            (y.ptr(), b.shape()),
            g.ptr(),
            needs,
            // An empty inner dimension is zeros, which the widening product writes.
            |which, shape, x, y, dims| match formats[which] == H::DTYPE && dims[2] > 0 {
                true => device_ops::matmul_16_bit::<H>(device, shape, x, y, dims)
                    .map(|product| Tensor::from_half(H::into_half(Packed::Gpu(product)))),
                false => device_ops::matmul_16_bit_widening::<H, T>(device, shape, x, y, dims)
                    .map(Tensor::from_gpu),
            },
        )
        .map(Some)
    }
}

fn operand(ptr: u64, transposed: bool, batch_stride: usize) -> Operand {
    Operand {
        ptr,
        transposed,
        batch_stride,
        ld: None,
    }
}

impl<T: Element> Tensor<T> {
    /// The product of two 16-bit device tensors of one format on one device, read as
    /// stored (GemmEx with f32 accumulation, the result rounded once); `None` for any
    /// other pair, and for an empty inner dimension. `other` is read transposed if
    /// `transposed`.
    fn matmul_16_bit(
        &self,
        other: &Tensor<T>,
        transposed: bool,
        hook: Option<&Arc<dyn InputGradHook<T>>>,
    ) -> Result<Option<Tensor<T>>> {
        match (self.dtype(), other.dtype()) {
            (DType::BF16, DType::BF16) => self.matmul_stored::<bf16>(other, transposed, hook),
            (DType::F16, DType::F16) => self.matmul_stored::<f16>(other, transposed, hook),
            _ => Ok(None),
        }
    }

    fn matmul_stored<H: HalfFloat>(
        &self,
        other: &Tensor<T>,
        transposed: bool,
        hook: Option<&Arc<dyn InputGradHook<T>>>,
    ) -> Result<Option<Tensor<T>>> {
        let (Some(Packed::Gpu(a)), Some(Packed::Gpu(b))) = (
            self.half().and_then(H::packed),
            other.half().and_then(H::packed),
        ) else {
            return Ok(None);
        };
        if self.device() != other.device() || self.shape().last().is_none_or(|&k| k == 0) {
            return Ok(None);
        }
        let geometry = Geometry::of(self.shape(), other.shape(), transposed)?;
        let (x, y) = geometry.operands(a.ptr(), b.ptr());
        let product = device_ops::matmul_16_bit::<H>(
            self.device(),
            &geometry.out_shape,
            x,
            y,
            geometry.dims(),
        )?;
        let out = Tensor::from_half(H::into_half(Packed::Gpu(product)));
        self.record_device_product(other, geometry, out, hook)
            .map(Some)
    }

    fn matmul_on_device(
        &self,
        other: &Tensor<T>,
        [a, b]: [GpuArray<T>; 2],
        transposed: bool,
        hook: Option<&Arc<dyn InputGradHook<T>>>,
    ) -> Result<Tensor<T>> {
        let geometry = Geometry::of(self.shape(), other.shape(), transposed)?;
        let (x, y) = geometry.operands(a.ptr(), b.ptr());
        let product =
            device_ops::matmul(self.device(), &geometry.out_shape, x, y, geometry.dims())?;
        self.record_device_product(other, geometry, Tensor::from_gpu(product), hook)
    }

    fn record_device_product(
        &self,
        other: &Tensor<T>,
        geometry: Geometry,
        out: Tensor<T>,
        hook: Option<&Arc<dyn InputGradHook<T>>>,
    ) -> Result<Tensor<T>> {
        let formats = [self.grad_format(), other.grad_format()];
        let hook = hook.cloned();
        record_tensor(OP, &[self, other], out, || {
            let (a, b) = (self.detach(), other.detach());
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                let grads =
                    |needs: &[bool]| device_product_grads(&a, &b, &grad, needs, &geometry, formats);
                match (&hook, needs) {
                    // Each gradient's GEMMs alone give the same values as both at once;
                    // the incoming gradient is rounded to the operands' format once.
                    (Some(hook), [true, second]) => {
                        let grad = match gradient_format(&a, &b) {
                            Some(format) if grad.dtype() != format => grad.stored_as(OP, format)?,
                            _ => grad.clone(),
                        };
                        let grads = |needs: &[bool]| {
                            device_product_grads(&a, &b, &grad, needs, &geometry, formats)
                        };
                        let first = grads(&[true, false])?.swap_remove(0);
                        let first = first.ok_or_else(|| Error::custom(OP, "no input gradient"))?;
                        let pending = hook.start(first)?;
                        let second = match second {
                            true => grads(&[false, true])?.pop().flatten(),
                            false => None,
                        };
                        Ok(vec![Some(pending()?), second])
                    }
                    _ => grads(needs),
                }
            })
        })
    }
}

/// The gradients of a device product `a·b` (or `a·bᵀ`, by `geometry`) that `needs` asks
/// for, given the product's gradient `grad`: 16-bit GEMMs into `formats` for 16-bit
/// operands, else in `T`.
fn device_product_grads<T: Element>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    grad: &Tensor<T>,
    needs: &[bool],
    geometry: &Geometry,
    formats: [DType; 2],
) -> Result<Vec<Option<Tensor<T>>>> {
    let device = a.device();
    let rounded = match gradient_format(a, b) {
        Some(DType::BF16) => geometry.backward_16_bit::<bf16, T>(a, b, grad, needs, formats)?,
        Some(_) => geometry.backward_16_bit::<f16, T>(a, b, grad, needs, formats)?,
        None => None,
    };
    if let Some(grads) = rounded {
        return Ok(grads);
    }
    let (x, y) = (a.device_array(OP, device)?, b.device_array(OP, device)?);
    let g = grad.device_array(OP, device)?;
    let grads = geometry.backward(
        (x.ptr(), a.shape()),
        (y.ptr(), b.shape()),
        g.ptr(),
        needs,
        |_, shape, x, y, dims| device_ops::matmul(device, shape, x, y, dims),
    )?;
    Ok(device_grads(grads))
}
