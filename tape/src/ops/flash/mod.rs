//! Fused attention: FlashAttention-2's scheme on every device. The forward visits the
//! keys a tile at a time with an online softmax and keeps only the output and each
//! query's log-sum-exp; the backward recomputes the probabilities from them, so no
//! `sequence²` tensor is ever held. Dropout's mask is a function of a seed and each
//! element's place, regenerated in backward. The CPU computes it tile by tile on the
//! calling thread's threads, a device with `kernels/attention.cu`.

use ndarray::{ArrayD, IxDyn};

mod cpu;

use super::packed::{product_output, Heads, OP};
use crate::gpu::attention_ops::{
    self as device, At, Flash, FlashDropout, FlashGeometry, Gradients, Operands, RowStrides,
};
use crate::gpu::GpuArray;
use crate::tape::record_tensor;
use crate::{Device, Element, Result, Tensor};
use cpu::{cpu_backward, cpu_forward, slice, Parts, RowData};

/// The fused op on packed `[s, b, groups, per_group + 2, d]` input (checked by the
/// caller), recorded with a backward that recomputes.
pub(super) fn attend<T: Element>(qkv: &Tensor<T>, heads: Heads, flash: Flash) -> Result<Tensor<T>> {
    let Heads { s, b, n, d, .. } = heads;
    let dtype = qkv.dtype();
    let (out, lse) = match qkv.device() {
        Device::Cpu => {
            let data = qkv.cpu(OP)?;
            let data = data.as_standard_layout();
            let x = packed_parts(slice(&data)?, &heads);
            let (out, lse) = cpu_forward(&flash, &x, &[s, b, n * d])?;
            (Tensor::from_array(out).stored_as(OP, dtype)?, Lse::Cpu(lse))
        }
        on => {
            let out = product_output::<T>(on, &[s, b, n * d], dtype)?;
            let lse = GpuArray::<T>::uninit(OP, on, &[b * n * s])?;
            let ops = packed_operands::<T>(&heads, at(qkv)?, at(&out)?);
            device::forward(&flash, &ops, &lse)?;
            (out, Lse::Device(lse))
        }
    };
    let grad_format = qkv.grad_format();
    let saved = Saved {
        qkv: qkv.detach(),
        out: out.detach(),
        lse,
        flash,
        heads,
        grad_format,
    };
    record_tensor(OP, &[qkv], out, || {
        Box::new(move |grad: Tensor<T>, _: &[bool]| Ok(vec![Some(saved.backward(&grad)?)]))
    })
}

/// The mask the fused kernel of [`Tensor::packed_attention`] applies for dropout `p`
/// after drawing `seed` (one `generator.next_u64()` per call): a `[batch · heads, sq,
/// sk]` tensor of factors, 0 where a probability is dropped and `1/(1 − p)` where it is
/// kept. Each element is a function of the seed and its place (SplitMix64 of
/// `seed + (index + 1) · 0x9E3779B97F4A7C15`, kept when its top 53 bits are at least
/// `⌈p · 2⁵³⌉`), which is how the backward regenerates the mask instead of keeping it,
/// and how another computation reproduces a fused run.
///
/// ```
/// use ferrotron_tape::{fused_attention_dropout_mask, Generator};
///
/// let seed = Generator::new(7).next_u64();
/// let mask = fused_attention_dropout_mask::<f64>(seed, 0.5, [1, 64, 64])?.to_vec()?;
/// assert!(mask.iter().all(|&m| m == 0.0 || m == 2.0));
/// let kept = mask.iter().filter(|&&m| m > 0.0).count();
/// assert!((1800..2300).contains(&kept), "about half of 4096 kept: {kept}");
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
pub fn fused_attention_dropout_mask<T: Element>(
    seed: u64,
    p: f64,
    shape: [usize; 3],
) -> Result<Tensor<T>> {
    let scale = super::index::dropout_scale::<T>(OP, p)?;
    let dropout = FlashDropout { seed, p };
    let factors = (0..shape.iter().product::<usize>())
        .map(|index| match (scale, dropout.keeps(index as u64)) {
            (None, _) => T::one(),
            (Some(scale), true) => T::from_f64(scale),
            (Some(_), false) => T::zero(),
        })
        .collect();
    Tensor::from_vec(factors, &shape)
}

/// One block of attention computed fused and not recorded, for attention assembled from
/// blocks (context parallelism's ring): the output and each query's log-sum-exp.
pub struct AttentionBlock<T: Element> {
    /// `softmax(q·kᵀ · scale)·v`, `[heads, sq, d]`, in `T`.
    pub out: Tensor<T>,
    /// `log Σ_j exp(q·k_j · scale)` of each query, `[heads, sq]`, in `T`.
    pub lse: Tensor<T>,
}

