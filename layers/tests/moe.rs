//! The mixture of experts at expert-parallel sizes 2 and 4 (and EP 2 × TP 2 inside the
//! experts) equals one rank holding every expert: outputs, the auxiliary loss and every
//! gradient within 1e-5, with uneven tokens per rank and per expert, an expert that gets
//! no token, both softmax placements, and a capacity factor that drops the same tokens.
//! The one-rank layer itself is checked against a plain per-token computation from its
//! weights (routing, weights, experts, combination and the auxiliary losses). A rank
//! whose experts get no token still runs backward with its peers; a shared expert adds
//! a dense MLP's output; experts split unlike their block are refused.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{AnyResult, RTOL};
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_layers::{
    BlockConfig, ExpertParallel, MasterInit, Module, MoeConfig, MoeMlp, RouterSoftmax,
    TensorParallel, TransformerBlock,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const HIDDEN: usize = 8;
const EXPERTS: usize = 4;
/// The expert no token is routed to: its router row is strongly negative and every
/// input is positive.
const IDLE: usize = 3;

fn block() -> BlockConfig {
    BlockConfig::new(HIDDEN, 2)
}

fn init() -> MasterInit {
    MasterInit::new(11, 0.3).with_bias_std(0.1)
}

/// Data rank `r`'s tokens (`2 + r` positions: uneven) and its loss weights.
fn shard(r: usize) -> (Tensor, Tensor) {
    let mut rng = Generator::new(40 + r as u64);
    let x = Tensor::randn(&[2 + r, 3, HIDDEN], 1.0, &mut rng);
    let x = x.mul(&x).unwrap(); // positive, so the idle expert stays idle
    (x, Tensor::randn(&[2 + r, 3, HIDDEN], 1.0, &mut rng))
}

/// One data rank's results: output, aux loss, input gradient, tokens per expert, drops.
type Shard = (Vec<f32>, f32, Vec<f32>, Vec<usize>, usize);

/// Gradients by parameter name.
type Grads = BTreeMap<String, Vec<f32>>;

/// Router weights every run shares: the init's, with the idle expert's row at -3.
fn set_router(moe: &MoeMlp) -> AnyResult<()> {
    let router = &moe.router_parameters()[0].param;
    let mut w = router.value()?.to_vec()?;
    w[IDLE * HIDDEN..(IDLE + 1) * HIDDEN].fill(-3.0);
    router.set_value(Tensor::from_vec(w, &[EXPERTS, HIDDEN])?)?;
    Ok(())
}

/// The layer on one rank holding every expert.
fn one_rank(comm: ferrotron_comm_core::LocalCommunicator, config: &MoeConfig) -> AnyResult<MoeMlp> {
    let group: Arc<dyn Communicator> = Arc::new(comm);
    let ctx = ExpertParallel::new(group.clone(), group);
    Ok(MoeMlp::new(&ctx, "moe", &block(), config, &init())?)
}

/// `moe` on data rank `r`'s tokens, loss Σ output ∘ w + aux, backward.
fn step(moe: &MoeMlp, r: usize) -> AnyResult<Shard> {
    let (x, w) = shard(r);
    let input = Parameter::new("x", x);
    let tape = Tape::new();
    let out = moe.forward(&tape, &tape.watch(&input)?)?;
    out.output.mul(&w)?.sum()?.add(&out.aux_loss)?.backward()?;
    Ok((
        out.output.to_vec()?,
        out.aux_loss.item()?,
        input.grad().expect("an input gradient").to_vec()?,
        out.tokens_per_expert,
        out.dropped,
    ))
}

/// Every parameter's gradient by name (zeros where none arrived), full size.
fn grads(moe: &MoeMlp) -> AnyResult<Grads> {
    let mut all = BTreeMap::new();
    for p in moe.parameters() {
        let value = p.param.value()?;
        let grad = match p.param.grad() {
            Some(g) => g.to_vec()?,
            None => vec![0.0; value.to_vec()?.len()],
        };
        all.insert(p.param.name().to_string(), grad);
    }
    Ok(all)
}

/// One rank with every expert, run on each data rank's tokens in turn (the gradients
/// accumulate: their sum is what data parallelism reduces).
fn reference(config: &MoeConfig, data_ranks: usize) -> AnyResult<(Vec<Shard>, Grads)> {
    let mut results = run_local(1, |comm| -> AnyResult<_> {
        let moe = one_rank(comm, config)?;
        set_router(&moe)?;
        let shards = (0..data_ranks)
            .map(|r| step(&moe, r))
            .collect::<AnyResult<Vec<_>>>()?;
        Ok((shards, grads(&moe)?))
    })?;
    Ok(results.swap_remove(0))
}

/// `tp × ep` ranks: each TP group one data rank, experts divided among EP.
fn parallel(
    config: &MoeConfig,
    tp: usize,
    ep: usize,
) -> AnyResult<Vec<(usize, Shard, Grads, usize)>> {
    let layout = RankLayout::builder(tp * ep).tp(tp).ep(ep).build()?;
    Ok(run_local(tp * ep, |comm| -> AnyResult<_> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let moe = MoeMlp::new(
            &ExpertParallel::from_state(&state),
            "moe",
            &block(),
            config,
            &init(),
        )?;
        set_router(&moe)?;
        let shard = step(&moe, state.dp_rank())?;
        Ok((state.dp_rank(), shard, grads(&moe)?, state.tp_rank()))
    })?)
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= RTOL * (w.abs() + scale) + 1e-7,
            "{what}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

/// Rank `tp_rank`'s part of a full expert gradient, cut as `ParallelMlp` cuts it.
fn expert_shard(name: &str, full: &[f32], tp_rank: usize, tp: usize) -> Vec<f32> {
    let ffn = MOE_FFN;
    let part = ffn / tp;
    if name.ends_with("fc1.weight") {
        full[tp_rank * part * HIDDEN..(tp_rank + 1) * part * HIDDEN].to_vec()
    } else if name.ends_with("fc1.bias") {
        full[tp_rank * part..(tp_rank + 1) * part].to_vec()
    } else if name.ends_with("fc2.weight") {
        full.chunks(ffn)
            .flat_map(|row| row[tp_rank * part..(tp_rank + 1) * part].to_vec())
            .collect()
    } else {
        full.to_vec()
    }
}

const MOE_FFN: usize = 6;

fn check(what: &str, config: &MoeConfig, tp: usize, ep: usize) -> AnyResult<()> {
    let (shards, want) = reference(config, ep)?;
    let runs = parallel(config, tp, ep)?;
    let mut router = vec![0.0f32; EXPERTS * HIDDEN];
    for (data_rank, (out, aux, dx, counts, dropped), grads, tp_rank) in &runs {
        let (w_out, w_aux, w_dx, w_counts, w_dropped) = &shards[*data_rank];
        close(
            &format!("{what}: output of data rank {data_rank}"),
            out,
            w_out,
        );
        close(
            &format!("{what}: aux loss of data rank {data_rank}"),
            &[*aux],
            &[*w_aux],
        );
        close(
            &format!("{what}: input gradient of data rank {data_rank}"),
            dx,
            w_dx,
        );
        assert_eq!(counts, w_counts, "{what}: tokens per expert");
        assert_eq!(dropped, w_dropped, "{what}: dropped slots");
        assert_eq!(counts[IDLE], 0, "{what}: the idle expert got tokens");
        for (name, grad) in grads {
            if name == "moe.router.weight" {
                if *tp_rank == 0 {
                    router.iter_mut().zip(grad).for_each(|(a, g)| *a += g);
                }
                continue;
            }
            let full = &want[name];
            close(
                &format!("{what}: {name} on tp rank {tp_rank}"),
                grad,
                &expert_shard(name, full, *tp_rank, tp),
            );
        }
    }
    close(
        &format!("{what}: router gradient summed over data ranks"),
        &router,
        &want["moe.router.weight"],
    );
    Ok(())
}

fn config(top_k: usize, softmax: RouterSoftmax, capacity: Option<f64>) -> MoeConfig {
    MoeConfig {
        softmax,
        z_loss_coeff: 1e-3,
        capacity_factor: capacity,
        aux_loss_coeff: 0.1,
        ..MoeConfig::new(EXPERTS, top_k, MOE_FFN)
    }
}

#[test]
fn expert_parallel_moe_equals_one_rank_dropless() -> AnyResult<()> {
    for (tp, ep) in [(1, 2), (1, 4), (2, 2)] {
        for (k, softmax) in [
            (1, RouterSoftmax::AfterTopK),
            (2, RouterSoftmax::AfterTopK),
            (2, RouterSoftmax::BeforeTopK),
        ] {
            let what = format!("tp={tp} ep={ep} top-{k} {softmax:?}");
            check(&what, &config(k, softmax, None), tp, ep)?;
        }
    }
    Ok(())
}

#[test]
fn a_capacity_factor_drops_the_same_tokens_as_one_rank() -> AnyResult<()> {
    let config = config(2, RouterSoftmax::AfterTopK, Some(0.5));
    let (shards, _) = reference(&config, 2)?;
    assert!(
        shards.iter().all(|s| s.4 > 0),
        "capacity 0.5 should drop slots"
    );
    check("capacity 0.5", &config, 1, 2)?;
    check("capacity 0.5 tp 2", &config, 2, 2)
}

#[test]
fn bad_configurations_are_refused() -> AnyResult<()> {
    run_local(2, |comm| -> AnyResult<()> {
        let group: Arc<dyn Communicator> = Arc::new(comm);
        // Checked before anything is built or exchanged.
        let ctx = ExpertParallel::new(group.clone(), group);
        let odd = MoeMlp::new(&ctx, "moe", &block(), &MoeConfig::new(3, 1, 4), &init());
        assert!(odd.err().unwrap().to_string().contains("experts"));
        let wide = MoeMlp::new(&ctx, "moe", &block(), &MoeConfig::new(4, 5, 4), &init());
        assert!(wide.err().unwrap().to_string().contains("top-5"));
        Ok(())
    })?;
    Ok(())
}

/// GELU, tanh form (the block's default).
fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// The layer's output and aux loss for `x`, token by token from its weights, in f64.
fn plain(config: &MoeConfig, weights: &BTreeMap<String, Vec<f32>>, x: &[f32]) -> (Vec<f64>, f64) {
    let w = |name: &str| -> Vec<f64> { weights[name].iter().map(|&v| v as f64).collect() };
    let router = w("moe.router.weight");
    let tokens = x.len() / HIDDEN;
    let (mut out, mut counts, mut prob_sums, mut z) = (
        vec![0.0; x.len()],
        vec![0.0; EXPERTS],
        vec![0.0; EXPERTS],
        0.0,
    );
    for t in 0..tokens {
        let xt: Vec<f64> = x[t * HIDDEN..(t + 1) * HIDDEN]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let logits: Vec<f64> = (0..EXPERTS)
            .map(|e| (0..HIDDEN).map(|i| router[e * HIDDEN + i] * xt[i]).sum())
            .collect();
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let total: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        let probs: Vec<f64> = logits.iter().map(|l| (l - max).exp() / total).collect();
        z += (max + total.ln()).powi(2);
        let mut order: Vec<usize> = (0..EXPERTS).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let chosen = &order[..config.top_k];
        let chosen_total: f64 = chosen.iter().map(|&e| probs[e]).sum();
        for e in 0..EXPERTS {
            prob_sums[e] += probs[e];
        }
        for &e in chosen {
            counts[e] += 1.0;
            let weight = match config.softmax {
                RouterSoftmax::AfterTopK => probs[e] / chosen_total,
                RouterSoftmax::BeforeTopK => probs[e],
            };
            let name = |p: &str| format!("moe.experts.{e}.{p}");
            let (w1, b1, w2, b2) = (
                w(&name("fc1.weight")),
                w(&name("fc1.bias")),
                w(&name("fc2.weight")),
                w(&name("fc2.bias")),
            );
            let inner: Vec<f64> = (0..MOE_FFN)
                .map(|j| gelu(b1[j] + (0..HIDDEN).map(|i| w1[j * HIDDEN + i] * xt[i]).sum::<f64>()))
                .collect();
            for i in 0..HIDDEN {
                let y = b2[i]
                    + (0..MOE_FFN)
                        .map(|j| w2[i * MOE_FFN + j] * inner[j])
                        .sum::<f64>();
                out[t * HIDDEN + i] += weight * y;
            }
        }
    }
    let k = config.top_k as f64;
    let balance: f64 = (0..EXPERTS).map(|e| prob_sums[e] * counts[e]).sum::<f64>()
        * config.aux_loss_coeff
        * EXPERTS as f64
        / (tokens as f64 * tokens as f64 * k);
    (out, balance + config.z_loss_coeff * z / tokens as f64)
}

#[test]
fn one_rank_moe_is_the_plain_per_token_computation() -> AnyResult<()> {
    for (k, softmax) in [
        (1, RouterSoftmax::AfterTopK),
        (2, RouterSoftmax::AfterTopK),
        (2, RouterSoftmax::BeforeTopK),
    ] {
        let config = config(k, softmax, None);
        let mut results = run_local(1, |comm| -> AnyResult<_> {
            let moe = one_rank(comm, &config)?;
            set_router(&moe)?;
            let weights: BTreeMap<String, Vec<f32>> = moe
                .parameters()
                .iter()
                .map(|p| Ok((p.param.name().to_string(), p.param.value()?.to_vec()?)))
                .collect::<AnyResult<_>>()?;
            let (x, _) = shard(1);
            let out = moe.forward(&Tape::new(), &x)?;
            Ok((
                weights,
                x.to_vec()?,
                out.output.to_vec()?,
                out.aux_loss.item()?,
            ))
        })?;
        let (weights, x, got, aux) = results.swap_remove(0);
        let (want, want_aux) = plain(&config, &weights, &x);
        let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
        close(&format!("top-{k} {softmax:?}: output"), &got, &want);
        close(
            &format!("top-{k} {softmax:?}: aux loss"),
            &[aux],
            &[want_aux as f32],
        );
    }
    Ok(())
}

#[test]
fn a_capacity_factor_keeps_at_most_capacity_slots_per_expert() -> AnyResult<()> {
    let config = config(2, RouterSoftmax::AfterTopK, Some(0.5));
    let (shards, _) = reference(&config, 2)?;
    for (r, (_, _, _, counts, dropped)) in shards.iter().enumerate() {
        let tokens = (2 + r) * 3;
        let capacity = ((tokens * 2) as f64 / EXPERTS as f64 * 0.5).ceil() as usize;
        let over: usize = counts.iter().map(|&n| n.saturating_sub(capacity)).sum();
        assert_eq!(
            *dropped, over,
            "data rank {r}: {counts:?} over capacity {capacity}"
        );
    }
    Ok(())
}

#[test]
fn a_rank_without_tokens_gets_an_empty_output_and_no_auxiliary_loss() -> AnyResult<()> {
    let config = config(2, RouterSoftmax::AfterTopK, None);
    run_local(1, |comm| -> AnyResult<()> {
        let moe = one_rank(comm, &config)?;
        let out = moe.forward(&Tape::new(), &Tensor::zeros(&[0, 3, HIDDEN]))?;
        assert_eq!(out.output.shape(), &[0, 3, HIDDEN]);
        assert_eq!(out.aux_loss.item()?, 0.0);
        assert_eq!(out.tokens_per_expert, vec![0; EXPERTS]);
        Ok(())
    })?;
    Ok(())
}

/// A rank whose experts get no token from anyone still runs its part of backward: with
/// the input off the tape, only the experts' weights put the return trip on it, so an
/// expert skipped for want of rows would leave that rank's collective out and hang its
/// peers. Its experts end with zero gradients (Megatron's), not none.
#[test]
fn a_rank_whose_experts_get_no_token_runs_backward_with_its_peers() -> AnyResult<()> {
    let config = config(2, RouterSoftmax::AfterTopK, None);
    let layout = RankLayout::builder(2).ep(2).build()?;
    let grads = run_local(2, |comm| -> AnyResult<Vec<Vec<f32>>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let moe = MoeMlp::new(
            &ExpertParallel::from_state(&state),
            "moe",
            &block(),
            &config,
            &init(),
        )?;
        // Experts 2 and 3 (rank 1's) never win: their router rows are strongly negative
        // and every input positive.
        let router = &moe.router_parameters()[0].param;
        let mut w = router.value()?.to_vec()?;
        w[2 * HIDDEN..].fill(-3.0);
        router.set_value(Tensor::from_vec(w, &[EXPERTS, HIDDEN])?)?;
        let (x, weights) = shard(state.dp_rank());
        let tape = Tape::new();
        let out = moe.forward(&tape, &x)?;
        assert_eq!(out.tokens_per_expert[2..], [0, 0]);
        out.output
            .mul(&weights)?
            .sum()?
            .add(&out.aux_loss)?
            .backward()?;
        (moe.expert_parameters().iter())
            .map(|p| {
                Ok(p.param
                    .grad()
                    .expect("every expert gets a gradient")
                    .to_vec()?)
            })
            .collect()
    })?;
    assert!(
        grads[1].iter().flatten().all(|&g| g == 0.0),
        "rank 1's experts idle"
    );
    assert!(
        grads[0].iter().flatten().any(|&g| g != 0.0),
        "rank 0's experts work"
    );
    Ok(())
}

