//! Global gradient-norm clipping under data parallelism, with plain DDP
//! (`ferrotron_layers::clip_grad_norm` on the averaged gradients) and with the distributed optimizer
//! (its `clip_grad_norm` on the reduced shards): at TP ∈ {1, 2, 4} × DP ∈ {1, 2} both
//! report the serial model's norm and apply the serial model's clipped update. A NaN
//! gradient on one rank is reported by every rank, every rank skips the step, and
//! training goes on from the next batch.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
use ferrotron_layers::{
    BlockConfig, GradNorm, MasterInit, Module, RngTracker, Sharding, TensorParallel,
    TransformerBlock,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Generator, Optimizer, Sgd, SgdConfig, Tape, Tensor};
use support::{max_relative_error, tp_block, BLOCK_HIDDEN as HIDDEN};

const SEQ: usize = 4;
/// Rows of the global batch.
const ROWS: usize = 4;

/// Plain SGD at lr 1: a step subtracts the clipped gradient itself.
const SGD: SgdConfig = SgdConfig {
    lr: 1.0,
    momentum: 0.0,
    weight_decay: 0.0,
    dampening: 0.0,
    nesterov: false,
};

/// One rank's outcome: its coordinates, the norm of each step, and its parameters
/// (with their sharding) before and after training.
struct RankRun {
    tp_rank: usize,
    dp_rank: usize,
    norms: Vec<GradNorm>,
    shardings: Vec<Sharding>,
    before: Vec<Tensor>,
    after: Vec<Tensor>,
}

/// Trains a sequence-parallel transformer block on TP × DP ranks for one step per entry
/// of `poisoned` (a NaN in the input of that DP rank, if any), clipping to `max_norm`
/// and skipping the step when the norm is not finite.
fn train(
    tp: usize,
    dp: usize,
    zero: bool,
    max_norm: f64,
    poisoned: &[Option<usize>],
) -> Result<Vec<RankRun>> {
    let layout = RankLayout::builder(tp * dp).tp(tp).build()?;
    let mut rng = Generator::new(11);
    let x = Tensor::randn(&[SEQ, ROWS, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, ROWS, HIDDEN], 1.0, &mut rng);
    Ok(ferrotron_comm_core::run_local(
        tp * dp,
        |comm| -> Result<RankRun> {
            let state = ParallelState::new(Arc::new(comm), layout.clone())?;
            let (tp, model) = tp_block(&state, tp > 1)?;
            let ddp_config = DdpConfig {
                use_distributed_optimizer: zero,
                // Several buckets, so that the norm sums shards of more than one.
                bucket_cap_bytes: 4 * 1024,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::for_model(&model, &state, ddp_config)?;
            let mut zero_opt = zero
                .then(|| DistributedOptimizer::sgd([&ddp], SGD))
                .transpose()?;
            let mut plain_opt = Sgd::new(ddp.parameters().to_vec(), SGD)?;
            let sharded = model.parameters();
            let before = snapshot(&sharded)?;
            let rows = ROWS / dp;
            let seq = SEQ / tp.size();
            let part = |t: &Tensor| -> ferrotron_tape::Result<Tensor> {
                t.narrow(1, state.dp_rank() * rows, rows)?
                    .narrow(0, tp.rank() * seq, seq)
            };
            let mut norms = Vec::new();
            for (step, poison) in poisoned.iter().enumerate() {
                let mut input = part(&x)?.to_vec()?;
                if *poison == Some(state.dp_rank()) {
                    input[step] = f32::NAN;
                }
                let input = Tensor::from_vec(input, &[seq, rows, HIDDEN])?;
                let tape = Tape::new();
                let out = model.forward(&tape, &input, &mut RngTracker::new(5, tp.rank()))?;
                // The mean over this rank's rows: DDP's average of the ranks' means is the
                // mean over the global batch, the serial model's loss.
                let loss = out.mul(&part(&weights)?)?.sum()?.scale(1.0 / rows as f64)?;
                plain_opt.zero_grad();
                ddp.backward(&loss)?;
                let norm = match &mut zero_opt {
                    Some(opt) => opt.clip_grad_norm(&sharded, &tp, &[], max_norm)?,
                    None => ferrotron_layers::clip_grad_norm(&sharded, &tp, &[], max_norm)?,
                };
                if norm.is_finite() {
                    match &mut zero_opt {
                        Some(opt) => opt.step()?,
                        None => plain_opt.step()?,
                    }
                } else if let Some(opt) = &mut zero_opt {
                    let err = opt.step().unwrap_err().to_string();
                    assert!(err.contains("dropped"), "{err}");
                }
                norms.push(norm);
            }
            Ok(RankRun {
                tp_rank: tp.rank(),
                dp_rank: state.dp_rank(),
                norms,
                shardings: sharded.iter().map(|s| s.sharding).collect(),
                before,
                after: snapshot(&sharded)?,
            })
        },
    )?)
}

/// Copies of the parameters' values (optimizers may update them in place).
fn snapshot(params: &[ferrotron_layers::ShardedParameter]) -> ferrotron_tape::Result<Vec<Tensor>> {
    params
        .iter()
        .map(|s| {
            let value = s.param.value()?;
            Tensor::from_vec(value.to_vec()?, value.shape())
        })
        .collect()
}

/// The whole parameters of DP rank 0, joined from its tensor-parallel shards; `pick`
/// chooses the values (before or after training).
fn full(runs: &[RankRun], pick: fn(&RankRun) -> &[Tensor]) -> Result<Vec<Vec<f32>>> {
    let mut shards: Vec<&RankRun> = runs.iter().filter(|r| r.dp_rank == 0).collect();
    shards.sort_by_key(|r| r.tp_rank);
    let mut params = Vec::new();
    for (index, sharding) in shards[0].shardings.iter().enumerate() {
        let parts: Vec<&Tensor> = shards.iter().map(|r| &pick(r)[index]).collect();
        let whole = match sharding {
            Sharding::Split { dim, .. } => Tensor::concat(&parts, *dim)?,
            Sharding::Replicated => parts[0].clone(),
        };
        params.push(whole.to_vec()?);
    }
    Ok(params)
}

/// What each step changed: `after − before`, per parameter.
fn updates(runs: &[RankRun]) -> Result<Vec<Vec<f32>>> {
    let before = full(runs, |r| &r.before)?;
    let after = full(runs, |r| &r.after)?;
    Ok(after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.iter().zip(b).map(|(a, b)| a - b).collect())
        .collect())
}

