//! Fused attention: FlashAttention-2's scheme on every device. The forward visits the
//! keys a tile at a time with an online softmax and keeps only the output and each
//! query's log-sum-exp; the backward recomputes the probabilities from them, so no
//! `sequence²` tensor is ever held. Dropout's mask is a function of a seed and each
//! element's place, regenerated in backward. The CPU computes it tile by tile on the
//! calling thread's threads, a device with `kernels/attention.cu`.

use ndarray::{ArrayD, IxDyn};

use super::attention::{product_output, Heads, OP};
use crate::gpu::attention_ops::{
    self as device, At, Flash, FlashDropout, FlashGeometry, Gradients, Operands, RowStrides, K, O,
    Q, TILE, V,
};
use crate::gpu::GpuArray;
use crate::tape::record_tensor;
use crate::{Device, Element, Result, Tensor};

/// The fused op on packed `[s, b, groups, per_group + 2, d]` input (checked by the
/// caller), recorded with a backward that recomputes.
pub(super) fn attend<T: Element>(qkv: &Tensor<T>, heads: Heads, flash: Flash) -> Result<Tensor<T>> {
    let Heads { s, b, n, d, .. } = heads;
    let dtype = qkv.dtype();
    let (out, lse) = match qkv.device() {
        Device::Cpu => {
            let data = qkv.cpu(OP)?.as_standard_layout().into_owned();
            let x = packed_parts(slice(&data)?, &heads);
            let (out, lse) = cpu_forward(&flash, &x, &[s, b, n * d])?;
            (Tensor::from_array(out).stored_as(OP, dtype)?, Lse::Cpu(lse))
        }
        on => {
            let out = product_output::<T>(on, &[s, b, n * d], dtype)?;
            let lse = GpuArray::<T>::uninit(OP, on, &[b * n * s])?;
            let base = qkv.device_input(OP, on)?;
            let qkv_at = At {
                ptr: base.ptr,
                format: base.format,
            };
            let ops = packed_operands::<T>(&heads, qkv_at, at(&out)?);
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
/// with `lse = log Σ_b exp(lse_b)`. On a device, head dimensions above 128 (64 in f64)
/// are an error: check [`fused_attention_takes`] first.
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
            let arrays = [q, k, v].map(|t| t.cpu(OP).map(|a| a.as_standard_layout().into_owned()));
            let [q, k, v] = arrays;
            let (q, k, v) = (q?, k?, v?);
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
            let arrays = [q, k, v, out, d_out, lse]
                .map(|t| t.cpu(OP).map(|a| a.as_standard_layout().into_owned()));
            let [q, k, v, out, d_out, lse] = arrays;
            let (q, k, v, out, d_out, lse) = (q?, k?, v?, out?, d_out?, lse?);
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
            let grads = shapes.map(|shape| product_output::<T>(on, &shape, T::DTYPE));
            let [dq, dk, dv] = grads;
            let (dq, dk, dv) = (dq?, dk?, dv?);
            if g.sq > 0 && g.sk > 0 && g.heads > 0 {
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
            }
            Ok([dq, dk, dv])
        }
    }
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
    if !fused_attention_takes::<T>(q.device(), qs[2]) {
        return Err(crate::Error::invalid(
            BLOCK,
            format!(
                "head dimension {} is wider than the fused kernel takes on a device ({})",
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
                let data = self.qkv.cpu(OP)?.as_standard_layout().into_owned();
                let x = packed_parts(slice(&data)?, &self.heads);
                let out = self.out.cpu(OP)?.as_standard_layout().into_owned();
                let d_out = grad.cpu(OP)?.as_standard_layout().into_owned();
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

/// A row-major array's elements.
fn slice<T: Element>(array: &ArrayD<T>) -> Result<&[T]> {
    array
        .as_slice()
        .ok_or_else(|| crate::Error::shape(OP, &[array.shape()], "internal: not row-major"))
}

/// Queries, keys and values of one call on the CPU, each a slice from its operand's
/// first element (rows found through the geometry).
pub(crate) struct Parts<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
}

fn packed_parts<'a, T>(data: &'a [T], heads: &Heads) -> Parts<'a, T> {
    let at = |index: usize| &data[(index * heads.d).min(data.len())..];
    Parts {
        q: at(0),
        k: at(heads.r),
        v: at(heads.r + 1),
    }
}

/// The forward on the CPU: the output (in `shape`, the geometry's output layout) and
/// each query's log-sum-exp (`[batch · heads · sq]`).
fn cpu_forward<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    shape: &[usize],
) -> Result<(ArrayD<T>, Vec<T>)> {
    let g = &flash.geometry;
    let tiles: Vec<(usize, usize)> = tiles(g.query_heads(), g.sq);
    let done = in_parallel(&tiles, |&(z, q0)| forward_tile(flash, x, z, q0));
    let mut out = ArrayD::<T>::zeros(IxDyn(shape));
    let mut lse = vec![T::zero(); g.query_heads() * g.sq];
    let all = out.as_slice_mut().expect("a fresh array is row-major");
    for ((z, q0), (rows, stats)) in tiles.into_iter().zip(done) {
        for (rr, row) in rows.chunks(g.d.max(1)).enumerate() {
            let at = g.row(O, z, q0 + rr);
            all[at..at + g.d].copy_from_slice(row);
        }
        lse[z * g.sq + q0..z * g.sq + q0 + stats.len()].copy_from_slice(&stats);
    }
    Ok((out, lse))
}

/// `(head, first row)` of every tile of `rows` rows over `heads` heads.
fn tiles(heads: usize, rows: usize) -> Vec<(usize, usize)> {
    (0..heads)
        .flat_map(|z| (0..rows).step_by(TILE).map(move |r0| (z, r0)))
        .collect()
}

/// `work` on every item, on the calling thread's threads, results in order.
fn in_parallel<I: Sync, R: Send>(items: &[I], work: impl Fn(&I) -> R + Sync) -> Vec<R> {
    let threads = crate::threads::num_threads().min(items.len()).max(1);
    let per = items.len().div_ceil(threads).max(1);
    let results = parking_lot::Mutex::new(Vec::new());
    let pieces: Vec<(usize, &[I])> = items.chunks(per).enumerate().collect();
    crate::threads::run_pieces(pieces, |(index, chunk)| {
        let done: Vec<R> = chunk.iter().map(&work).collect();
        results.lock().push((index, done));
    });
    let mut results = results.into_inner();
    results.sort_by_key(|(index, _)| *index);
    results.into_iter().flat_map(|(_, done)| done).collect()
}

/// `Σ_c a[c] · b[c]` in column order.
fn dot<T: Element>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |acc, (&x, &y)| acc + x * y)
}

