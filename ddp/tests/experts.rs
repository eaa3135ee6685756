//! Experts' parameters under DDP: `for_experts` reduces them over the
//! expert-data-parallel group while `for_model` reduces the router over the data-parallel
//! one, and the distributed optimizer over both DDPs (experts' state sharded over the
//! expert-data-parallel group) gives the parameters, gradient norms and optimizer state
//! of plain DDP with a replicated AdamW: 4 clipped steps at DP 4 × EP 2 and DP 4 × EP 4,
//! relative 1e-6. An expert no token reaches gets a zero gradient and is stepped (its
//! weights decay), as Megatron's experts are.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::run_local;
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
use ferrotron_layers::{
    BlockConfig, ExpertParallel, MasterInit, Module, MoeConfig, MoeMlp, TensorParallel,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{AdamW, AdamWConfig, Generator, Optimizer, OptimizerState, Tape, Tensor};
use support::max_relative_error;

const HIDDEN: usize = 8;
const EXPERTS: usize = 4;
/// The expert no token reaches: its router row is strongly negative, every input positive.
const IDLE: usize = 3;
const STEPS: usize = 4;
/// Low enough that every step clips.
const MAX_NORM: f64 = 0.05;

const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.1,
};

/// What one rank ends with: every parameter by name (in the model's order), the
/// gradient norm of each step, and the optimizer state.
struct Outcome {
    values: Vec<(String, Vec<f32>)>,
    norms: Vec<f64>,
    state: OptimizerState,
    /// On a rank holding the idle expert (replicated runs): a weight of it before and
    /// after training, and whether its gradient was zero at every step.
    idle: Option<Idle>,
}

struct Idle {
    before: Vec<f32>,
    after: Vec<f32>,
    zero_grads: bool,
}

fn layer(state: &ParallelState) -> Result<MoeMlp> {
    let mut config = MoeConfig::new(EXPERTS, 2, 16);
    config.aux_loss_coeff = 0.01;
    let init = MasterInit::new(11, 0.3).with_bias_std(0.1);
    let moe = MoeMlp::new(
        &ExpertParallel::from_state(state),
        "moe",
        &BlockConfig::new(HIDDEN, 2),
        &config,
        &init,
    )?;
    let router = &moe.router_parameters()[0].param;
    let mut w = router.value()?.to_vec()?;
    w[IDLE * HIDDEN..(IDLE + 1) * HIDDEN].fill(-3.0);
    router.set_value(Tensor::from_vec(w, &[EXPERTS, HIDDEN])?)?;
    Ok(moe)
}

/// Data rank `r`'s tokens at `step` (`2 + r` positions: uneven), positive so that the
/// idle expert stays idle, and the loss weights.
fn batch(r: usize, step: usize) -> (Tensor, Tensor) {
    let mut rng = Generator::new(40 + 10 * step as u64 + r as u64);
    let x = Tensor::randn(&[2 + r, 3, HIDDEN], 1.0, &mut rng);
    let x = x.mul(&x).unwrap();
    (x, Tensor::randn(&[2 + r, 3, HIDDEN], 1.0, &mut rng))
}

/// Trains the layer at DP `dp` × EP `ep`: with `sharded`, DDPs that reduce-scatter and
/// one distributed optimizer over both; otherwise plain DDPs and a replicated AdamW.
fn train(dp: usize, ep: usize, sharded: bool) -> Result<Vec<Outcome>> {
    let layout = RankLayout::builder(dp).ep(ep).build()?;
    Ok(run_local(dp, |comm| -> Result<Outcome> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let tp = TensorParallel::from_state(&state);
        let moe = layer(&state)?;
        let config = DdpConfig {
            use_distributed_optimizer: sharded,
            ..DdpConfig::default()
        };
        let dense = DistributedDataParallel::for_model(&moe, &state, config.clone())?;
        let experts = DistributedDataParallel::for_experts(&moe, &state, config)?
            .expect("the layer has experts");
        assert_eq!(experts.communicator().size(), dp / ep);
        let model = moe.parameters();
        let mut norms = Vec::new();
        let idle = idle_expert(&moe);
        let before = idle.as_ref().map(|p| p.value()?.to_vec()).transpose()?;
        let mut zero_grads = true;
        let state = if sharded {
            let mut adamw = DistributedOptimizer::adamw([&dense, &experts], ADAMW)?;
            for step in 0..STEPS {
                backward(&moe, &dense, &experts, state.dp_rank(), step)?;
                norms.push(adamw.clip_grad_norm(&model, &tp, &[], MAX_NORM)?.norm);
                adamw.step()?;
            }
            adamw.state()?
        } else {
            let params = model.iter().map(|p| p.param.clone()).collect();
            let mut adamw = AdamW::new(params, ADAMW)?;
            for step in 0..STEPS {
                backward(&moe, &dense, &experts, state.dp_rank(), step)?;
                if let Some(idle) = &idle {
                    let grad = idle.grad().expect("an idle expert gets a (zero) gradient");
                    zero_grads &= grad.to_vec()?.iter().all(|&g| g == 0.0);
                }
                norms.push(ferrotron_layers::clip_grad_norm(&model, &tp, &[], MAX_NORM)?.norm);
                adamw.step()?;
                adamw.zero_grad();
            }
            adamw.state()?
        };
        let values = (model.iter())
            .map(|p| Ok((p.param.name().to_string(), p.param.value()?.to_vec()?)))
            .collect::<Result<_>>()?;
        let idle = match (idle, before) {
            (Some(param), Some(before)) => Some(Idle {
                before,
                after: param.value()?.to_vec()?,
                zero_grads,
            }),
            _ => None,
        };
        Ok(Outcome {
            values,
            norms,
            state,
            idle,
        })
    })?)
}