#[test]
fn clipping_under_tp_and_dp_equals_clipping_the_serial_model() -> Result<()> {
    let unclipped = train(1, 1, false, 1e9, &[None])?;
    let serial_norm = unclipped[0].norms[0].norm;
    let max_norm = serial_norm / 3.0;
    let serial = train(1, 1, false, max_norm, &[None])?;
    let serial_update = updates(&serial)?;
    // At lr 1 the update is the clipped gradient: its norm is the limit.
    let update_norm = serial_update
        .iter()
        .flatten()
        .map(|&u| f64::from(u) * f64::from(u))
        .sum::<f64>()
        .sqrt();
    assert!(
        (update_norm - max_norm).abs() <= 1e-4 * max_norm,
        "{update_norm} vs {max_norm}"
    );
    for tp in [1, 2, 4] {
        for dp in [1, 2] {
            for zero in [false, true] {
                let what = format!("TP={tp} DP={dp} zero={zero}");
                let runs = train(tp, dp, zero, max_norm, &[None])?;
                for run in &runs {
                    let norm = run.norms[0];
                    let relative = (norm.norm - serial_norm).abs() / serial_norm;
                    assert!(
                        norm.clipped && relative <= 1e-5,
                        "{what}: rank (tp {}, dp {}) got {norm:?}, serial norm {serial_norm}",
                        run.tp_rank,
                        run.dp_rank
                    );
                }
                let error = max_relative_error(&updates(&runs)?, &serial_update);
                assert!(error <= 1e-4, "{what}: update relative error {error}");
            }
        }
    }
    Ok(())
}

