//! Context parallelism: attention over a sequence divided among the ranks of a
//! context-parallel group, as Megatron-Core's ring attention computes it.
//!
//! Each rank holds `seq / cp` positions as two chunks of `seq / (2·cp)`: chunk `r` and
//! chunk `2·cp − 1 − r` ([`context_parallel_chunks`]), so under a causal mask every rank
//! has the same amount of work (an early chunk sees little, its partner late in the
//! sequence sees much). Queries stay where they are; keys and values travel around the
//! ring, one hop per step, in batched point-to-point exchanges. Each rank merges the
//! partial results of the blocks it can see by their log-sum-exp (online softmax), and
//! skips the blocks the causal mask hides entirely. Backward runs the ring again: the
//! key and value gradients travel with their keys and values and arrive back at their
//! owners after the last hop.
//!
//! The probabilities are never kept: the op saves its inputs, its output and one
//! log-sum-exp per query, and recomputes each block's probabilities in backward. Each
//! block runs tape's fused attention ([`attention_block`]: no `sequence²` tensor even
//! within a block) where it takes the head width, else a composition of products. It
//! computes in f32 whatever its inputs' storage.

use std::sync::Arc;

use ferrotron_comm_core::{Communicator, P2p};
use ferrotron_tape::{
    attention_block, attention_block_backward, causal_mask, fused_attention_takes,
    tensor_core_attention_takes, CustomOp, DType, Device, Tensor,
};

use crate::error::{Error, Result};

/// The two `(start, len)` ranges of a `seq`-long sequence that context-parallel rank
/// `rank` of `size` holds, in the order it holds them: chunk `rank` and chunk
/// `2·size − 1 − rank` of `2·size` equal chunks (Megatron's load-balanced split).
/// Errors unless `2·size` divides `seq`.
pub fn context_parallel_chunks(
    seq: usize,
    rank: usize,
    size: usize,
) -> Result<[(usize, usize); 2]> {
    const OP: &str = "context_parallel_chunks";
    if size == 0 || rank >= size {
        return Err(Error::config(
            OP,
            format!("rank {rank} is not in a context-parallel group of {size}"),
        ));
    }
    if seq == 0 || !seq.is_multiple_of(2 * size) {
        return Err(Error::config(
            OP,
            format!(
                "a sequence of {seq} positions does not split into 2 × {size} equal chunks \
                 (context parallelism gives each rank two): use a multiple of {}",
                2 * size
            ),
        ));
    }
    let chunk = seq / (2 * size);
    Ok([
        (rank * chunk, chunk),
        ((2 * size - 1 - rank) * chunk, chunk),
    ])
}

/// Context-parallel rank `rank`'s part of a sequence-first batch (`seq` positions of
/// `rows` values each: token ids, labels, position ids): its two chunks' rows, in the
/// order it holds them, as Megatron's `get_batch_on_this_cp_rank` cuts a batch. An empty
/// batch stays empty. Errors as [`context_parallel_chunks`].
///
/// ```
/// use ferrotron_layers::{context_parallel_batch, context_parallel_position};
///
/// // Eight positions of one row over two ranks: rank 0 holds chunks 0 and 3, rank 1
/// // chunks 1 and 2 (two positions each), so the causal work is balanced.
/// let ids: Vec<u32> = (0..8).collect();
/// assert_eq!(context_parallel_batch(&ids, 8, 1, 0, 2)?, [0, 1, 6, 7]);
/// assert_eq!(context_parallel_batch(&ids, 8, 1, 1, 2)?, [2, 3, 4, 5]);
/// // Position 6 lives on rank 0, third among its positions.
/// assert_eq!(context_parallel_position(6, 8, 2)?, (0, 2));
/// # Ok::<(), ferrotron_layers::Error>(())
/// ```
pub fn context_parallel_batch<T: Copy>(
    values: &[T],
    seq: usize,
    rows: usize,
    rank: usize,
    size: usize,
) -> Result<Vec<T>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let chunks = context_parallel_chunks(seq, rank, size)?;
    if values.len() != seq * rows {
        return Err(Error::config(
            "context_parallel_batch",
            format!(
                "{} values are not {seq} positions of {rows} rows; pass the whole \
                 sequence-first batch",
                values.len()
            ),
        ));
    }
    Ok(chunks
        .iter()
        .flat_map(|&(start, len)| values[start * rows..(start + len) * rows].iter().copied())
        .collect())
}

