//! Dynamic loss scaling of f16 parameters at TP 2 × DP 2, with replicated master weights
//! and with the distributed optimizer: a gradient that overflows on one rank only makes
//! every rank skip the step and halve the scale, leaving identical parameters; the
//! finite steps, unscaled and then clipped, equal unscaled training (the scale is a power of two, so scaling and
//! unscaling are exact) and the scale grows back after its interval.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
use ferrotron_layers::{
    GradScaler, GradScalerConfig, Module, RngTracker, ShardedParameter, Sharding,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{
    AdamW, AdamWConfig, DType, Generator, MixedPrecision, Optimizer, Parameter, Tape, Tensor,
};
use support::{tp_block, values, BLOCK_HIDDEN};

const STEPS: usize = 3;
const SEQ: usize = 4;
const BATCH: usize = 2;
/// The gradient norm every step clips to (well below the block's).
const MAX_NORM: f64 = 0.05;
/// The rank whose gradients overflow at the first step.
const OVERFLOWING_RANK: usize = 3;

const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 0.1,
    weight_decay: 0.1,
};

/// The two ways of keeping f32 master weights.
enum Masters {
    Replicated(MixedPrecision<AdamW>),
    Sharded(DistributedOptimizer),
}

/// What one rank saw: its parameters before and after the run, whether each step was taken, and
/// the scale after each step.
struct RankRun {
    initial: Vec<Vec<f32>>,
    params: Vec<Vec<f32>>,
    stepped: Vec<bool>,
    scales: Vec<f64>,
}

/// Trains the block in f16 for [`STEPS`] steps. With `scaled`, through a loss scaler
/// (growth every 2 steps) whose first step overflows on [`OVERFLOWING_RANK`]; without,
/// unscaled, skipping the first step.
fn train(zero: bool, scaled: bool) -> Result<Vec<RankRun>> {
    let layout = RankLayout::builder(4).tp(2).build()?;
    let mut rng = Generator::new(5);
    let x = Tensor::randn(&[SEQ, 2 * BATCH, BLOCK_HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, 2 * BATCH, BLOCK_HIDDEN], 1.0, &mut rng);
    run_local(4, |comm| -> Result<RankRun> {
        let rank = comm.rank();
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let (tp, model) = tp_block(&state, true)?;
        let config = DdpConfig {
            use_distributed_optimizer: zero,
            bucket_cap_bytes: 4096,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::for_model(&model, &state, config.clone())?;
        // A parameter outside the block, through which the overflow is injected: its
        // gradient reaches no tensor-parallel peer, so only the scaler's own reduction
        // can tell them.
        let probe = Parameter::new("probe", Tensor::ones(&[1]));
        let probe_ddp =
            DistributedDataParallel::new(vec![probe.clone()], state.dp().clone(), config)?;
        let mut params: Vec<Parameter> = ddp.parameters().to_vec();
        params.push(probe.clone());
        let mut scaled_params = model.parameters();
        scaled_params.push(ShardedParameter {
            param: probe.clone(),
            sharding: Sharding::Replicated,
            grad_reduce_group: None,
            shared_copy: false,
            expert: false,
        });
        let mut masters = if zero {
            let sharded = DistributedOptimizer::adamw([&ddp, &probe_ddp], ADAMW)?;
            Masters::Sharded(sharded.store_params_as(DType::F16)?)
        } else {
            let replicated = MixedPrecision::new(&params, DType::F16, |m| AdamW::new(m, ADAMW))?;
            Masters::Replicated(replicated)
        };
        let initial = values(&params)?;
        let mut scaler = GradScaler::new(GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        })?;
        let part = |t: &Tensor| -> ferrotron_tape::Result<Tensor> {
            t.narrow(1, state.dp_rank() * BATCH, BATCH)?.narrow(
                0,
                state.tp_rank() * SEQ / 2,
                SEQ / 2,
            )
        };
        let tape = Tape::new();
        let (mut stepped, mut scales) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            match &masters {
                Masters::Replicated(adamw) => adamw.zero_grad(),
                Masters::Sharded(adamw) => adamw.zero_grad(),
            }
            if !scaled && step == 0 {
                stepped.push(false);
                continue;
            }
            let mut tracker = RngTracker::new(5 + step as u64, state.tp_rank());
            let out = model.forward(&tape, &part(&x)?, &mut tracker)?;
            let loss = out.mul(&part(&weights)?)?.sum()?;
            let overflow = if scaled && step == 0 && rank == OVERFLOWING_RANK {
                f64::INFINITY
            } else {
                0.0
            };
            let probe_term = tape.watch(&probe)?.scale(overflow)?.sum()?;
            let backward = |loss: Tensor| -> Result<()> {
                loss.add(&probe_term)?.backward()?;
                ddp.finish()?;
                probe_ddp.finish()?;
                Ok(())
            };
            let finite = if scaled {
                backward(scaler.scale_loss(&loss)?)?;
                match &mut masters {
                    Masters::Replicated(_) => scaler.unscale_grads(&scaled_params, &tp, &[])?,
                    Masters::Sharded(adamw) => adamw.unscale_grads(&scaler, &tp, &[])?,
                }
            } else {
                backward(loss)?;
                true
            };
            if finite {
                // Clipped hard, so the step depends on the gradients' size: a scale
                // left on them would show.
                match &mut masters {
                    Masters::Replicated(adamw) => {
                        ferrotron_layers::clip_grad_norm(&scaled_params, &tp, &[], MAX_NORM)?;
                        adamw.step()?
                    }
                    Masters::Sharded(adamw) => {
                        adamw.clip_grad_norm(&scaled_params, &tp, &[], MAX_NORM)?;
                        adamw.step()?
                    }
                }
            }
            scaler.update(finite);
            stepped.push(finite);
            scales.push(scaler.scale());
        }
        Ok(RankRun {
            initial,
            params: values(&params)?,
            stepped,
            scales,
        })
    })
    .map_err(Into::into)
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale() -> Result<()> {
    for zero in [false, true] {
        let scaled = train(zero, true)?;
        let unscaled = train(zero, false)?;
        for (rank, run) in scaled.iter().enumerate() {
            assert_eq!(run.stepped, [false, true, true], "zero={zero} rank {rank}");
            // Halved by the overflow, doubled back after two finite steps.
            assert_eq!(
                run.scales,
                [32768.0, 32768.0, 65536.0],
                "zero={zero} rank {rank}"
            );
            assert_eq!(
                run.params, unscaled[rank].params,
                "zero={zero} rank {rank}: the scaled run's parameters"
            );
            // Data-parallel replicas (world ranks r and r + 2 hold the same TP shard).
            assert_eq!(
                run.params,
                scaled[rank % 2].params,
                "zero={zero} rank {rank}"
            );
        }
        assert_ne!(
            scaled[0].params, scaled[0].initial,
            "zero={zero}: the finite steps change the parameters"
        );
    }
    Ok(())
}
