//! Fused attention on the CPU: the device kernels' tiles, each gathered into a
//! contiguous row-major copy whose products run as the CPU's matrix products do
//! (vectorized, on the tile's own thread). Tiles run on the calling thread's threads;
//! results do not depend on how many.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayBase, ArrayD, ArrayView2, ArrayViewMut2, Data, IxDyn};

use super::OP;
use crate::gpu::attention_ops::{Flash, FlashGeometry, K, O, Q, TILE, V};
use crate::{Element, Result};

/// A row-major array's elements.
pub(super) fn slice<T: Element, S: Data<Elem = T>>(array: &ArrayBase<S, IxDyn>) -> Result<&[T]> {
    array
        .as_slice()
        .ok_or_else(|| crate::Error::shape(OP, &[array.shape()], "internal: not row-major"))
}

/// Queries, keys and values of one call, each a slice from its operand's first element
/// (rows found through the geometry).
pub(super) struct Parts<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
}

/// What the backward reads besides the inputs: the output and its gradient (in the
/// output's layout) and each query's log-sum-exp.
pub(super) struct RowData<'a, T> {
    pub out: &'a [T],
    pub d_out: &'a [T],
    pub lse: &'a [T],
}

/// Rows `first..first + TILE` of operand `t` of head `z` from `x`, row-major `[TILE, d]`,
/// zeros past `rows`.
fn gather<T: Element>(
    g: &FlashGeometry,
    x: &[T],
    t: usize,
    z: usize,
    first: usize,
    rows: usize,
) -> Vec<T> {
    let d = g.d;
    let mut tile = vec![T::zero(); TILE * d];
    for (j, row) in tile
        .chunks_mut(d.max(1))
        .enumerate()
        .take(rows.saturating_sub(first))
    {
        row.copy_from_slice(&x[g.row(t, z, first + j)..][..d]);
    }
    tile
}

/// `out = a · bᵀ` for `[rows, d]` `a`, `[TILE, d]` `b` and `[rows, TILE]` `out` (the
/// products run as the CPU's matrix products do, vectorized).
fn products<T: Element>(a: &[T], b: &[T], d: usize, out: &mut [T]) {
    let rows = out.len() / TILE;
    // The callers' tiles are made `TILE · d` long (`gather`) and sliced to `rows`, so
    // these shapes always fit.
    let a = ArrayView2::from_shape((rows, d), a).expect("a tile of rows");
    let b = ArrayView2::from_shape((TILE, d), b).expect("a whole tile");
    let mut out = ArrayViewMut2::from_shape((rows, TILE), out).expect("a tile of scores");
    general_mat_mul(T::one(), &a, &b.t(), T::zero(), &mut out);
}

/// `acc += w · b` for `[rows, d]` `acc`, `[rows, TILE]` `w` and `[TILE, d]` `b`.
fn accumulate<T: Element>(acc: &mut [T], w: &[T], b: &[T], d: usize) {
    let rows = w.len() / TILE;
    // As in `products`: the tiles' lengths are the shapes'.
    let w = ArrayView2::from_shape((rows, TILE), w).expect("a tile of weights");
    let b = ArrayView2::from_shape((TILE, d), b).expect("a whole tile");
    let mut acc = ArrayViewMut2::from_shape((rows, d), acc).expect("a tile of rows");
    general_mat_mul(T::one(), &w, &b, T::one(), &mut acc);
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

/// The forward: the output (in `shape`, the geometry's output layout) and each query's
/// log-sum-exp (`[batch · heads · sq]`).
pub(super) fn cpu_forward<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    shape: &[usize],
) -> Result<(ArrayD<T>, Vec<T>)> {
    let g = &flash.geometry;
    let work = tiles(g.query_heads(), g.sq);
    let done = in_parallel(&work, |&(z, q0)| forward_tile(flash, x, z, q0));
    let mut out = ArrayD::<T>::zeros(IxDyn(shape));
    let mut lse = vec![T::zero(); g.query_heads() * g.sq];
    let all = out.as_slice_mut().expect("a fresh array is row-major");
    for ((z, q0), (rows, stats)) in work.into_iter().zip(done) {
        for (rr, row) in rows.chunks(g.d.max(1)).enumerate().take(stats.len()) {
            let at = g.row(O, z, q0 + rr);
            all[at..at + g.d].copy_from_slice(row);
        }
        lse[z * g.sq + q0..z * g.sq + q0 + stats.len()].copy_from_slice(&stats);
    }
    Ok((out, lse))
}