/// `acc[c] += w · x[c]`.
fn axpy<T: Element>(acc: &mut [T], w: T, x: &[T]) {
    acc.iter_mut().zip(x).for_each(|(a, &x)| *a += w * x);
}

/// One query tile's output rows (`rows × d`) and log-sum-exps.
fn forward_tile<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    z: usize,
    q0: usize,
) -> (Vec<T>, Vec<T>) {
    let g = &flash.geometry;
    let (d, rows) = (g.d, TILE.min(g.sq - q0));
    let scale = T::from_f64(flash.scale);
    let (mut m, mut l) = (vec![T::neg_infinity(); rows], vec![T::zero(); rows]);
    let mut acc = vec![T::zero(); rows * d];
    let mut p = [T::zero(); TILE];
    for k0 in (0..g.key_end(q0)).step_by(TILE) {
        let width = TILE.min(g.sk - k0);
        for rr in 0..rows {
            let i = q0 + rr;
            let q = &x.q[g.row(Q, z, i)..][..d];
            let mut top = T::neg_infinity();
            for (j, pj) in p.iter_mut().enumerate().take(width) {
                *pj = T::neg_infinity();
                if g.sees(i, k0 + j) {
                    *pj = dot(q, &x.k[g.row(K, z, k0 + j)..][..d]) * scale;
                    top = top.max(*pj);
                }
            }
            let m_new = top.max(m[rr]);
            let base = if m_new == T::neg_infinity() {
                T::zero()
            } else {
                m_new
            };
            let mut sum = T::zero();
            for (j, pj) in p.iter_mut().enumerate().take(width) {
                let e = if *pj == T::neg_infinity() {
                    T::zero()
                } else {
                    (*pj - base).exp()
                };
                sum += e;
                *pj = e * T::from_f64(flash.factor(z, i, k0 + j));
            }
            let alpha = (m[rr] - base).exp();
            l[rr] = l[rr] * alpha + sum;
            m[rr] = m_new;
            let row = &mut acc[rr * d..(rr + 1) * d];
            row.iter_mut().for_each(|a| *a *= alpha);
            for (j, &pj) in p.iter().enumerate().take(width) {
                axpy(row, pj, &x.v[g.row(V, z, k0 + j)..][..d]);
            }
        }
    }
    for rr in 0..rows {
        let inv = if l[rr] > T::zero() {
            T::one() / l[rr]
        } else {
            T::zero()
        };
        acc[rr * d..(rr + 1) * d].iter_mut().for_each(|a| *a *= inv);
        m[rr] = if l[rr] > T::zero() {
            m[rr] + l[rr].ln()
        } else {
            T::neg_infinity()
        };
    }
    (acc, m)
}

/// What the backward reads besides the inputs: the output and its gradient (in the
/// output's layout) and each query's log-sum-exp.
pub(crate) struct RowData<'a, T> {
    pub out: &'a [T],
    pub d_out: &'a [T],
    pub lse: &'a [T],
}