/// Which context-parallel rank of `size` holds position `at` of a `seq`-long sequence,
/// and where among its own positions ([`context_parallel_batch`]'s order). Errors as
/// [`context_parallel_chunks`], and for a position past the sequence.
pub fn context_parallel_position(at: usize, seq: usize, size: usize) -> Result<(usize, usize)> {
    context_parallel_chunks(seq, 0, size)?;
    if at >= seq {
        return Err(Error::config(
            "context_parallel_position",
            format!("position {at} is past the {seq}-long sequence"),
        ));
    }
    let chunk = seq / (2 * size);
    let index = at / chunk;
    Ok(match index < size {
        true => (index, at % chunk),
        false => (2 * size - 1 - index, chunk + at % chunk),
    })
}

/// One block of a rank's ring: at `step` its queries of chunk `query_chunk` attend to the
/// keys of chunk `key_chunk` (global chunk indices, of `2·cp`), under the causal mask
/// when `diagonal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingBlock {
    /// The ring step: the keys and values came from rank `(rank − step) mod cp`.
    pub step: usize,
    /// Which of this rank's two query chunks (0 or 1).
    pub query: usize,
    /// Which of the visiting two key chunks (0 or 1).
    pub key: usize,
    /// Whether the two chunks are the same positions (the causal mask cuts the block).
    pub diagonal: bool,
}

/// The blocks rank `rank` of a context-parallel group of `size` computes, in order. With
/// `causal`, a block whose keys all come after its queries is skipped; every rank then
/// computes `2·size + 1` blocks (`2·size − 1` whole and 2 diagonal ones), the same number.
pub fn ring_blocks(rank: usize, size: usize, causal: bool) -> Vec<RingBlock> {
    let global = |owner: usize, local: usize| match local {
        0 => owner,
        _ => 2 * size - 1 - owner,
    };
    let mut blocks = Vec::new();
    for step in 0..size {
        let source = (rank + size - step) % size;
        for query in 0..2 {
            for key in 0..2 {
                let (q, k) = (global(rank, query), global(source, key));
                if causal && k > q {
                    continue;
                }
                blocks.push(RingBlock {
                    step,
                    query,
                    key,
                    diagonal: causal && k == q,
                });
            }
        }
    }
    blocks
}

/// Attention of this rank's queries over the whole sequence's keys and values, which the
/// ranks of `group` hold in [`context_parallel_chunks`]' layout:
/// `softmax(q·kᵀ · scale) · v`, causal or not, on `[batch · heads, seq / cp, head_dim]`
/// queries, keys and values. The output has the queries' shape and storage; backward
/// gives each rank the gradients of its own queries, keys and values.
///
/// Every rank of `group` must call it (and run its backward) with the same shapes. A group
/// of one rank attends over its two chunks as one sequence.
pub fn ring_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    group: &Arc<dyn Communicator>,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    const OP: &str = "ring_attention";
    let shape = query.shape();
    if shape.len() != 3 || key.shape() != shape || value.shape() != shape {
        return Err(Error::shape(
            OP,
            query.shape(),
            "queries, keys and values of one shape [batch · heads, seq / cp, head_dim]",
        ));
    }
    if shape[1] == 0 || !shape[1].is_multiple_of(2) {
        return Err(Error::config(
            OP,
            format!(
                "each rank holds two equal chunks of the sequence, so its {} positions must \
                 be even and nonzero",
                shape[1]
            ),
        ));
    }
    let op = Arc::new(RingAttention {
        group: group.clone(),
        scale,
        causal,
    });
    Ok(Tensor::apply(op, &[query, key, value])?)
}