/// Fused attention of `[heads, sq, d]` queries over `[heads, sk, d]` keys and values
/// (any storage format, one device), causal or not (query `i` sees keys `j <= i`), as
/// [`Tensor::packed_attention`] computes it, without recording. Blocks over parts of the
/// keys combine by their log-sum-exps: the whole output is `Σ_b out_b · exp(lse_b − lse)`
/// with `lse = log Σ_b exp(lse_b)`. On a device, head dimensions above 64 (32 in f64)
/// are an error unless the tensor cores take them: check [`fused_attention_takes`] and
/// [`tensor_core_attention_takes`] first.
///
/// ```
/// use ferrotron_tape::{attention_block, Tensor};
///
/// // One query over two keys with equal scores: the mean of the values, and
/// // lse = log(e⁰ + e⁰).
/// let q = Tensor::<f64>::zeros(&[1, 1, 1]);
/// let v = Tensor::from_vec(vec![1.0, 3.0], &[1, 2, 1])?;
/// let block = attention_block(&q, &Tensor::zeros(&[1, 2, 1]), &v, 1.0, false)?;
/// assert_eq!(block.out.to_vec()?, [2.0]);
/// assert!((block.lse.to_vec()?[0] - 2f64.ln()).abs() < 1e-15);
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
pub fn attention_block<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
    causal: bool,
) -> Result<AttentionBlock<T>> {
    let flash = block_flash(q, k, v, scale, causal)?;
    let g = flash.geometry;
    let (heads, sq, d) = (g.heads, g.sq, g.d);
    match q.device() {
        Device::Cpu => {
            let [q, k, v] = [q, k, v].map(|t| t.cpu(OP));
            let (q, k, v) = (q?, k?, v?);
            let (q, k, v) = (
                q.as_standard_layout(),
                k.as_standard_layout(),
                v.as_standard_layout(),
            );
            let x = Parts {
                q: slice(&q)?,
                k: slice(&k)?,
                v: slice(&v)?,
            };
            let (out, lse) = cpu_forward(&flash, &x, &[heads, sq, d])?;
            Ok(AttentionBlock {
                out: Tensor::from_array(out),
                lse: Tensor::from_vec(lse, &[heads, sq])?,
            })
        }
        on => {
            let out = product_output::<T>(on, &[heads, sq, d], T::DTYPE)?;
            let lse = GpuArray::<T>::uninit(OP, on, &[heads, sq])?;
            if g.sq > 0 && heads > 0 {
                let ops = Operands {
                    q: at(q)?,
                    k: at(k)?,
                    v: at(v)?,
                    out: at(&out)?,
                };
                device::forward(&flash, &ops, &lse)?;
            }
            Ok(AttentionBlock {
                out,
                lse: Tensor::from_gpu(lse),
            })
        }
    }
}

/// The gradients of one [`attention_block`]'s queries, keys and values, given the
/// gradient `d_out` of the whole attention's output `out` and its log-sum-exp `lse`
/// (`[heads, sq, d]` and `[heads, sq]`): the block's share, so blocks over parts of the
/// keys sum to the whole attention's gradients. Each gradient in `T`.
#[allow(clippy::too_many_arguments)] // the block's inputs and what backward reads
pub fn attention_block_backward<T: Element>(
    (q, k, v): (&Tensor<T>, &Tensor<T>, &Tensor<T>),
    out: &Tensor<T>,
    d_out: &Tensor<T>,
    lse: &Tensor<T>,
    scale: f64,
    causal: bool,
) -> Result<[Tensor<T>; 3]> {
    let flash = block_flash(q, k, v, scale, causal)?;
    let g = flash.geometry;
    match q.device() {
        Device::Cpu => {
            let arrays = [q, k, v, out, d_out, lse].map(|t| t.cpu(OP));
            let [q, k, v, out, d_out, lse] = arrays;
            let (q, k, v, out, d_out, lse) = (q?, k?, v?, out?, d_out?, lse?);
            let [q, k, v, out, d_out, lse] =
                [&q, &k, &v, &out, &d_out, &lse].map(|a| a.as_standard_layout());
            let x = Parts {
                q: slice(&q)?,
                k: slice(&k)?,
                v: slice(&v)?,
            };
            let rows = RowData {
                out: slice(&out)?,
                d_out: slice(&d_out)?,
                lse: slice(&lse)?,
            };
            let mut grads = [g.sq, g.sk, g.sk].map(|n| vec![T::zero(); g.heads * n * g.d]);
            cpu_backward(&flash, &x, &rows, |t, z, i, values| {
                let at = g.row(t, z, i);
                grads[t][at..at + values.len()].copy_from_slice(values);
            })?;
            let [dq, dk, dv] = grads;
            Ok([
                Tensor::from_vec(dq, &[g.heads, g.sq, g.d])?,
                Tensor::from_vec(dk, &[g.heads, g.sk, g.d])?,
                Tensor::from_vec(dv, &[g.heads, g.sk, g.d])?,
            ])
        }
        on => {
            let shapes = [
                [g.heads, g.sq, g.d],
                [g.heads, g.sk, g.d],
                [g.heads, g.sk, g.d],
            ];
            if g.sq == 0 || g.sk == 0 || g.heads == 0 {
                // No query meets a key: every gradient is zero, as on the CPU (the kernel
                // would write none of them).
                let [dq, dk, dv] = shapes.map(|shape| Tensor::full_on(&shape, T::zero(), on));
                return Ok([dq?, dk?, dv?]);
            }
            let grads = shapes.map(|shape| product_output::<T>(on, &shape, T::DTYPE));
            let [dq, dk, dv] = grads;
            let (dq, dk, dv) = (dq?, dk?, dv?);
            let ops = Operands {
                q: at(q)?,
                k: at(k)?,
                v: at(v)?,
                out: at(out)?,
            };
            let lse = lse.gpu(OP)?.ok_or(crate::Error::DeviceMismatch {
                op: OP,
                first: on,
                second: lse.device(),
            })?;
            let delta = GpuArray::<T>::uninit(OP, on, &[g.heads * g.sq])?;
            let gradients = Gradients {
                d_out: at(d_out)?,
                dq: at(&dq)?.ptr,
                dk: at(&dk)?.ptr,
                dv: at(&dv)?.ptr,
                format: 0,
            };
            device::backward(&flash, &ops, &lse, &delta, &gradients)?;
            Ok([dq, dk, dv])
        }
    }
}

