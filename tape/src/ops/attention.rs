//! Self-attention on packed queries, keys and values: a transformer block's attention
//! core. Fused by default (`flash.rs`: no `sequence²` tensor kept); unfused, its products
//! on a device read q, k and v where the fused QKV projection wrote them and write the
//! context where the output projection reads it.

use super::flash;
use super::index::{dropout_scale, keep_mask, Dropout};
use super::packed::{product_output, Heads, OP};
use super::softmax::SoftmaxKernel;
use crate::gpu::attention_ops::{max_head_dim, takes_tensor_cores, Flash, FlashDropout};
use crate::gpu::ops::{gemm_into, Destination, Operand};
use crate::gpu::row_ops::{SoftmaxBackward, SoftmaxKind, SoftmaxRows};
use crate::gpu::{GemmFormat, GpuArray};
use crate::precision::written;
use crate::tape::record_tensor;
use crate::{DType, Device, Element, Generator, Result, Tensor};

/// Which computation [`Tensor::packed_attention`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// FlashAttention-2's scheme: tiles of keys with an online softmax, keeping only the
    /// output and one log-sum-exp per query; backward recomputes the probabilities. On a
    /// device with tensor cores (compute capability 8.0+, and the emulated device), bf16
    /// or f16 input with heads 64 or 128 wide runs on them
    /// ([`tensor_core_attention_takes`](crate::tensor_core_attention_takes)); other
    /// input runs on CUDA cores, where head dimensions above 64 (32 in f64) run
    /// [`Unfused`](Self::Unfused).
    #[default]
    Fused,
    /// Scores, softmax, dropout and two products as separate passes over
    /// `[batch · heads, seq, seq]` tensors: the reference the fused kernel is tested
    /// against.
    Unfused,
}

/// How [`Tensor::packed_attention`] attends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOptions {
    /// What the scores `q·kᵀ` are multiplied by (usually `1/√head_dim`).
    pub scale: f64,
    /// Whether position `i` sees only positions `j <= i`.
    pub causal: bool,
    /// Fused (the default) or the unfused reference.
    pub kernel: AttentionKernel,
}

impl AttentionOptions {
    /// Causal attention scaled by `1/√head_dim`, fused.
    pub fn causal(head_dim: usize) -> Self {
        AttentionOptions {
            scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
            causal: true,
            kernel: AttentionKernel::Fused,
        }
    }
}

impl<T: Element> Tensor<T> {
    /// Causal self-attention, unfused: [`packed_attention`](Self::packed_attention) with
    /// `causal` and [`AttentionKernel::Unfused`], on packed `[sequence, batch, heads, 3,
    /// head_dim]` (or grouped-query) input. Its dropout mask is drawn element by element from `generator`, as
    /// [`dropout`](Tensor::dropout) draws it.
    ///
    /// ```
    /// use ferrotron_tape::Tensor;
    ///
    /// // One sequence of two positions, one head of width 1: q = k = 0, so the second
    /// // position averages both values.
    /// let qkv = Tensor::<f64>::from_vec(vec![0.0, 0.0, 1.0, 0.0, 0.0, 3.0], &[2, 1, 1, 3, 1])?;
    /// let context = qkv.packed_causal_attention(1.0, None)?;
    /// assert_eq!(context.shape(), [2, 1, 1]);
    /// assert_eq!(context.to_vec()?, [1.0, 2.0]);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn packed_causal_attention(
        &self,
        scale: f64,
        dropout: Option<(f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        let options = AttentionOptions {
            scale,
            causal: true,
            kernel: AttentionKernel::Unfused,
        };
        self.packed_attention(options, dropout)
    }