/// The recorded op of [`ring_attention`].
struct RingAttention {
    group: Arc<dyn Communicator>,
    scale: f64,
    causal: bool,
}

type TapeResult<T> = ferrotron_tape::Result<T>;

/// `t` computed on in f32, whatever its storage.
fn wide(t: &Tensor) -> TapeResult<Tensor> {
    match t.dtype() {
        DType::F32 => Ok(t.clone()),
        _ => t.to_dtype(DType::F32),
    }
}

/// Chunk `which` (0 or 1) of a rank's `[b, 2c, d]` tensor.
fn chunk(t: &Tensor, which: usize) -> TapeResult<Tensor> {
    let c = t.shape()[1] / 2;
    t.narrow(1, which * c, c)
}

/// The elementwise maximum of two `[b, c, 1]` tensors.
fn maximum(a: &Tensor, b: &Tensor) -> TapeResult<Tensor> {
    Tensor::concat(&[a, b], 2)?.max_dim(2, true)
}

impl RingAttention {
    fn fail(&self, error: impl std::fmt::Display) -> ferrotron_tape::Error {
        ferrotron_tape::Error::custom("ring attention", error.to_string())
    }

    /// Sends `t` to the next rank of the ring and returns what the previous one sent.
    fn pass_on(&self, t: Tensor) -> TapeResult<Tensor> {
        let (rank, size) = (self.group.rank(), self.group.size());
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        let received = Tensor::<f32>::full_as(t.shape(), 0.0, t.dtype(), t.device())?;
        let outgoing = t.into_buffer()?;
        let mut incoming = received.into_buffer()?;
        let exchanged = self.group.exchange(&mut [
            P2p::Send {
                buf: outgoing.as_buf_ref(),
                peer: next,
            },
            P2p::Recv {
                buf: incoming.as_buf_mut(),
                peer: prev,
            },
        ]);
        exchanged.map_err(|e| self.fail(e))?;
        Tensor::from_buffer(incoming)
    }

    /// [`pass_on`](Self::pass_on) of `t` while `work` runs: on the CPU the transfer
    /// runs on a helper thread, so the next block travels while this one is computed.
    /// Device tensors travel after the work, on the rank's own thread, in stream order.
    fn pass_on_during<R>(
        &self,
        t: &Tensor,
        work: impl FnOnce() -> TapeResult<R>,
    ) -> TapeResult<(Tensor, R)> {
        if t.device() != Device::Cpu {
            let done = work()?;
            return Ok((self.pass_on(t.clone())?, done));
        }
        std::thread::scope(|scope| {
            let transfer = scope.spawn(|| self.pass_on(t.clone()));
            let done = work();
            let received = transfer
                .join()
                .map_err(|_| self.fail("the ring's transfer thread panicked"))?;
            Ok((received?, done?))
        })
    }

    /// The scaled scores of query chunk `q` against key chunk `k`, the causal mask
    /// applied when `diagonal`.
    fn scores(&self, q: &Tensor, k: &Tensor, diagonal: bool) -> TapeResult<Tensor> {
        let scores = q.matmul_transposed(k)?.scale(self.scale)?;
        match diagonal {
            true => scores.masked_fill(&causal_mask(q.shape()[1]), f32::NEG_INFINITY),
            false => Ok(scores),
        }
    }
}

/// A query chunk's result so far: the output over the blocks seen, normalised, and each
/// query's log-sum-exp over them (`[b, c, 1]`).
struct Running {
    out: Tensor,
    lse: Tensor,
}

impl Running {
    /// Adds a block's normalised output and log-sum-exp: each side weighted by
    /// `exp(lse_side − lse)`, `lse` the log-sum-exp of both.
    fn add(this: Option<Running>, block: Running) -> TapeResult<Running> {
        let Some(this) = this else {
            return Ok(block);
        };
        let max = maximum(&this.lse, &block.lse)?;
        let (old, new) = (this.lse.sub(&max)?.exp()?, block.lse.sub(&max)?.exp()?);
        let total = old.add(&new)?;
        Ok(Running {
            out: this
                .out
                .mul(&old)?
                .add(&block.out.mul(&new)?)?
                .div(&total)?,
            lse: max.add(&total.log()?)?,
        })
    }
}

