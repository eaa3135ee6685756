//! Context parallelism: ring attention over cp ∈ {2, 3, 4} ranks equals attention on one
//! rank — the output and the gradients of the queries, keys and values, causal and not, on
//! the CPU and the emulated device, in f32 and bf16 — every rank computes the same number
//! of blocks under the causal mask, and tensor-parallel attention (with and without
//! sequence parallelism) over a TP 2 × CP 2 layout equals the serial layer.

mod common;

use std::sync::Arc;

use common::{AnyResult, RTOL};
use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, ReduceOp};
use ferrotron_layers::{
    context_parallel_chunks, ring_attention, ring_blocks, BlockConfig, MasterInit, Module,
    ParallelSelfAttention, TensorParallel,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{DType, Device, Generator, Parameter, Tape, Tensor};

const HEADS: usize = 3;
const DIM: usize = 4;

/// This rank's two chunks of `t` along `dim`.
fn local(t: &Tensor, dim: usize, rank: usize, cp: usize) -> AnyResult<Tensor> {
    let [(a, len), (b, _)] = context_parallel_chunks(t.shape()[dim], rank, cp)?;
    Ok(Tensor::concat(
        &[&t.narrow(dim, a, len)?, &t.narrow(dim, b, len)?],
        dim,
    )?)
}

/// The whole sequence back from every rank's two chunks along `dim`.
fn whole(parts: &[Vec<f32>], shape: &[usize], dim: usize) -> AnyResult<Tensor> {
    let cp = parts.len();
    let mut local_shape = shape.to_vec();
    local_shape[dim] /= cp;
    let c = local_shape[dim] / 2;
    let mut chunks: Vec<Option<Tensor>> = vec![None; 2 * cp];
    for (rank, part) in parts.iter().enumerate() {
        let t = Tensor::from_vec(part.clone(), &local_shape)?;
        chunks[rank] = Some(t.narrow(dim, 0, c)?);
        chunks[2 * cp - 1 - rank] = Some(t.narrow(dim, c, c)?);
    }
    let chunks: Vec<Tensor> = chunks.into_iter().flatten().collect();
    Ok(Tensor::concat(&chunks.iter().collect::<Vec<_>>(), dim)?)
}

/// Attention on one rank: the output and the gradients of q, k, v for loss Σ out ∘ w.
fn reference(inputs: &[Tensor; 4], causal: bool) -> AnyResult<Vec<Vec<f32>>> {
    let params: Vec<Parameter> = ["q", "k", "v"]
        .iter()
        .zip(inputs)
        .map(|(name, t)| Parameter::new(*name, t.clone()))
        .collect();
    let tape = Tape::new();
    let [q, k, v] = [0, 1, 2].map(|i| tape.watch(&params[i]));
    let (q, k, v) = (q?, k?, v?);
    let scale = 1.0 / (inputs[0].shape()[2] as f64).sqrt();
    let probs = match causal {
        true => q.matmul_transposed(&k)?.causal_softmax(scale)?,
        false => q.matmul_transposed(&k)?.scale(scale)?.softmax()?,
    };
    let out = probs.matmul(&v)?;
    out.mul(&inputs[3])?.sum()?.backward()?;
    let mut results = vec![out.to_vec()?];
    for p in &params {
        results.push(p.grad().expect("a gradient").to_vec()?);
    }
    Ok(results)
}

/// The same through ring attention on `cp` rank threads, reassembled.
fn ring(
    inputs: &[Tensor; 4],
    cp: usize,
    causal: bool,
    device: Device,
    dtype: DType,
) -> AnyResult<Vec<Vec<f32>>> {
    let per_rank = run_local(cp, |comm| -> AnyResult<Vec<Vec<f32>>> {
        let rank = comm.rank();
        let group: Arc<dyn Communicator> = Arc::new(comm);
        let mine = |t: &Tensor| -> AnyResult<Tensor> {
            Ok(local(t, 1, rank, cp)?.to_device(device)?.to_dtype(dtype)?)
        };
        let params: Vec<Parameter> = ["q", "k", "v"]
            .iter()
            .zip(inputs)
            .map(|(name, t)| Ok(Parameter::new(*name, mine(t)?)))
            .collect::<AnyResult<_>>()?;
        let tape = Tape::new();
        let [q, k, v] = [0, 1, 2].map(|i| tape.watch(&params[i]));
        let (q, k, v) = (q?, k?, v?);
        let scale = 1.0 / (inputs[0].shape()[2] as f64).sqrt();
        let out = ring_attention(&q, &k, &v, &group, scale, causal)?;
        assert_eq!(out.dtype(), dtype);
        out.mul(&mine(&inputs[3])?)?.sum()?.backward()?;
        let mut results = vec![out.to_vec()?];
        for p in &params {
            results.push(p.grad().expect("a gradient").to_vec()?);
        }
        Ok(results)
    })?;
    let shape = inputs[0].shape();
    (0..4)
        .map(|i| {
            let parts: Vec<Vec<f32>> = per_rank.iter().map(|r| r[i].clone()).collect();
            Ok(whole(&parts, shape, 1)?.to_vec()?)
        })
        .collect()
}

fn inputs(seq: usize, seed: u64) -> [Tensor; 4] {
    inputs_of(seq, DIM, seed)
}

fn inputs_of(seq: usize, dim: usize, seed: u64) -> [Tensor; 4] {
    let mut rng = Generator::new(seed);
    [0; 4].map(|_| Tensor::randn(&[2 * HEADS, seq, dim], 1.0, &mut rng))
}

fn assert_all_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tolerance: f32) {
    for (i, name) in ["output", "dq", "dk", "dv"].iter().enumerate() {
        let worst = got[i]
            .iter()
            .zip(&want[i])
            .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
            .fold(0.0f32, f32::max);
        assert!(worst <= tolerance, "{what}: {name} differs by {worst}");
    }
}