    /// Self-attention on `self`, a fused QKV projection's output viewed as
    /// `[sequence, batch, groups, per_group + 2, head_dim]` (Megatron's layout: each key/value
    /// group's `per_group` queries, then its key and its value; `per_group = 1` is plain
    /// multi-head attention, more is grouped-query attention): for every position and
    /// query head `dropout(softmax(q·kᵀ · scale))·v` with the key and value of the head's
    /// group, the softmax causal or not, returned as `[sequence, batch, heads·head_dim]`
    /// (heads group by group). `dropout` is the probability and the generator it draws
    /// from.
    ///
    /// The unfused kernel equals splitting q, k and v out with [`narrow`](Tensor::narrow),
    /// [`concat`](Tensor::concat) and [`permute`](Tensor::permute) into
    /// `[batch·heads, sequence, head_dim]`, then
    /// [`matmul_transposed`](Tensor::matmul_transposed), [`causal_softmax`](Tensor::causal_softmax)
    /// (or [`softmax`](Tensor::softmax) of the scaled scores), [`dropout`](Tensor::dropout)
    /// (the same mask from the same generator) and [`matmul`](Tensor::matmul), and
    /// permuting the context back; on a device, causal multi-head attention runs as
    /// strided-batched GEMMs over the packed layout with the same numbers. The fused
    /// kernel computes the same attention tile by tile (within rounding of the summation
    /// order: 1e-6 relative in f32) and keeps no `sequence²` tensor; its dropout draws one
    /// seed from the generator and regenerates the mask from it in backward.
    ///
    /// ```
    /// use ferrotron_tape::{AttentionOptions, Tensor};
    ///
    /// // Two query heads share one key and value (grouped-query attention): q = k = 0,
    /// // so each position averages the values it sees.
    /// let qkv = Tensor::<f64>::from_vec(
    ///     vec![0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0],
    ///     &[2, 1, 1, 4, 1],
    /// )?;
    /// let context = qkv.packed_attention(AttentionOptions::causal(1), None)?;
    /// assert_eq!(context.shape(), [2, 1, 2]);
    /// assert_eq!(context.to_vec()?, [1.0, 1.0, 2.0, 2.0]);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn packed_attention(
        &self,
        options: AttentionOptions,
        dropout: Option<(f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        let heads = Heads::of(self.shape())?;
        let dropout = match dropout {
            Some((p, generator)) => dropout_scale::<T>(OP, p)?.map(|s| (p, s, generator)),
            None => None,
        };
        let empty = heads.numel() == 0;
        let fused = options.kernel == AttentionKernel::Fused && !empty && self.fuses(&heads);
        if fused {
            let flash = Flash {
                geometry: flash::packed_geometry(&heads, options.causal),
                scale: options.scale,
                dropout: dropout.map(|(p, _, generator)| FlashDropout {
                    seed: generator.next_u64(),
                    p,
                }),
            };
            return flash::attend(self, heads, flash);
        }
        let strided = self.device() != Device::Cpu
            && !empty
            && options.causal
            && heads.r == 1
            && (self.dtype() == T::DTYPE || T::DTYPE == DType::F32);
        if strided {
            return self.attend_in_place(heads, options.scale, dropout);
        }
        self.attend_by_views(heads, options, dropout)
    }

    /// Whether the fused kernel takes this input: any on the CPU; on a device, head
    /// dimensions its tiles hold, or the tensor-core kernels' (the others fall back,
    /// noted once per process).
    fn fuses(&self, heads: &Heads) -> bool {
        let format = super::residual::format_number(self.dtype());
        if self.device() == Device::Cpu
            || heads.d <= max_head_dim::<T>()
            || takes_tensor_cores::<T>(self.device(), format, heads.d)
        {
            return true;
        }
        static NOTED: std::sync::Once = std::sync::Once::new();
        NOTED.call_once(|| {
            eprintln!(
                "note: fused attention takes head dimensions up to {} on a device (64 and \
                 128 in bf16 or f16 on tensor cores); head dimension {} runs the unfused \
                 attention",
                max_head_dim::<T>(),
                heads.d
            )
        });
        false
    }