/// Whether fused attention of `f32` tensors stored as `dtype` with heads `head_dim` wide
/// runs on `device`'s tensor cores (`mma.m16n8k16`): bf16 or f16 storage, head
/// dimensions 64 and 128, compute capability 8.0 or newer, and the emulated device,
/// which runs the same kernels with the PTX fragment layouts. Elsewhere fused attention
/// runs on CUDA cores (head dimensions up to 64) or falls back to the unfused kernel.
///
/// ```
/// use ferrotron_tape::{tensor_core_attention_takes, DType, Device};
///
/// assert!(tensor_core_attention_takes(Device::Emulated, DType::BF16, 128));
/// assert!(!tensor_core_attention_takes(Device::Emulated, DType::F32, 64));
/// assert!(!tensor_core_attention_takes(Device::Cpu, DType::BF16, 64));
/// ```
pub fn tensor_core_attention_takes(device: Device, dtype: crate::DType, head_dim: usize) -> bool {
    let format = super::residual::format_number(dtype);
    device::takes_tensor_cores::<f32>(device, format, head_dim)
}

/// Whether [`attention_block`] takes `head_dim` on `device` in `T`.
pub fn fused_attention_takes<T: Element>(device: Device, head_dim: usize) -> bool {
    device == Device::Cpu || head_dim <= device::max_head_dim::<T>()
}

/// The geometry of a block's `[heads, s, d]` operands, checked.
fn block_flash<T: Element>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
    causal: bool,
) -> Result<Flash> {
    const BLOCK: &str = "attention_block";
    let (qs, ks) = (q.shape(), k.shape());
    let fits =
        qs.len() == 3 && ks.len() == 3 && v.shape() == ks && qs[0] == ks[0] && qs[2] == ks[2];
    if !fits {
        return Err(crate::Error::shape(
            BLOCK,
            &[qs, ks, v.shape()],
            "needs [heads, sq, d] queries and [heads, sk, d] keys and values",
        ));
    }
    super::common_device(BLOCK, &[q, k, v])?;
    // The kernels read the three in one storage format.
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return Err(crate::Error::invalid(
            BLOCK,
            format!(
                "queries, keys and values are stored as {}, {} and {}: store them in one \
                 format (to_dtype)",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ),
        ));
    }
    let format = super::residual::format_number(q.dtype());
    let tensor_cores = device::takes_tensor_cores::<T>(q.device(), format, qs[2]);
    if !fused_attention_takes::<T>(q.device(), qs[2]) && !tensor_cores {
        return Err(crate::Error::invalid(
            BLOCK,
            format!(
                "head dimension {} is wider than the fused kernel takes on a device ({}; 64 \
                 and 128 in bf16 or f16 on tensor cores)",
                qs[2],
                device::max_head_dim::<T>()
            ),
        ));
    }
    let (heads, sq, sk, d) = (qs[0], qs[1], ks[1], qs[2]);
    let rows = |s: usize| RowStrides {
        batch: 0,
        group: s * d,
        head: 0,
        pos: d,
    };
    Ok(Flash {
        geometry: FlashGeometry {
            batch: 1,
            heads,
            per_group: 1,
            sq,
            sk,
            d,
            strides: [rows(sq), rows(sk), rows(sk), rows(sq)],
            causal: causal.then_some(0),
        },
        scale,
        dropout: None,
    })
}