impl RingAttention {
    /// Whether the blocks run the fused kernel (every CPU head width; on a device, the
    /// widths its tiles hold, or its tensor cores take).
    fn fused(&self, q: &Tensor) -> bool {
        let (device, width) = (q.device(), q.shape()[2]);
        fused_attention_takes::<f32>(device, width)
            || tensor_core_attention_takes(device, q.dtype(), width)
    }

    /// One block's normalised output and log-sum-exp: fused, or composed from its scores.
    fn block(&self, q: &Tensor, k: &Tensor, v: &Tensor, diagonal: bool) -> TapeResult<Running> {
        if self.fused(q) {
            let block = attention_block(q, k, v, self.scale, diagonal)?;
            let lse = block.lse.reshape(&[q.shape()[0], q.shape()[1], 1])?;
            return Ok(Running {
                out: block.out,
                lse,
            });
        }
        let scores = self.scores(q, k, diagonal)?;
        let max = scores.max_dim(2, true)?;
        let probs = scores.sub(&max)?.exp()?;
        let sum = probs.sum_dim(2, true)?;
        Ok(Running {
            out: probs.matmul(v)?.div(&sum)?,
            lse: max.add(&sum.log()?)?,
        })
    }

    /// One block's share of the query, key and value gradients, from the whole
    /// attention's output `out`, its gradient and log-sum-exp (`[b, c, 1]`) for the
    /// block's queries, and `correction = Σ dO ⊙ out` per query.
    fn block_backward(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (out, d_out, lse, correction): (&Tensor, &Tensor, &Tensor, &Tensor),
        diagonal: bool,
    ) -> TapeResult<[Tensor; 3]> {
        if self.fused(q) {
            let lse = lse.reshape(&[q.shape()[0], q.shape()[1]])?;
            return attention_block_backward((q, k, v), out, d_out, &lse, self.scale, diagonal);
        }
        let probs = self.scores(q, k, diagonal)?.sub(lse)?.exp()?;
        let d_probs = d_out.matmul_transposed(v)?;
        let d_scores = probs.mul(&d_probs.sub(correction)?)?.scale(self.scale)?;
        Ok([
            d_scores.matmul(k)?,
            d_scores.transpose(1, 2)?.matmul(q)?,
            probs.transpose(1, 2)?.matmul(d_out)?,
        ])
    }
}

impl CustomOp for RingAttention {
    fn name(&self) -> &str {
        "ring attention"
    }

    fn forward(&self, inputs: &[Tensor], saved: &mut Vec<Tensor>) -> TapeResult<Tensor> {
        let (rank, size) = (self.group.rank(), self.group.size());
        let query = wide(&inputs[0])?;
        let heads = query.shape()[0];
        // Keys and values travel together: [k; v].
        let mut visiting = Tensor::concat(&[&wide(&inputs[1])?, &wide(&inputs[2])?], 0)?;
        let mut running: [Option<Running>; 2] = [None, None];
        let blocks = ring_blocks(rank, size, self.causal);
        for step in 0..size {
            let (key, value) = (
                visiting.narrow(0, 0, heads)?,
                visiting.narrow(0, heads, heads)?,
            );
            let mut compute = || -> TapeResult<()> {
                for block in blocks.iter().filter(|b| b.step == step) {
                    let (q, k) = (chunk(&query, block.query)?, chunk(&key, block.key)?);
                    let v = chunk(&value, block.key)?;
                    let result = self.block(&q, &k, &v, block.diagonal)?;
                    let slot = &mut running[block.query];
                    *slot = Some(Running::add(slot.take(), result)?);
                }
                Ok(())
            };
            // The next block travels while this one is computed.
            match step + 1 < size {
                true => visiting = self.pass_on_during(&visiting, compute)?.0,
                false => compute()?,
            }
        }
        // Every query sees at least its own position, so both chunks have a result.
        let [Some(first), Some(second)] = running else {
            return Err(self.fail("internal: a query chunk attended to nothing"));
        };
        let out = Tensor::concat(&[&first.out, &second.out], 1)?;
        let lse = Tensor::concat(&[&first.lse, &second.lse], 1)?;
        saved.extend(inputs.iter().cloned());
        saved.push(out.clone());
        saved.push(lse);
        out.to_dtype(inputs[0].dtype())
    }