/// The backward on the CPU: `write(t, z, i, row)` receives row `i` of head `z`'s
/// gradient of operand `t` (0 queries, 1 keys, 2 values; keys and values once per group,
/// with `z` its first query head).
fn cpu_backward<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    rows: &RowData<'_, T>,
    mut write: impl FnMut(usize, usize, usize, &[T]),
) -> Result<()> {
    let g = &flash.geometry;
    let d = g.d;
    let delta: Vec<T> = (0..g.query_heads() * g.sq)
        .map(|zi| {
            let at = g.row(O, zi / g.sq.max(1), zi % g.sq.max(1));
            dot(&rows.out[at..][..d], &rows.d_out[at..][..d])
        })
        .collect();
    let query_tiles = tiles(g.query_heads(), g.sq);
    let dq = in_parallel(&query_tiles, |&(z, q0)| {
        query_tile(flash, x, rows, &delta, z, q0)
    });
    for ((z, q0), block) in query_tiles.into_iter().zip(dq) {
        for (rr, row) in block.chunks(d.max(1)).enumerate() {
            write(Q, z, q0 + rr, row);
        }
    }
    let key_tiles = tiles(g.kv_heads(), g.sk);
    let groups = g.heads / g.per_group;
    let first_head = |kv: usize| (kv / groups) * g.heads + (kv % groups) * g.per_group;
    let dkv = in_parallel(&key_tiles, |&(kv, k0)| {
        key_tile(flash, x, rows, &delta, first_head(kv), k0)
    });
    for ((kv, k0), (dk, dv)) in key_tiles.into_iter().zip(dkv) {
        let z = first_head(kv);
        for (rr, (k, v)) in dk.chunks(d.max(1)).zip(dv.chunks(d.max(1))).enumerate() {
            write(K, z, k0 + rr, k);
            write(V, z, k0 + rr, v);
        }
    }
    Ok(())
}

/// The recomputed probability of query `i` (row statistic `lse`) and key `j` of head
/// `z`, and the gradient of the (dropped) probability from `dO·v`:
/// `(P, P · factor, factor · dP)`.
fn recompute<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    d_out: &[T],
    lse: T,
    z: usize,
    i: usize,
    j: usize,
) -> (T, T, T) {
    let g = &flash.geometry;
    let q = &x.q[g.row(Q, z, i)..][..g.d];
    let score = dot(q, &x.k[g.row(K, z, j)..][..g.d]) * T::from_f64(flash.scale);
    let p = (score - lse).exp();
    let dp = dot(d_out, &x.v[g.row(V, z, j)..][..g.d]);
    let factor = T::from_f64(flash.factor(z, i, j));
    (p, p * factor, dp * factor)
}

/// One query tile's gradient rows (`rows × d`).
fn query_tile<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    rows: &RowData<'_, T>,
    delta: &[T],
    z: usize,
    q0: usize,
) -> Vec<T> {
    let g = &flash.geometry;
    let (d, count) = (g.d, TILE.min(g.sq - q0));
    let mut dq = vec![T::zero(); count * d];
    for rr in 0..count {
        let (i, zi) = (q0 + rr, z * g.sq + q0 + rr);
        let d_out = &rows.d_out[g.row(O, z, i)..][..d];
        let row = &mut dq[rr * d..(rr + 1) * d];
        for j in (0..g.key_end(q0)).filter(|&j| g.sees(i, j)) {
            let (p, _, dp) = recompute(flash, x, d_out, rows.lse[zi], z, i, j);
            axpy(row, p * (dp - delta[zi]), &x.k[g.row(K, z, j)..][..d]);
        }
        row.iter_mut().for_each(|a| *a *= T::from_f64(flash.scale));
    }
    dq
}

/// One key tile's key and value gradient rows, over the group's query heads (from `z0`).
fn key_tile<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    rows: &RowData<'_, T>,
    delta: &[T],
    z0: usize,
    k0: usize,
) -> (Vec<T>, Vec<T>) {
    let g = &flash.geometry;
    let (d, count) = (g.d, TILE.min(g.sk - k0));
    let (mut dk, mut dv) = (vec![T::zero(); count * d], vec![T::zero(); count * d]);
    for z in z0..z0 + g.per_group {
        for i in g.first_query_tile(k0)..g.sq {
            let zi = z * g.sq + i;
            let d_out = &rows.d_out[g.row(O, z, i)..][..d];
            let q = &x.q[g.row(Q, z, i)..][..d];
            for rr in (0..count).filter(|&rr| g.sees(i, k0 + rr)) {
                let (p, kept, dp) = recompute(flash, x, d_out, rows.lse[zi], z, i, k0 + rr);
                axpy(&mut dv[rr * d..(rr + 1) * d], kept, d_out);
                axpy(&mut dk[rr * d..(rr + 1) * d], p * (dp - delta[zi]), q);
            }
        }
    }
    dk.iter_mut().for_each(|a| *a *= T::from_f64(flash.scale));
    (dk, dv)
}