    /// The composition the unfused kernel equals (views on the CPU).
    fn attend_by_views(
        &self,
        Heads { s, b, n, r, d }: Heads,
        options: AttentionOptions,
        dropout: Option<(f64, f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        let heads_of = |t: Tensor<T>| t.permute(&[1, 2, 3, 0, 4])?.reshape(&[b * n, s, d]);
        let queries = heads_of(self.narrow(3, 0, r)?)?;
        // Each group's key and value, once for every query of the group.
        let shared = |index: usize| {
            let part = self.narrow(3, index, 1)?;
            match r {
                1 => heads_of(part),
                _ => heads_of(Tensor::concat(&vec![&part; r], 3)?),
            }
        };
        let scores = queries.matmul_transposed(&shared(r)?)?;
        let probs = match options.causal {
            true => scores.causal_softmax(options.scale)?,
            false => scores.scale(options.scale)?.softmax()?,
        };
        let probs = match dropout {
            Some((p, _, generator)) => probs.dropout(p, generator)?,
            None => probs,
        };
        probs
            .matmul(&shared(r + 1)?)?
            .reshape(&[b, n, s, d])?
            .permute(&[2, 0, 1, 3])?
            .reshape(&[s, b, n * d])
    }

    /// The device path: strided-batched products over the packed layout.
    fn attend_in_place(
        &self,
        heads: Heads,
        scale: f64,
        dropout: Option<(f64, f64, &mut Generator)>,
    ) -> Result<Tensor<T>> {
        let Heads { s, b, n, d, .. } = heads;
        let (device, dtype) = (self.device(), self.dtype());
        let forward = product_format::<T>(dtype, dtype);
        let qkv = self.device_input(OP, device)?.ptr;
        let size = forward.bytes().0;
        let scores = product_output::<T>(device, &[b * n, s, s], dtype)?;
        gemm_into(
            address(&scores)?,
            heads.scores_destination(),
            forward,
            heads.part(qkv, size, 0, false),
            heads.part(qkv, size, 1, true),
            [s, s, d, b * n],
        )?;
        let how = SoftmaxRows {
            kind: SoftmaxKind::Softmax,
            scale,
            causal: true,
        };
        let x = scores.device_input(OP, device)?;
        let probs = written(OP, device, scores.shape(), dtype, &SoftmaxKernel { x, how })?;
        let keep = match dropout {
            Some((p, scale, generator)) => {
                Some((keep_mask(OP, device, &[b * n, s, s], p, generator)?, scale))
            }
            None => None,
        };
        let dropped = match &keep {
            Some((keep, scale)) => {
                let x = probs.device_input(OP, device)?;
                let scale = *scale;
                written(
                    OP,
                    device,
                    probs.shape(),
                    dtype,
                    &Dropout { x, keep, scale },
                )?
            }
            None => probs.clone(),
        };
        let context = product_output::<T>(device, &[s, b, n * d], dtype)?;
        gemm_into(
            address(&context)?,
            heads.context_destination(),
            forward,
            heads.scores(address(&dropped)?.1, false),
            heads.part(qkv, size, 2, false),
            [s, d, s, b * n],
        )?;
        let grad_format = self.grad_format();
        record_tensor(OP, &[self], context, || {
            let saved = Saved {
                qkv: self.detach(),
                grad_format,
                probs,
                dropped,
                keep,
                how,
                heads,
            };
            Box::new(move |grad: Tensor<T>, _: &[bool]| Ok(vec![Some(saved.backward(&grad)?)]))
        })
    }
}

impl Heads {
    /// Query (0), key (1) or value (2) of every `(batch, head)` in the packed array at
    /// `qkv` of `size`-byte elements: `[sequence, head_dim]` matrices whose rows are a
    /// whole packed row apart.
    fn part(&self, qkv: u64, size: usize, index: usize, transposed: bool) -> Operand {
        Operand {
            ptr: qkv + (index * self.d * size) as u64,
            transposed,
            batch_stride: 3 * self.d,
            ld: Some(3 * self.b * self.n * self.d),
        }
    }

    /// Where the gradient of part `index` goes in a packed gradient.
    fn part_destination(&self, index: usize) -> Destination {
        Destination {
            offset: index * self.d,
            ld: 3 * self.b * self.n * self.d,
            batch_stride: 3 * self.d,
        }
    }

    /// The `[sequence, sequence]` matrices of a contiguous `[batch·heads, s, s]` array.
    fn scores(&self, ptr: u64, transposed: bool) -> Operand {
        Operand {
            ptr,
            transposed,
            batch_stride: self.s * self.s,
            ld: None,
        }
    }

    fn scores_destination(&self) -> Destination {
        Destination {
            offset: 0,
            ld: self.s,
            batch_stride: self.s * self.s,
        }
    }

    /// Each `(batch, head)`'s `[sequence, head_dim]` block of a `[s, b, heads·head_dim]`
    /// context (or its gradient) at `ptr`.
    fn context(&self, ptr: u64) -> Operand {
        Operand {
            ptr,
            transposed: false,
            batch_stride: self.d,
            ld: Some(self.b * self.n * self.d),
        }
    }