fn backward(
    moe: &MoeMlp,
    dense: &DistributedDataParallel,
    experts: &DistributedDataParallel,
    dp_rank: usize,
    step: usize,
) -> Result<()> {
    let (x, w) = batch(dp_rank, step);
    let tape = Tape::new();
    let out = moe.forward(&tape, &x)?;
    out.output.mul(&w)?.sum()?.add(&out.aux_loss)?.backward()?;
    dense.finish()?;
    experts.finish()?;
    Ok(())
}

/// The first weight of the idle expert, on the rank that holds it.
fn idle_expert(moe: &MoeMlp) -> Option<ferrotron_tape::Parameter> {
    let position = moe.local_experts().iter().position(|&e| e == IDLE)?;
    let per_expert = moe.expert_parameters().len() / moe.local_experts().len();
    Some(moe.expert_parameters()[position * per_expert].param.clone())
}

#[test]
fn the_distributed_optimizer_over_experts_equals_a_replicated_one() -> Result<()> {
    for (dp, ep) in [(4, 2), (4, 4), (2, 1)] {
        let plain = train(dp, ep, false)?;
        let sharded = train(dp, ep, true)?;
        for (rank, (a, b)) in plain.iter().zip(&sharded).enumerate() {
            let what = format!("DP {dp} × EP {ep}, rank {rank}");
            for (x, y) in a.norms.iter().zip(&b.norms) {
                assert!((x - y).abs() <= 1e-6 * x, "{what}: norms {x} vs {y}");
            }
            assert!(
                a.norms.iter().all(|&n| n > MAX_NORM),
                "{what}: every step clips"
            );
            let names = |o: &Outcome| o.values.iter().map(|v| v.0.clone()).collect::<Vec<_>>();
            assert_eq!(names(a), names(b), "{what}");
            let values = |o: &Outcome| o.values.iter().map(|v| v.1.clone()).collect::<Vec<_>>();
            let error = max_relative_error(&values(b), &values(a));
            assert!(error <= 1e-6, "{what}: parameters differ by {error}");
            assert_eq!(a.state.steps, b.state.steps, "{what}");
            for (p, q) in a.state.params.iter().zip(&b.state.params) {
                assert_eq!(p.steps, q.steps, "{what}: every parameter stepped alike");
                let buffers = |s: &ferrotron_tape::ParamState| -> Result<Vec<Vec<f32>>> {
                    s.buffers.iter().map(|(_, t)| Ok(t.to_vec()?)).collect()
                };
                let error = max_relative_error(&buffers(q)?, &buffers(p)?);
                assert!(error <= 1e-6, "{what}: moments differ by {error}");
            }
            // Every parameter, the idle expert's included, was stepped every time.
            assert!(
                b.state.params.iter().all(|p| p.steps == STEPS as u64),
                "{what}"
            );
        }
    }
    Ok(())
}

#[test]
fn an_expert_without_tokens_gets_a_zero_gradient_and_decays() -> Result<()> {
    let outcomes = train(4, 2, false)?;
    let holders: Vec<&Idle> = outcomes.iter().filter_map(|o| o.idle.as_ref()).collect();
    assert_eq!(
        holders.len(),
        2,
        "one expert-parallel rank in each of two replicas"
    );
    // Its weights move only by AdamW's decoupled weight decay, compounded: a zero
    // gradient leaves its moments at zero.
    let decay = (1.0 - ADAMW.lr * ADAMW.weight_decay).powi(STEPS as i32) as f32;
    for idle in holders {
        assert!(idle.zero_grads);
        for (w, w0) in idle.after.iter().zip(&idle.before) {
            assert!((w - w0 * decay).abs() <= 1e-6, "{w} vs {w0}·{decay}");
        }
    }
    Ok(())
}