/// A shared expert is a dense MLP every token goes through beside the routed experts:
/// the block's output gains exactly that MLP's output on the normed hidden state. Checked
/// as `with shared = without shared + (dense block with the shared expert's weights) −
/// (dense block with a zero MLP)`, every block drawn from the same master weights.
#[test]
fn a_shared_expert_adds_a_dense_mlp_beside_the_routed_ones() -> AnyResult<()> {
    const SHARED: usize = 12;
    run_local(1, |comm| -> AnyResult<()> {
        let group: Arc<dyn Communicator> = Arc::new(comm);
        let tp = TensorParallel::new(group.clone())
            .with_expert_parallel(ExpertParallel::new(group.clone(), group));
        let moe = |shared| MoeConfig {
            shared_expert_ffn: shared,
            ..config(2, RouterSoftmax::AfterTopK, None)
        };
        let with = TransformerBlock::with_experts(&tp, "b", &block(), &moe(Some(SHARED)), &init())?;
        let without = TransformerBlock::with_experts(&tp, "b", &block(), &moe(None), &init())?;
        let dense_config = BlockConfig {
            ffn_hidden: SHARED,
            ..block()
        };
        let (dense, zero) = (
            TransformerBlock::new(&tp, "b", &dense_config, &init())?,
            TransformerBlock::new(&tp, "b", &dense_config, &init())?,
        );
        let shared: BTreeMap<String, Tensor> = (with.parameters().into_iter())
            .filter_map(|p| {
                let suffix = p
                    .param
                    .name()
                    .strip_prefix("b.mlp.shared_expert.")?
                    .to_string();
                assert!(!p.expert, "the shared expert is dense");
                Some(p.param.value().map(|value| (suffix, value)))
            })
            .collect::<ferrotron_tape::Result<_>>()?;
        assert_eq!(shared.len(), 4, "{:?}", shared.keys());
        for (d, z) in dense.parameters().iter().zip(zero.parameters()) {
            if let Some(suffix) = d.param.name().strip_prefix("b.mlp.") {
                d.param.set_value(shared[suffix].clone())?;
                if suffix.starts_with("fc2") {
                    z.param.set_value(Tensor::zeros(&z.param.shape()))?;
                }
            }
        }
        let (x, _) = shard(1);
        let out = |b: &TransformerBlock| -> AnyResult<Vec<f32>> {
            Ok(b.forward_inference(&Tape::new(), &x)?.to_vec()?)
        };
        let (a, b, c, d) = (out(&with)?, out(&without)?, out(&dense)?, out(&zero)?);
        let expected: Vec<f32> = (0..a.len()).map(|i| b[i] + c[i] - d[i]).collect();
        close("with a shared expert", &a, &expected);
        assert!(
            c.iter().zip(&d).any(|(c, d)| (c - d).abs() > 1e-3),
            "the MLP does something"
        );
        // The routed layer alone does not take one.
        let alone = MoeMlp::new(
            tp.expert_parallel().unwrap(),
            "m",
            &block(),
            &moe(Some(4)),
            &init(),
        );
        assert!(alone.err().unwrap().to_string().contains("with_experts"));
        Ok(())
    })?;
    Ok(())
}