#[test]
fn ring_attention_equals_one_rank_for_every_cp_causal_or_not() -> AnyResult<()> {
    for cp in [1, 2, 3, 4] {
        for causal in [true, false] {
            let inputs = inputs(4 * cp, cp as u64);
            let want = reference(&inputs, causal)?;
            let got = ring(&inputs, cp, causal, Device::Cpu, DType::F32)?;
            assert_all_close(&format!("cp={cp} causal={causal}"), &got, &want, 1e-5);
        }
    }
    Ok(())
}

#[test]
fn ring_attention_on_the_emulated_device_equals_one_rank() -> AnyResult<()> {
    for (cp, causal) in [(2, true), (3, false), (4, true)] {
        let inputs = inputs(2 * cp, 10 + cp as u64);
        let want = reference(&inputs, causal)?;
        let got = ring(&inputs, cp, causal, Device::Emulated, DType::F32)?;
        assert_all_close(
            &format!("emulated cp={cp} causal={causal}"),
            &got,
            &want,
            1e-5,
        );
    }
    Ok(())
}

#[test]
fn heads_wider_than_the_fused_kernel_takes_run_composed_blocks() -> AnyResult<()> {
    // Blocks of head width 136 on a device are products and a softmax, not the fused
    // kernel (which takes up to 128); the ring merges them the same way.
    for (cp, causal) in [(2, true), (2, false)] {
        let inputs = inputs_of(4 * cp, 136, 30 + cp as u64);
        let want = reference(&inputs, causal)?;
        let got = ring(&inputs, cp, causal, Device::Emulated, DType::F32)?;
        assert_all_close(&format!("wide cp={cp} causal={causal}"), &got, &want, 1e-5);
    }
    Ok(())
}

#[test]
fn ring_attention_in_bf16_is_within_the_format() -> AnyResult<()> {
    // On the CPU, and on the emulated device's tensor cores (heads 64 and 128 wide).
    for (device, dim) in [
        (Device::Cpu, DIM),
        (Device::Emulated, 64),
        (Device::Emulated, 128),
    ] {
        // The inputs rounded to bf16 first, so the two differ only by the ring's rounding.
        let inputs = inputs_of(8, dim, 21).map(|t| {
            t.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        });
        let want = reference(&inputs, true)?;
        let got = ring(&inputs, 2, true, device, DType::BF16)?;
        // bf16 keeps 8 bits: one rounding of the output and of each gradient (and, on
        // tensor cores, of the probabilities and dS before their products).
        assert_all_close(
            &format!("bf16 cp=2 {device} d={dim}"),
            &got,
            &want,
            2.0f32.powi(-7),
        );
    }
    Ok(())
}