    fn backward(&self, grad: &Tensor, saved: &[Tensor]) -> TapeResult<Vec<Option<Tensor>>> {
        let (rank, size) = (self.group.rank(), self.group.size());
        let [query, key, value, out, lse] = saved else {
            return Err(self.fail("internal: backward without its saved tensors"));
        };
        let dtype = query.dtype();
        let (query, grad) = (wide(query)?, wide(grad)?);
        let heads = query.shape()[0];
        // D = rowsum(dO ∘ O), the softmax backward's correction per query.
        let correction = grad.mul(out)?.sum_dim(2, true)?;
        let zeros = Tensor::<f32>::full_as(query.shape(), 0.0, DType::F32, query.device())?;
        let mut grad_query = [chunk(&zeros, 0)?, chunk(&zeros, 1)?];
        // Keys and values travel ahead, [k; v]; their gradients follow, [dk; dv], each
        // rank adding its part, and arrive home after the last hop.
        let mut visiting = Tensor::concat(&[&wide(key)?, &wide(value)?], 0)?;
        let mut gradients = Tensor::concat(&[&zeros, &zeros], 0)?;
        let blocks = ring_blocks(rank, size, self.causal);
        for step in 0..size {
            let (key, value) = (
                visiting.narrow(0, 0, heads)?,
                visiting.narrow(0, heads, heads)?,
            );
            let mut compute = || -> TapeResult<Tensor> {
                let part =
                    |i: usize, which: usize| chunk(&gradients.narrow(0, i * heads, heads)?, which);
                let mut grad_kv = [[part(0, 0)?, part(0, 1)?], [part(1, 0)?, part(1, 1)?]];
                for block in blocks.iter().filter(|b| b.step == step) {
                    let (q, k, v) = (
                        chunk(&query, block.query)?,
                        chunk(&key, block.key)?,
                        chunk(&value, block.key)?,
                    );
                    let rows = [out, &grad, lse, &correction].map(|t| chunk(t, block.query));
                    let [out, d_out, lse, correction] = rows;
                    let [d_query, d_key, d_value] = self.block_backward(
                        (&q, &k, &v),
                        (&out?, &d_out?, &lse?, &correction?),
                        block.diagonal,
                    )?;
                    let slot = &mut grad_query[block.query];
                    *slot = slot.add(&d_query)?;
                    grad_kv[0][block.key] = grad_kv[0][block.key].add(&d_key)?;
                    grad_kv[1][block.key] = grad_kv[1][block.key].add(&d_value)?;
                }
                let [[dk0, dk1], [dv0, dv1]] = &grad_kv;
                let (dk, dv) = (
                    Tensor::concat(&[dk0, dk1], 1)?,
                    Tensor::concat(&[dv0, dv1], 1)?,
                );
                Tensor::concat(&[&dk, &dv], 0)
            };
            let added = match step + 1 < size {
                true => {
                    let (next, added) = self.pass_on_during(&visiting, compute)?;
                    visiting = next;
                    added
                }
                false => compute()?,
            };
            gradients = match size {
                1 => added,
                _ => self.pass_on(added)?,
            };
        }
        let grad_query = Tensor::concat(&[&grad_query[0], &grad_query[1]], 1)?;
        let (grad_key, grad_value) = (
            gradients.narrow(0, 0, heads)?,
            gradients.narrow(0, heads, heads)?,
        );
        [grad_query, grad_key, grad_value]
            .iter()
            .map(|g| g.to_dtype(dtype).map(Some))
            .collect()
    }
}