#[test]
fn a_nan_gradient_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on() -> Result<()> {
    for tp in [1, 2] {
        // Step 1 has a NaN on DP rank 1; step 2 is clean.
        let poisoned = [Some(1), None];
        let plain = train(tp, 2, false, 1.0, &poisoned)?;
        let zero = train(tp, 2, true, 1.0, &poisoned)?;
        for (name, runs) in [("plain", &plain), ("zero", &zero)] {
            for run in runs.iter() {
                let what = format!(
                    "{name} TP={tp} rank (tp {}, dp {})",
                    run.tp_rank, run.dp_rank
                );
                assert!(!run.norms[0].is_finite(), "{what}: {:?}", run.norms[0]);
                assert!(run.norms[1].is_finite(), "{what}: {:?}", run.norms[1]);
            }
        }
        // Only the clean step moved the parameters, the same way with both optimizers,
        // and as far as a clean step alone moves them.
        let clean = train(tp, 2, false, 1.0, &[None])?;
        let expected = updates(&clean)?;
        for (name, runs) in [("plain", &plain), ("zero", &zero)] {
            let error = max_relative_error(&updates(runs)?, &expected);
            assert!(
                error <= 1e-5,
                "{name} TP={tp}: update relative error {error}"
            );
        }
    }
    Ok(())
}

/// Two model chunks, each with its DDP (as an interleaved pipeline stage holds them),
/// under one distributed optimizer: clipped over both, stepped as plain DDP steps them.
fn two_chunks(zero: bool) -> Result<Vec<(GradNorm, Vec<Vec<f32>>)>> {
    let layout = RankLayout::builder(2).build()?;
    let mut rng = Generator::new(12);
    let x = Tensor::randn(&[SEQ, ROWS, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, ROWS, HIDDEN], 1.0, &mut rng);
    Ok(ferrotron_comm_core::run_local(2, |comm| -> Result<_> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let (tp, first) = tp_block(&state, false)?;
        let (_, second) = tp_block(&state, false)?;
        let config = DdpConfig {
            use_distributed_optimizer: zero,
            bucket_cap_bytes: 4 * 1024,
            ..DdpConfig::default()
        };
        let ddps = [
            DistributedDataParallel::for_model(&first, &state, config.clone())?,
            DistributedDataParallel::for_model(&second, &state, config)?,
        ];
        let model: Vec<_> = [first.parameters(), second.parameters()].concat();
        let mut zero_opt = zero
            .then(|| DistributedOptimizer::sgd(&ddps, SGD))
            .transpose()?;
        if let Some(opt) = &zero_opt {
            // The chunks' parameters, in the order the DDPs were given.
            let ids = |params: &[ferrotron_tape::Parameter]| {
                params.iter().map(|p| p.id()).collect::<Vec<_>>()
            };
            let chunks: Vec<_> = model.iter().map(|s| s.param.clone()).collect();
            anyhow::ensure!(ids(Optimizer::params(opt)) == ids(&chunks));
        }
        let mut plain_opt = Sgd::new(model.iter().map(|s| s.param.clone()).collect(), SGD)?;
        let rows = ROWS / 2;
        let part = |t: &Tensor| t.narrow(1, state.dp_rank() * rows, rows);
        let mut norm = None;
        for _ in 0..2 {
            let tape = Tape::new();
            let mut rng = RngTracker::new(5, 0);
            let hidden = first.forward(&tape, &part(&x)?, &mut rng)?;
            let out = second.forward(&tape, &hidden, &mut rng)?;
            let loss = out.mul(&part(&weights)?)?.sum()?.scale(1.0 / rows as f64)?;
            plain_opt.zero_grad();
            loss.backward()?;
            for ddp in &ddps {
                ddp.finish()?;
            }
            norm = Some(match &mut zero_opt {
                Some(opt) => {
                    let norm = opt.clip_grad_norm(&model, &tp, &[], 1.0)?;
                    opt.step()?;
                    norm
                }
                None => {
                    let norm = ferrotron_layers::clip_grad_norm(&model, &tp, &[], 1.0)?;
                    plain_opt.step()?;
                    norm
                }
            });
        }
        let values = model.iter().map(|s| s.param.value()?.to_vec());
        Ok((
            norm.expect("two steps"),
            values.collect::<ferrotron_tape::Result<_>>()?,
        ))
    })?)
}