#[test]
fn every_rank_computes_the_same_number_of_blocks() {
    for cp in 1..=8 {
        for causal in [true, false] {
            let mut seen = std::collections::BTreeSet::new();
            for rank in 0..cp {
                let blocks = ring_blocks(rank, cp, causal);
                let expected = if causal { 2 * cp + 1 } else { 4 * cp };
                assert_eq!(
                    blocks.len(),
                    expected,
                    "cp={cp} rank={rank} causal={causal}"
                );
                for b in blocks {
                    let owner = (rank + cp - b.step) % cp;
                    let global = |who: usize, which: usize| match which {
                        0 => who,
                        _ => 2 * cp - 1 - who,
                    };
                    let (q, k) = (global(rank, b.query), global(owner, b.key));
                    assert_eq!(b.diagonal, causal && q == k);
                    assert!(seen.insert((q, k)), "block ({q}, {k}) computed twice");
                }
            }
            // Together the ranks compute every visible block once.
            let visible = (0..2 * cp)
                .flat_map(|q| (0..2 * cp).map(move |k| (q, k)))
                .filter(|&(q, k)| !causal || k <= q)
                .count();
            assert_eq!(seen.len(), visible);
        }
    }
}

#[test]
fn chunks_are_megatrons_balanced_split_and_bad_lengths_are_errors() -> AnyResult<()> {
    assert_eq!(context_parallel_chunks(16, 0, 2)?, [(0, 4), (12, 4)]);
    assert_eq!(context_parallel_chunks(16, 1, 2)?, [(4, 4), (8, 4)]);
    let err = context_parallel_chunks(18, 0, 2).unwrap_err().to_string();
    assert!(err.contains("multiple of 4"), "{err}");
    assert!(context_parallel_chunks(16, 2, 2).is_err());
    Ok(())
}

const SEQ: usize = 8;
const BATCH: usize = 2;
const HIDDEN: usize = 12;

/// One rank's output, input gradient and named parameter gradients.
type Run = (Vec<f32>, Vec<f32>, Vec<(String, Vec<f32>)>);

/// Tensor-parallel attention over `world` ranks with tensor parallel `tp` and context
/// parallel `cp`: each rank's output and input gradient (its positions: its CP chunks,
/// then its SP part) and every parameter gradient summed over the CP group.
fn attention(tp: usize, cp: usize, sp: bool, x: &Tensor, w: &Tensor) -> AnyResult<Vec<Run>> {
    let layout = RankLayout::builder(tp * cp).tp(tp).cp(cp).build()?;
    Ok(run_local(tp * cp, |comm| -> AnyResult<_> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let ctx = TensorParallel::from_state(&state).with_sequence_parallel(sp);
        let config = BlockConfig::new(HIDDEN, 6);
        let layer = ParallelSelfAttention::new(&ctx, "attn", &config, &MasterInit::new(7, 0.3))?;
        let mine = |t: &Tensor| -> AnyResult<Tensor> {
            let t = local(t, 0, state.cp_rank(), cp)?;
            if !sp {
                return Ok(t);
            }
            let (start, len) = ctx.part(t.shape()[0])?;
            Ok(t.narrow(0, start, len)?)
        };
        let input = Parameter::new("x", mine(x)?);
        let tape = Tape::new();
        let out = layer.forward_inference(&tape, &tape.watch(&input)?)?;
        out.mul(&mine(w)?)?.sum()?.backward()?;
        let mut grads = Vec::new();
        for p in layer.parameters() {
            let grad = p.param.grad().expect("a gradient");
            // Each CP rank's gradient covers its positions; the sum covers them all.
            let mut values = grad.to_vec()?;
            state.cp().all_reduce_slice(&mut values, ReduceOp::Sum)?;
            // Under SP so does each TP rank's gradient of a replicated bias.
            if p.grad_reduce_group.is_some() {
                state.tp().all_reduce_slice(&mut values, ReduceOp::Sum)?;
            }
            grads.push((p.param.name().to_string(), values));
        }
        Ok((
            out.to_vec()?,
            input.grad().expect("an input gradient").to_vec()?,
            grads,
        ))
    })?)
}