/// Tensor-parallel ranks hold the same tokens, so experts in a block must be split over
/// as many ranks as the block: whole experts on each would see every token twice, and
/// experts split over ranks of different tokens would mix them.
#[test]
fn experts_not_split_like_the_block_are_refused() -> AnyResult<()> {
    run_local(2, |comm| -> AnyResult<()> {
        let alone = comm
            .split(Some(comm.rank() as u32), 0, "alone")?
            .expect("every rank has a color");
        let (group, alone): (Arc<dyn Communicator>, Arc<dyn Communicator>) =
            (Arc::new(comm), alone);
        let config = config(2, RouterSoftmax::AfterTopK, None);
        // Whole experts in a TP 2 block, and experts split over 2 ranks of TP 1 blocks
        // (which hold different tokens).
        for (block_tp, expert_tp) in [(&group, &alone), (&alone, &group)] {
            let tp = TensorParallel::new(block_tp.clone())
                .with_expert_parallel(ExpertParallel::new(group.clone(), expert_tp.clone()));
            let err = TransformerBlock::with_experts(&tp, "b", &block(), &config, &init());
            let message = err.err().expect("refused").to_string();
            assert!(message.contains("expert-tensor-parallel size"), "{message}");
        }
        Ok(())
    })?;
    Ok(())
}