#[test]
fn one_distributed_optimizer_over_two_chunks_clips_and_steps_as_plain_ddp() -> Result<()> {
    let plain = two_chunks(false)?;
    let zero = two_chunks(true)?;
    for (rank, ((plain_norm, want), (zero_norm, got))) in plain.iter().zip(&zero).enumerate() {
        assert!(plain_norm.clipped, "rank {rank}: the limit must clip");
        let relative = (zero_norm.norm - plain_norm.norm).abs() / plain_norm.norm;
        assert!(
            relative <= 1e-6,
            "rank {rank}: {zero_norm:?} vs {plain_norm:?}"
        );
        let error = max_relative_error(got, want);
        assert!(error <= 1e-6, "rank {rank}: relative error {error}");
    }
    Ok(())
}

/// A clip's scale belongs to the gradients it measured: clipping, then running backward
/// again without a step, then stepping without clipping, steps unclipped.
#[test]
fn a_clip_scales_only_the_gradients_it_measured() -> Result<()> {
    let run = |clip_first: bool| -> Result<Vec<Vec<Vec<f32>>>> {
        let layout = RankLayout::builder(2).build()?;
        let mut rng = Generator::new(13);
        let x = Tensor::randn(&[SEQ, ROWS, HIDDEN], 1.0, &mut rng);
        Ok(ferrotron_comm_core::run_local(2, |comm| -> Result<_> {
            let state = ParallelState::new(Arc::new(comm), layout.clone())?;
            let (tp, model) = tp_block(&state, false)?;
            let config = DdpConfig {
                use_distributed_optimizer: true,
                ..DdpConfig::default()
            };
            let ddp = DistributedDataParallel::for_model(&model, &state, config)?;
            let mut opt = DistributedOptimizer::sgd([&ddp], SGD)?;
            let input = x.narrow(1, state.dp_rank() * ROWS / 2, ROWS / 2)?;
            let backward = || -> Result<()> {
                let tape = Tape::new();
                let out = model.forward(&tape, &input, &mut RngTracker::new(5, 0))?;
                ddp.backward(&out.sum()?)?;
                Ok(())
            };
            if clip_first {
                backward()?;
                let norm = opt.clip_grad_norm(&model.parameters(), &tp, &[], 1e-3)?;
                anyhow::ensure!(norm.clipped, "{norm:?}");
            }
            backward()?;
            opt.step()?;
            Ok(snapshot(&model.parameters())?
                .iter()
                .map(|t| t.to_vec())
                .collect::<ferrotron_tape::Result<_>>()?)
        })?)
    };
    assert_eq!(run(true)?, run(false)?);
    Ok(())
}

#[test]
fn the_distributed_optimizer_refuses_a_parameter_it_does_not_hold() -> Result<()> {
    ferrotron_comm_core::run_local(1, |comm| -> Result<()> {
        let layout = RankLayout::builder(1).build()?;
        let state = ParallelState::new(Arc::new(comm), layout)?;
        let tp = TensorParallel::from_state(&state);
        let init = MasterInit::new(7, 0.3);
        let config = BlockConfig::new(HIDDEN, 4);
        let held = TransformerBlock::new(&tp, "held", &config, &init)?;
        let other = TransformerBlock::new(&tp, "other", &config, &init)?;
        let ddp_config = DdpConfig {
            use_distributed_optimizer: true,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::for_model(&held, &state, ddp_config)?;
        let mut opt = DistributedOptimizer::sgd([&ddp], SGD)?;
        // Before any backward there is nothing to clip.
        let err = opt
            .clip_grad_norm(&held.parameters(), &tp, &[], 1.0)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("run DistributedDataParallel::backward"),
            "{err}"
        );
        let err = opt
            .clip_grad_norm(&other.parameters(), &tp, &[], 1.0)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("not one of the distributed optimizer's"),
            "{err}"
        );
        Ok(())
    })?;
    Ok(())
}