#[test]
fn tensor_parallel_attention_over_cp_equals_the_serial_layer() -> AnyResult<()> {
    let mut rng = Generator::new(3);
    let x = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let w = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let serial = attention(1, 1, false, &x, &w)?;
    for (tp, cp, sp) in [(1, 2, false), (2, 2, false), (2, 2, true), (1, 4, false)] {
        let what = format!("tp={tp} cp={cp} sp={sp}");
        let runs = attention(tp, cp, sp, &x, &w)?;
        // Ranks are TP-fastest: rank = tp_rank + tp · cp_rank.
        for (name, index) in [("output", 0), ("input gradient", 1)] {
            let mut parts = Vec::new();
            for cp_rank in 0..cp {
                // Under SP the TP ranks hold consecutive parts of the CP rank's positions.
                let ranks = (0..tp).map(|t| t + tp * cp_rank);
                let part: Vec<f32> = match sp {
                    true => ranks.flat_map(|r| pick(&runs[r], index).clone()).collect(),
                    false => pick(&runs[tp * cp_rank], index).clone(),
                };
                parts.push(part);
            }
            let got = whole(&parts, &[SEQ, BATCH, HIDDEN], 0)?.to_vec()?;
            close(&format!("{what}: {name}"), &got, pick(&serial[0], index));
        }
        // Parameter gradients: each TP rank's shard of the serial gradient.
        for (rank, run) in runs.iter().enumerate().take(tp) {
            for ((name, got), (_, want)) in run.2.iter().zip(&serial[0].2) {
                let shard = shard_of(name, want, rank, tp);
                close(&format!("{what}: {name} on tp rank {rank}"), got, &shard);
            }
        }
    }
    Ok(())
}

fn pick(run: &Run, index: usize) -> &Vec<f32> {
    match index {
        0 => &run.0,
        _ => &run.1,
    }
}

/// TP rank `rank`'s part of a serial gradient: the QKV weight's and bias's rows (whole
/// heads, laid out head by head) and the projection's columns are split among the ranks;
/// the projection's bias is whole.
fn shard_of(name: &str, serial: &[f32], rank: usize, tp: usize) -> Vec<f32> {
    let rows = |width: usize| {
        let per = serial.len() / width / tp;
        serial[rank * per * width..(rank + 1) * per * width].to_vec()
    };
    match name {
        "attn.qkv.weight" => rows(HIDDEN),
        "attn.qkv.bias" => rows(1),
        "attn.proj.weight" => serial
            .chunks(HIDDEN)
            .flat_map(|row| row[rank * HIDDEN / tp..(rank + 1) * HIDDEN / tp].to_vec())
            .collect(),
        _ => serial.to_vec(),
    }
}

/// `common::assert_close`'s rule on plain vectors.
fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= RTOL * (w.abs() + scale),
            "{what}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

/// A batch cut for each rank, joined again in the order of the positions each rank says
/// it holds, is the batch: every position once, on the rank `context_parallel_position`
/// names, at the index it names; and a batch of the wrong size is refused.
#[test]
fn a_batch_cut_over_the_ranks_is_every_position_once_where_its_rank_says() -> AnyResult<()> {
    use ferrotron_layers::{context_parallel_batch, context_parallel_position};
    let (seq, rows) = (24, 3);
    let batch: Vec<usize> = (0..seq * rows).collect();
    for cp in [1, 2, 3, 4] {
        let parts: Vec<Vec<usize>> = (0..cp)
            .map(|rank| context_parallel_batch(&batch, seq, rows, rank, cp))
            .collect::<std::result::Result<_, _>>()?;
        for at in 0..seq {
            let (rank, local) = context_parallel_position(at, seq, cp)?;
            let row = &parts[rank][local * rows..(local + 1) * rows];
            assert_eq!(
                row,
                &batch[at * rows..(at + 1) * rows],
                "cp {cp}, position {at}"
            );
        }
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), seq * rows);
    }
    assert!(context_parallel_batch(&batch[1..], seq, rows, 0, 2).is_err());
    assert!(context_parallel_batch(&batch, 20, rows, 0, 3).is_err());
    assert!(context_parallel_position(seq, seq, 2).is_err());
    Ok(())
}