/// One query tile's output rows (`[TILE, d]`) and log-sum-exps (one per row).
fn forward_tile<T: Element>(
    flash: &Flash,
    x: &Parts<'_, T>,
    z: usize,
    q0: usize,
) -> (Vec<T>, Vec<T>) {
    let g = &flash.geometry;
    let (d, rows) = (g.d, TILE.min(g.sq - q0));
    let scale = T::from_f64(flash.scale);
    let q = gather(g, x.q, Q, z, q0, g.sq);
    let (mut m, mut l) = (vec![T::neg_infinity(); rows], vec![T::zero(); rows]);
    let (mut acc, mut p) = (vec![T::zero(); TILE * d], vec![T::zero(); TILE * TILE]);
    for k0 in (0..g.key_end(q0)).step_by(TILE) {
        let k = gather(g, x.k, K, z, k0, g.sk);
        products(&q[..rows * d], &k, d, &mut p[..rows * TILE]);
        for rr in 0..rows {
            let i = q0 + rr;
            let row = &mut p[rr * TILE..(rr + 1) * TILE];
            let mut top = T::neg_infinity();
            for (j, s) in row.iter_mut().enumerate() {
                *s = match g.sees(i, k0 + j) {
                    true => *s * scale,
                    false => T::neg_infinity(),
                };
                top = top.max(*s);
            }
            let m_new = top.max(m[rr]);
            let base = if m_new == T::neg_infinity() {
                T::zero()
            } else {
                m_new
            };
            let mut sum = T::zero();
            for (j, s) in row.iter_mut().enumerate() {
                let e = if *s == T::neg_infinity() {
                    T::zero()
                } else {
                    (*s - base).exp()
                };
                sum += e;
                *s = e * T::from_f64(flash.factor(z, i, k0 + j));
            }
            let alpha = (m[rr] - base).exp();
            l[rr] = l[rr] * alpha + sum;
            m[rr] = m_new;
            acc[rr * d..(rr + 1) * d]
                .iter_mut()
                .for_each(|a| *a *= alpha);
        }
        let v = gather(g, x.v, V, z, k0, g.sk);
        accumulate(&mut acc[..rows * d], &p[..rows * TILE], &v, d);
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

/// The backward: `write(t, z, i, row)` receives row `i` of head `z`'s gradient of
/// operand `t` (0 queries, 1 keys, 2 values; keys and values once per group, with `z`
/// its first query head).
pub(super) fn cpu_backward<T: Element>(
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
            let (out, d_out) = (&rows.out[at..][..d], &rows.d_out[at..][..d]);
            out.iter()
                .zip(d_out)
                .fold(T::zero(), |acc, (&o, &g)| acc + o * g)
        })
        .collect();
    let query_tiles = tiles(g.query_heads(), g.sq);
    let pass = Backward {
        flash,
        x,
        rows,
        delta: &delta,
    };
    let dq = in_parallel(&query_tiles, |&(z, q0)| pass.query_tile(z, q0));
    for ((z, q0), block) in query_tiles.into_iter().zip(dq) {
        for (rr, row) in block.chunks(d.max(1)).enumerate().take(g.sq - q0) {
            write(Q, z, q0 + rr, row);
        }
    }
    let key_tiles = tiles(g.kv_heads(), g.sk);
    let groups = g.heads / g.per_group;
    let first_head = |kv: usize| (kv / groups) * g.heads + (kv % groups) * g.per_group;
    let dkv = in_parallel(&key_tiles, |&(kv, k0)| pass.key_tile(first_head(kv), k0));
    for ((kv, k0), (dk, dv)) in key_tiles.into_iter().zip(dkv) {
        let z = first_head(kv);
        let pairs = dk.chunks(d.max(1)).zip(dv.chunks(d.max(1)));
        for (rr, (k, v)) in pairs.enumerate().take(g.sk - k0) {
            write(K, z, k0 + rr, k);
            write(V, z, k0 + rr, v);
        }
    }
    Ok(())
}

/// The recomputed probability of one query and key after dropout, `P' = P · factor`,
/// and its score's gradient `dS = P · (factor · dP − delta)`, from the scaled score,
/// `dP = dO·v`, the query's log-sum-exp and correction, and dropout's factor.
fn recomputed<T: Element>(score: T, dp: T, lse: T, delta: T, factor: T) -> (T, T) {
    let p = (score - lse).exp();
    (p * factor, p * (dp * factor - delta))
}