    fn context_destination(&self) -> Destination {
        Destination {
            offset: 0,
            ld: self.b * self.n * self.d,
            batch_stride: self.d,
        }
    }
}

/// The GEMM format of products of operands stored as `dtype` writing a result stored
/// as `out`: 16-bit operands multiply in their format, into 16-bit or `T` results.
fn product_format<T: Element>(dtype: DType, out: DType) -> GemmFormat {
    match (dtype, out == dtype) {
        (DType::BF16, true) => GemmFormat::Bf16,
        (DType::F16, true) => GemmFormat::F16,
        (DType::BF16, false) => GemmFormat::Bf16IntoF32,
        (DType::F16, false) => GemmFormat::F16IntoF32,
        _ => GemmFormat::of::<T>(),
    }
}

/// Where a device tensor's elements are, as stored.
fn address<T: Element>(tensor: &Tensor<T>) -> Result<(Device, u64)> {
    Ok((
        tensor.device(),
        tensor.device_input(OP, tensor.device())?.ptr,
    ))
}

/// What the backward reads: the packed input (and the format its gradient is kept
/// in), the probabilities before and after dropout, and dropout's mask and scale.
struct Saved<T: Element> {
    qkv: Tensor<T>,
    grad_format: DType,
    probs: Tensor<T>,
    dropped: Tensor<T>,
    keep: Option<(GpuArray<u8>, f64)>,
    how: SoftmaxRows,
    heads: Heads,
}

impl<T: Element> Saved<T> {
    /// The packed gradient: `dV = P'ᵀ·dC`, `dP' = dC·Vᵀ`, dropout's and softmax's
    /// backward to `dS`, then `dQ = dS·K` and `dK = dSᵀ·Q`, each product writing its part.
    /// Every gradient is stored as the composition's tape keeps it: the sequence² ones
    /// in the activations' format, the packed one in the input's gradient format.
    fn backward(&self, grad: &Tensor<T>) -> Result<Tensor<T>> {
        let Heads { s, b, n, d, .. } = self.heads;
        let (device, dtype) = (self.qkv.device(), self.qkv.dtype());
        let inner = product_format::<T>(dtype, dtype);
        let outer = product_format::<T>(dtype, self.grad_format);
        let qkv = self.qkv.device_input(OP, device)?.ptr;
        let size = inner.bytes().0;
        let out = product_output::<T>(device, &[s, b, n, 3, d], self.grad_format)?;
        let packed = address(&out)?;
        let g = self.as_stored(grad)?;
        let heads = self.heads;
        gemm_into(
            packed,
            heads.part_destination(2),
            outer,
            heads.scores(address(&self.dropped)?.1, true),
            heads.context(address(&g)?.1),
            [s, d, s, b * n],
        )?;
        // Each `sequence²` gradient is released once the next is made from it (the
        // work is queued in order), so at most two are held at once.
        let d_probs = {
            let d_dropped = product_output::<T>(device, &[b * n, s, s], dtype)?;
            gemm_into(
                address(&d_dropped)?,
                heads.scores_destination(),
                inner,
                heads.context(address(&g)?.1),
                heads.part(qkv, size, 2, true),
                [s, s, d, b * n],
            )?;
            match &self.keep {
                Some((keep, scale)) => {
                    let x = d_dropped.device_input(OP, device)?;
                    let scale = *scale;
                    let shape = [b * n, s, s];
                    written(OP, device, &shape, dtype, &Dropout { x, keep, scale })?
                }
                None => d_dropped,
            }
        };
        drop(g);
        let softmax = SoftmaxBackward {
            grad: d_probs.device_input(OP, device)?,
            y: self.probs.device_input(OP, device)?,
            how: self.how,
        };
        let d_scores: Tensor<T> = written(OP, device, &[b * n, s, s], dtype, &softmax)?;
        drop(d_probs);
        let d_scores = address(&d_scores)?.1;
        for (index, transposed, other) in [(0, false, 1), (1, true, 0)] {
            gemm_into(
                packed,
                heads.part_destination(index),
                outer,
                heads.scores(d_scores, transposed),
                heads.part(qkv, size, other, false),
                [s, d, s, b * n],
            )?;
        }
        Ok(out)
    }

    /// `grad` stored as the products read it, in the activations' format (as the tape
    /// keeps it already).
    fn as_stored(&self, grad: &Tensor<T>) -> Result<Tensor<T>> {
        match self.qkv.dtype() {
            dtype if dtype == grad.dtype() => Ok(grad.clone()),
            dtype => grad.stored_as(OP, dtype),
        }
    }
}