/// The geometry of packed input and its `[s, b, heads · d]` output.
pub(super) fn packed_geometry(heads: &Heads, causal: bool) -> FlashGeometry {
    let Heads { s, b, n, r, d } = *heads;
    let row = (r + 2) * d;
    let packed = RowStrides {
        batch: (n / r) * row,
        group: row,
        head: d,
        pos: b * (n / r) * row,
    };
    let kv = RowStrides { head: 0, ..packed };
    let out = RowStrides {
        batch: n * d,
        group: r * d,
        head: d,
        pos: b * n * d,
    };
    FlashGeometry {
        batch: b,
        heads: n,
        per_group: r,
        sq: s,
        sk: s,
        d,
        strides: [packed, kv, kv, out],
        causal: causal.then_some(0),
    }
}

/// Device operands of packed input at `qkv` (queries, then the group's key and value),
/// elements of `T` or 16-bit.
fn packed_operands<T>(heads: &Heads, qkv: At, out: At) -> Operands {
    let size = match qkv.format {
        0 => std::mem::size_of::<T>(),
        _ => 2,
    };
    let part = |index: usize| At {
        ptr: qkv.ptr + (index * heads.d * size) as u64,
        format: qkv.format,
    };
    Operands {
        q: part(0),
        k: part(heads.r),
        v: part(heads.r + 1),
        out,
    }
}

/// A device tensor's address and format.
fn at<T: Element>(t: &Tensor<T>) -> Result<At> {
    let input = t.device_input(OP, t.device())?;
    Ok(At {
        ptr: input.ptr,
        format: input.format,
    })
}

/// The forward's row statistics, where the forward ran.
enum Lse<T: Element> {
    Cpu(Vec<T>),
    Device(GpuArray<T>),
}

/// What the backward reads: the input, the output as stored, the row statistics.
struct Saved<T: Element> {
    qkv: Tensor<T>,
    out: Tensor<T>,
    lse: Lse<T>,
    flash: Flash,
    heads: Heads,
    grad_format: crate::DType,
}

impl<T: Element> Saved<T> {
    /// The packed gradient of the queries, keys and values.
    fn backward(&self, grad: &Tensor<T>) -> Result<Tensor<T>> {
        let Heads { s, b, n, r, d } = self.heads;
        let shape = [s, b, n / r, r + 2, d];
        match &self.lse {
            Lse::Cpu(lse) => {
                let [data, out, d_out] = [&self.qkv, &self.out, grad].map(|t| t.cpu(OP));
                let (data, out, d_out) = (data?, out?, d_out?);
                let (data, out, d_out) = (
                    data.as_standard_layout(),
                    out.as_standard_layout(),
                    d_out.as_standard_layout(),
                );
                let x = packed_parts(slice(&data)?, &self.heads);
                let mut packed = ArrayD::<T>::zeros(IxDyn(&shape));
                let g = &self.flash.geometry;
                let rows = RowData {
                    out: slice(&out)?,
                    d_out: slice(&d_out)?,
                    lse,
                };
                let slots = [0, r * d, (r + 1) * d];
                cpu_backward(&self.flash, &x, &rows, |t, z, i, values| {
                    let at = slots[t] + g.row(t, z, i);
                    if let Some(all) = packed.as_slice_mut() {
                        all[at..at + values.len()].copy_from_slice(values);
                    }
                })?;
                Ok(Tensor::from_array(packed))
            }
            Lse::Device(lse) => {
                let on = self.qkv.device();
                let grads = product_output::<T>(on, &shape, self.grad_format)?;
                let base = at(&self.qkv)?;
                let ops = packed_operands::<T>(&self.heads, base, at(&self.out)?);
                let target = packed_operands::<T>(&self.heads, at(&grads)?, at(&self.out)?);
                let delta = GpuArray::<T>::uninit(OP, on, &[b * n * s])?;
                let gradients = Gradients {
                    d_out: at(grad)?,
                    dq: target.q.ptr,
                    dk: target.k.ptr,
                    dv: target.v.ptr,
                    format: target.q.format,
                };
                device::backward(&self.flash, &ops, lse, &delta, &gradients)?;
                Ok(grads)
            }
        }
    }
}

/// The queries, keys and values of packed input's elements.
fn packed_parts<'a, T>(data: &'a [T], heads: &Heads) -> Parts<'a, T> {
    let at = |index: usize| &data[(index * heads.d).min(data.len())..];
    Parts {
        q: at(0),
        k: at(heads.r),
        v: at(heads.r + 1),
    }
}