/// What the backward's tiles read: the call, its inputs, the output side and each
/// query's correction `Σ dO ⊙ out`.
struct Backward<'a, T> {
    flash: &'a Flash,
    x: &'a Parts<'a, T>,
    rows: &'a RowData<'a, T>,
    delta: &'a [T],
}

impl<T: Element> Backward<'_, T> {
    /// One query tile's gradient rows (`[TILE, d]`).
    fn query_tile(&self, z: usize, q0: usize) -> Vec<T> {
        let (flash, x, rows, delta) = (self.flash, self.x, self.rows, self.delta);
        let g = &flash.geometry;
        let (d, count) = (g.d, TILE.min(g.sq - q0));
        let scale = T::from_f64(flash.scale);
        let q = gather(g, x.q, Q, z, q0, g.sq);
        let d_out = gather(g, rows.d_out, O, z, q0, g.sq);
        let (mut s, mut dp) = (vec![T::zero(); TILE * TILE], vec![T::zero(); TILE * TILE]);
        let mut dq = vec![T::zero(); TILE * d];
        for k0 in (0..g.key_end(q0)).step_by(TILE) {
            let k = gather(g, x.k, K, z, k0, g.sk);
            products(&q[..count * d], &k, d, &mut s[..count * TILE]);
            let v = gather(g, x.v, V, z, k0, g.sk);
            products(&d_out[..count * d], &v, d, &mut dp[..count * TILE]);
            for rr in 0..count {
                let (i, zi) = (q0 + rr, z * g.sq + q0 + rr);
                for j in 0..TILE {
                    let at = rr * TILE + j;
                    s[at] = match g.sees(i, k0 + j) {
                        true => {
                            let factor = T::from_f64(flash.factor(z, i, k0 + j));
                            recomputed(s[at] * scale, dp[at], rows.lse[zi], delta[zi], factor).1
                        }
                        false => T::zero(),
                    };
                }
            }
            accumulate(&mut dq[..count * d], &s[..count * TILE], &k, d);
        }
        dq.iter_mut().for_each(|a| *a *= scale);
        dq
    }

    /// One key tile's key and value gradient rows (`[TILE, d]` each), over the group's
    /// query heads from `z0`.
    fn key_tile(&self, z0: usize, k0: usize) -> (Vec<T>, Vec<T>) {
        let (flash, x, rows, delta) = (self.flash, self.x, self.rows, self.delta);
        let g = &flash.geometry;
        let (d, count) = (g.d, TILE.min(g.sk - k0));
        let scale = T::from_f64(flash.scale);
        let (k, v) = (
            gather(g, x.k, K, z0, k0, g.sk),
            gather(g, x.v, V, z0, k0, g.sk),
        );
        let (mut s, mut dp) = (vec![T::zero(); TILE * TILE], vec![T::zero(); TILE * TILE]);
        let (mut dk, mut dv) = (vec![T::zero(); TILE * d], vec![T::zero(); TILE * d]);
        for z in z0..z0 + g.per_group {
            for q0 in (g.first_query_tile(k0)..g.sq).step_by(TILE) {
                let q = gather(g, x.q, Q, z, q0, g.sq);
                let d_out = gather(g, rows.d_out, O, z, q0, g.sq);
                // Transposed blocks: row kk is key k0 + kk, column j query q0 + j.
                products(&k[..count * d], &q, d, &mut s[..count * TILE]);
                products(&v[..count * d], &d_out, d, &mut dp[..count * TILE]);
                for kk in 0..count {
                    for j in 0..TILE {
                        let (at, i) = (kk * TILE + j, q0 + j);
                        let (kept, ds) = match g.sees(i, k0 + kk) {
                            true => {
                                let zi = z * g.sq + i;
                                let factor = T::from_f64(flash.factor(z, i, k0 + kk));
                                recomputed(s[at] * scale, dp[at], rows.lse[zi], delta[zi], factor)
                            }
                            false => (T::zero(), T::zero()),
                        };
                        (s[at], dp[at]) = (kept, ds);
                    }
                }
                accumulate(&mut dv[..count * d], &s[..count * TILE], &d_out, d);
                accumulate(&mut dk[..count * d], &dp[..count * TILE], &q, d);
            }
        }
        dk.iter_mut().for_each(|a| *a *= scale);
        (dk, dv)
    }
}
