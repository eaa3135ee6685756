//! The distributed optimizer against plain DDP with a replicated optimizer: the same
//! parameters after 5 AdamW and 5 SGD-momentum steps on a learning-rate schedule
//! (relative 1e-6) at DP ∈ {2, 3, 4}
//! with parameters that straddle shards, with and without TP = 2 (sequence-parallel
//! layer norms summed over TP); the same state; a checkpoint taken at DP = 4 resumes at
//! DP = 2; parameters stored in bf16 or f16 train through each rank's shard of the
//! master weights as through replicated ones ([`MixedPrecision`]), and their checkpoint
//! resumes at another DP or replicated; on the emulated device the sharded step equals
//! the CPU's and copies nothing between host and device; misuse is a typed error.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Buffer, Communicator, Work};
use ferrotron_ddp::{
    CommHook, CompressedAllReduce, DdpConfig, DistributedDataParallel, DistributedOptimizer,
};
use ferrotron_layers::RngTracker;
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{
    transfers, AdamW, AdamWConfig, DType, Device, Generator, LrDecay, LrSchedule, MixedPrecision,
    Optimizer, OptimizerState, ParamOptions, Parameter, Sgd, SgdConfig, Tape, Tensor, Transfers,
    MASTER_BUFFER,
};
use support::{
    global_batch, loss, max_relative_error, slice, tp_block, values, BLOCK_HIDDEN, INPUTS, OUTPUTS,
};

const STEPS: usize = 5;
const ROWS: usize = 3;
/// The MLP's hidden width: 606 + 101 + 303 + 3 parameters, so that shards of 64-element
/// multiples cut through parameters.
const WIDE: usize = 101;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rule {
    AdamW,
    Sgd,
}

const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.1,
};

const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    weight_decay: 0.01,
    dampening: 0.0,
    nesterov: false,
};

/// `relu(x·w1 + b1)·w2 + b2` with a hidden width of [`WIDE`].
fn wide_mlp(seed: u64) -> Vec<Parameter> {
    let mut rng = Generator::new(seed);
    vec![
        Parameter::new("w1", Tensor::randn(&[INPUTS, WIDE], 0.4, &mut rng)),
        Parameter::new("b1", Tensor::randn(&[WIDE], 0.1, &mut rng)),
        Parameter::new("w2", Tensor::randn(&[WIDE, OUTPUTS], 0.4, &mut rng)),
        Parameter::new("b2", Tensor::randn(&[OUTPUTS], 0.1, &mut rng)),
    ]
}

/// Biases without decay and the output layer at half the learning rate: parameter
/// options go through the sharded update too.
fn options(param: &Parameter) -> ParamOptions {
    ParamOptions {
        lr_mult: if param.name() == "w2" { 0.5 } else { 1.0 },
        ..ParamOptions::megatron_groups(param)
    }
}

/// Two steps of warm-up, then a cosine decay to a tenth: the schedule's position (and
/// its restoring from a checkpoint) goes through the sharded step too.
fn schedule(rule: Rule) -> LrSchedule {
    let lr = match rule {
        Rule::AdamW => ADAMW.lr,
        Rule::Sgd => SGD.lr,
    };
    LrSchedule::new(lr, lr / 10.0, 2, STEPS as u64, LrDecay::Cosine).expect("a valid schedule")
}

fn replicated(rule: Rule, params: Vec<Parameter>) -> ferrotron_tape::Result<Box<dyn Optimizer>> {
    Ok(match rule {
        Rule::AdamW => Box::new(
            AdamW::new(params, ADAMW)?
                .with_param_options(options)
                .with_schedule(schedule(rule)),
        ),
        Rule::Sgd => Box::new(
            Sgd::new(params, SGD)?
                .with_param_options(options)
                .with_schedule(schedule(rule)),
        ),
    })
}

fn sharded(
    rule: Rule,
    ddp: &DistributedDataParallel,
) -> ferrotron_ddp::Result<DistributedOptimizer> {
    Ok(match rule {
        Rule::AdamW => DistributedOptimizer::adamw([ddp], ADAMW)?,
        Rule::Sgd => DistributedOptimizer::sgd([ddp], SGD)?,
    }
    .with_param_options(options)
    .with_schedule(schedule(rule)))
}

/// Bucket caps that split the MLP into four buckets: [b2], [w2], [b1], [w1].
fn small_buckets(zero: bool) -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 16,
        bucket_cap_bytes: 1300,
        use_distributed_optimizer: zero,
        ..DdpConfig::default()
    }
}

/// Parameter values and optimizer state after a run.
type Trained = (Vec<Vec<f32>>, OptimizerState);

/// How a run trains: `rule`, through the distributed optimizer with `zero`, parameters
/// stored as `dtype` (16-bit ones through master weights: the sharded optimizer's, or
/// [`MixedPrecision`]'s), DDP configured by `config`, on `device`.
#[derive(Clone, Copy)]
struct Way<'a> {
    rule: Rule,
    zero: bool,
    dtype: DType,
    config: &'a DdpConfig,
    device: Device,
    /// The distributed optimizer's gathers land when the next forward reads them.
    gather_beside: bool,
}

impl<'a> Way<'a> {
    fn new(rule: Rule, zero: bool, dtype: DType, config: &'a DdpConfig) -> Self {
        Way {
            rule,
            zero,
            dtype,
            config,
            device: Device::Cpu,
            gather_beside: false,
        }
    }

    fn on(self, device: Device) -> Self {
        Way { device, ..self }
    }

    fn gathering_beside_forward(self) -> Self {
        Way {
            gather_beside: true,
            ..self
        }
    }

    /// [`train`] on `dp` local ranks: what each rank ends with.
    fn run(
        self,
        dp: usize,
        steps: std::ops::Range<usize>,
        start: Option<&Trained>,
    ) -> Result<Vec<Trained>> {
        let ranks = self.run_measured(dp, steps, start)?;
        Ok(ranks.into_iter().map(|(trained, _)| trained).collect())
    }

    /// [`run`](Self::run), with each rank's host↔device copies of each step after the
    /// first.
    fn run_measured(
        self,
        dp: usize,
        steps: std::ops::Range<usize>,
        start: Option<&Trained>,
    ) -> Result<Vec<(Trained, Vec<Transfers>)>> {
        Ok(run_local(dp, |comm| {
            train(Arc::new(comm), self, steps.clone(), start)
        })?)
    }
}

/// Trains the wide MLP for `steps` steps over `dp` the `way` given, from `start`
/// (parameter values and optimizer state) when given, at step `steps.start`.
fn train(
    dp: Arc<dyn Communicator>,
    way: Way,
    steps: std::ops::Range<usize>,
    start: Option<&Trained>,
) -> Result<(Trained, Vec<Transfers>)> {
    let Way {
        rule,
        zero,
        dtype,
        config,
        device,
        gather_beside,
    } = way;
    let (rank, ranks) = (dp.rank(), dp.size());
    let params = wide_mlp(100 + rank as u64);
    if let Some((values, _)) = start {
        for (param, value) in params.iter().zip(values) {
            param.set_value(Tensor::from_vec(value.clone(), &param.shape())?)?;
        }
    }
    for param in &params {
        param.set_value(param.value()?.to_device(device)?)?;
    }
    let ddp = DistributedDataParallel::new(
        params.clone(),
        dp,
        DdpConfig {
            use_distributed_optimizer: zero,
            ..config.clone()
        },
    )?;
    let mut opt: Box<dyn Optimizer> = match (zero, dtype) {
        (true, DType::F32) => {
            Box::new(sharded(rule, &ddp)?.with_overlap_param_gather(gather_beside))
        }
        (true, dtype) => Box::new(
            sharded(rule, &ddp)?
                .with_overlap_param_gather(gather_beside)
                .store_params_as(dtype)?,
        ),
        (false, DType::F32) => replicated(rule, params.clone())?,
        (false, dtype) => Box::new(MixedPrecision::new(&params, dtype, |masters| {
            replicated(rule, masters)
        })?),
    };
    if let Some((_, state)) = start {
        opt.load_state(state)?;
    }
    let rows = ROWS * 4 / ranks;
    let tape = Tape::new();
    let mut moved = Vec::new();
    let first = steps.start;
    for step in steps {
        let (x, target) = slice(&global_batch(step, ROWS * 4), rank, rows)?;
        let (x, target) = (x.to_device(device)?, target.to_device(device)?);
        // Resumed or not, the step takes the schedule's rate for its position.
        let expected_lr = schedule(rule).lr(step as u64);
        anyhow::ensure!(opt.lr() == expected_lr, "step {step}: lr {}", opt.lr());
        let before = transfers(device);
        opt.zero_grad();
        ddp.backward(&loss(&tape, &params, &x, &target)?)?;
        opt.step()?;
        if step > first {
            moved.push(transfers(device) - before);
        }
    }
    Ok(((values(&params)?, opt.state()?), moved))
}

fn check(dp: usize, rule: Rule, config: DdpConfig) -> Result<()> {
    check_in(DType::F32, dp, rule, config)
}

/// The distributed optimizer against plain DDP with parameters stored as `dtype`: the
/// same parameters (relative 1e-6) and, for 16-bit ones, the same master weights.
fn check_in(dtype: DType, dp: usize, rule: Rule, config: DdpConfig) -> Result<()> {
    let plain = Way::new(rule, false, dtype, &config).run(dp, 0..STEPS, None)?;
    let zero = Way::new(rule, true, dtype, &config).run(dp, 0..STEPS, None)?;
    for (rank, (values, state)) in zero.iter().enumerate() {
        let error = max_relative_error(values, &plain[rank].0);
        assert!(
            error <= 1e-6,
            "{dtype} DP={dp} {rule:?} rank {rank}: relative error {error}"
        );
        assert_eq!(values, &zero[0].0, "ranks must hold identical parameters");
        let (masters, want) = (masters(state)?, masters(&plain[rank].1)?);
        assert_eq!(masters.len(), if dtype == DType::F32 { 0 } else { 4 });
        let error = max_relative_error(&masters, &want);
        assert!(
            error <= 1e-6,
            "{dtype} DP={dp} {rule:?} rank {rank}: master weights' relative error {error}"
        );
    }
    Ok(())
}

/// The master weights a state holds, in parameter order.
fn masters(state: &OptimizerState) -> Result<Vec<Vec<f32>>> {
    let mut masters = Vec::new();
    for param in &state.params {
        for (name, buffer) in &param.buffers {
            if name == MASTER_BUFFER {
                masters.push(buffer.to_vec()?);
            }
        }
    }
    Ok(masters)
}

#[test]
fn adamw_and_sgd_equal_plain_ddp_at_dp_2_3_4() -> Result<()> {
    for dp in [2, 3, 4] {
        for rule in [Rule::AdamW, Rule::Sgd] {
            check(dp, rule, small_buckets(false))?;
            check(dp, rule, DdpConfig::default())?;
        }
    }
    Ok(())
}

#[test]
fn bf16_and_f16_parameters_train_through_master_shards_as_through_replicated_masters() -> Result<()>
{
    for dtype in [DType::BF16, DType::F16] {
        for dp in [2, 3] {
            for rule in [Rule::AdamW, Rule::Sgd] {
                check_in(dtype, dp, rule, small_buckets(false))?;
            }
        }
    }
    // Each rank keeps the f32 masters of its shard only, besides AdamW's moments; the
    // parameters take 2 bytes each.
    let numel: usize = wide_mlp(1).iter().map(Parameter::numel).sum();
    let bytes = run_local(3, |comm| -> Result<(usize, usize, usize, usize)> {
        let params = wide_mlp(1);
        let ddp =
            DistributedDataParallel::new(params.clone(), Arc::new(comm), small_buckets(true))?;
        let adamw = DistributedOptimizer::adamw([&ddp], ADAMW)?.store_params_as(DType::BF16)?;
        let values: usize = (params.iter())
            .map(|p| p.numel() * p.dtype().size_in_bytes())
            .sum();
        // A rank keeps a shard of masters for each bucket it holds pieces of: the ranks
        // whose shard starts before the bucket's parameters end.
        let held: usize = (ddp.buckets().iter())
            .map(|b| {
                let shard = b.padded_numel / 3;
                shard * b.numel.div_ceil(shard)
            })
            .sum();
        Ok((adamw.master_bytes(), adamw.state_bytes(), values, held))
    })?;
    let masters: usize = bytes.iter().map(|b| b.0).sum();
    assert_eq!(
        masters,
        4 * bytes[0].3,
        "the ranks' masters cover every parameter once, in the shards that hold them"
    );
    assert!(bytes[0].3 >= numel);
    for (rank, &(masters, state, values, _)) in bytes.iter().enumerate() {
        assert!(
            masters <= 4 * (numel / 3 + 4 * 64),
            "rank {rank}: {masters} bytes"
        );
        assert!(state > masters, "rank {rank}: the moments count too");
        assert_eq!(values, 2 * numel, "rank {rank}");
    }
    Ok(())
}

#[test]
fn on_a_device_the_sharded_step_moves_nothing_through_the_host() -> Result<()> {
    let check = |way: Way<'_>, label: &str| -> Result<()> {
        let cpu = way.run(2, 0..STEPS, None)?;
        let device = way.on(Device::Emulated).run_measured(2, 0..STEPS, None)?;
        for (rank, ((values, state), moved)) in device.iter().enumerate() {
            let error = max_relative_error(values, &cpu[rank].0);
            assert!(error <= 1e-6, "{label} rank {rank}: relative error {error}");
            let error = max_relative_error(&masters(state)?, &masters(&cpu[rank].1)?);
            assert!(error <= 1e-6, "{label} rank {rank}: masters' error {error}");
            for step in moved {
                assert_eq!(step, &Transfers::default(), "{label}: a host copy");
            }
        }
        Ok(())
    };
    let config = small_buckets(true);
    for dtype in [DType::F32, DType::BF16] {
        for rule in [Rule::AdamW, Rule::Sgd] {
            check(
                Way::new(rule, true, dtype, &config),
                &format!("{dtype} {rule:?}"),
            )?;
        }
    }
    // A 16-bit comm hook's rounded copies of the buckets and shards stay there too.
    let compressed = DdpConfig {
        comm_hook: Arc::new(CompressedAllReduce::bf16()),
        ..small_buckets(true)
    };
    check(
        Way::new(Rule::AdamW, true, DType::BF16, &compressed),
        "bf16-compress",
    )
}

/// Gathering each bucket when the next forward first reads it (Megatron's
/// `--overlap-param-gather`) changes when the parameters land, not their bits: on the CPU
/// and the emulated device, f32 and bf16, the same parameters and state as gathering
/// inside the step, and still nothing through the host.
#[test]
fn gathering_beside_the_next_forward_gives_the_same_bits() -> Result<()> {
    let config = small_buckets(true);
    for device in [Device::Cpu, Device::Emulated] {
        for dtype in [DType::F32, DType::BF16] {
            let way = Way::new(Rule::AdamW, true, dtype, &config).on(device);
            let inside = way.run(2, 0..STEPS, None)?;
            let beside = way
                .gathering_beside_forward()
                .run_measured(2, 0..STEPS, None)?;
            for (rank, ((values, state), moved)) in beside.iter().enumerate() {
                let label = format!("{dtype} on {device}, rank {rank}");
                assert_eq!(values, &inside[rank].0, "{label}");
                assert_eq!(masters(state)?, masters(&inside[rank].1)?, "{label}");
                if device != Device::Cpu {
                    for step in moved {
                        assert_eq!(step, &Transfers::default(), "{label}: a host copy");
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_bf16_checkpoint_moves_between_dp_sizes_and_replicated_master_weights() -> Result<()> {
    let config = small_buckets(true);
    let rule = Rule::AdamW;
    let bf16 = DType::BF16;
    let uninterrupted = Way::new(rule, true, bf16, &config).run(4, 0..STEPS, None)?;
    let saved = Way::new(rule, true, bf16, &config)
        .run(4, 0..3, None)?
        .remove(0);
    anyhow::ensure!(masters(&saved.1)?.len() == 4, "the state keeps the masters");
    for (dp, zero) in [(2, true), (1, false)] {
        let resumed = Way::new(rule, zero, bf16, &config).run(dp, 3..STEPS, Some(&saved))?;
        let error = max_relative_error(&resumed[0].0, &uninterrupted[0].0);
        assert!(error <= 1e-6, "DP={dp} zero={zero}: relative error {error}");
        let error = max_relative_error(&masters(&resumed[0].1)?, &masters(&uninterrupted[0].1)?);
        assert!(
            error <= 1e-6,
            "DP={dp} zero={zero}: masters' relative error {error}"
        );
    }
    // And the other way: replicated master weights (MixedPrecision) resume sharded.
    let replicated = Way::new(rule, false, bf16, &config)
        .run(2, 0..3, None)?
        .remove(0);
    let resumed = Way::new(rule, true, bf16, &config).run(2, 3..STEPS, Some(&replicated))?;
    let error = max_relative_error(&resumed[0].0, &uninterrupted[0].0);
    assert!(
        error <= 1e-6,
        "replicated to sharded: relative error {error}"
    );
    Ok(())
}

#[test]
fn the_state_is_the_replicated_optimizers_and_every_rank_holds_its_share() -> Result<()> {
    let config = small_buckets(false);
    for rule in [Rule::AdamW, Rule::Sgd] {
        let plain = Way::new(rule, false, DType::F32, &config).run(3, 0..3, None)?;
        let zero = Way::new(rule, true, DType::F32, &config).run(3, 0..3, None)?;
        let (want, got) = (&plain[0].1, &zero[2].1);
        assert_eq!(got.steps, want.steps);
        for (index, (got, want)) in got.params.iter().zip(&want.params).enumerate() {
            assert_eq!(got.steps, want.steps, "{rule:?} parameter {index}");
            let names = |p: &ferrotron_tape::ParamState| {
                p.buffers.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()
            };
            assert_eq!(names(got), names(want), "{rule:?} parameter {index}");
            let buffers = |p: &ferrotron_tape::ParamState| -> Vec<Vec<f32>> {
                p.buffers.iter().map(|(_, b)| b.to_vec().unwrap()).collect()
            };
            let error = max_relative_error(&buffers(got), &buffers(want));
            assert!(
                error <= 1e-6,
                "{rule:?} parameter {index}: relative error {error}"
            );
        }
    }
    // AdamW's two f32 moments over each rank's third of every padded bucket.
    let bytes = run_local(3, |comm| -> Result<(usize, usize)> {
        let params = wide_mlp(1);
        let ddp = DistributedDataParallel::new(params, Arc::new(comm), small_buckets(true))?;
        let padded: usize = ddp.buckets().iter().map(|b| b.padded_numel).sum();
        Ok((
            DistributedOptimizer::adamw([&ddp], ADAMW)?.state_bytes(),
            padded,
        ))
    })?;
    for (rank, &(state, padded)) in bytes.iter().enumerate() {
        assert_eq!(state, 2 * 4 * padded / 3, "rank {rank}");
    }
    // Before any step the state holds nothing, as a replicated optimizer's.
    run_local(2, |comm| -> Result<()> {
        let params = wide_mlp(1);
        let ddp = DistributedDataParallel::new(params, Arc::new(comm), small_buckets(true))?;
        let fresh = DistributedOptimizer::adamw([&ddp], ADAMW)?.state()?;
        anyhow::ensure!(fresh.steps == 0);
        anyhow::ensure!(fresh.params.iter().all(|p| p.buffers.is_empty()));
        Ok(())
    })?;
    // SGD without momentum keeps no state, as tape's Sgd.
    let stateless = SgdConfig {
        momentum: 0.0,
        ..SGD
    };
    run_local(2, |comm| -> Result<()> {
        let params = wide_mlp(1);
        let ddp = DistributedDataParallel::new(params, Arc::new(comm), small_buckets(true))?;
        let sgd = DistributedOptimizer::sgd([&ddp], stateless)?;
        anyhow::ensure!(sgd.state_bytes() == 0, "{} bytes", sgd.state_bytes());
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_checkpoint_from_dp_4_resumes_at_dp_2() -> Result<()> {
    let config = small_buckets(true);
    for rule in [Rule::AdamW, Rule::Sgd] {
        let uninterrupted = Way::new(rule, true, DType::F32, &config).run(4, 0..STEPS, None)?;
        let saved = Way::new(rule, true, DType::F32, &config)
            .run(4, 0..3, None)?
            .remove(0);
        let resumed = Way::new(rule, true, DType::F32, &config).run(2, 3..STEPS, Some(&saved))?;
        for (rank, (values, _)) in resumed.iter().enumerate() {
            let error = max_relative_error(values, &uninterrupted[0].0);
            // Only the data-parallel average's rounding differs (4 vs 2 partial means).
            assert!(
                error <= 1e-6,
                "{rule:?} rank {rank}: relative error {error}"
            );
        }
        // The same checkpoint also loads into a replicated optimizer.
        let replicated =
            Way::new(rule, false, DType::F32, &config).run(1, 3..STEPS, Some(&saved))?;
        let error = max_relative_error(&replicated[0].0, &uninterrupted[0].0);
        assert!(error <= 1e-6, "{rule:?} replicated: relative error {error}");
    }
    Ok(())
}

/// TP = 2 × DP = `dp` over a sequence-parallel transformer block: the layer norms' and
/// row-parallel biases' gradients are summed over TP before the reduce-scatter.
fn block_parameters(dp: usize, rule: Rule, zero: bool) -> Result<Vec<Vec<Vec<f32>>>> {
    const SEQ: usize = 4;
    const BATCH: usize = 2;
    const HIDDEN: usize = BLOCK_HIDDEN;
    let layout = RankLayout::builder(2 * dp).tp(2).build()?;
    let mut rng = Generator::new(5);
    let x = Tensor::randn(&[SEQ, dp * BATCH, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, dp * BATCH, HIDDEN], 1.0, &mut rng);
    let ranks = run_local(2 * dp, |comm| -> Result<Vec<Vec<f32>>> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let (_, model) = tp_block(&state, true)?;
        let ddp_config = DdpConfig {
            use_distributed_optimizer: zero,
            ..small_buckets(zero)
        };
        let ddp = DistributedDataParallel::for_model(&model, &state, ddp_config)?;
        let params = ddp.parameters().to_vec();
        // The key bias's gradient is zero up to rounding (softmax ignores a shift), and
        // the TP sum runs before the DP average here, after it in plain DDP, so its
        // rounding noise differs; AdamW with a small eps turns that noise into ±lr steps.
        let adamw = AdamWConfig { eps: 0.1, ..ADAMW };
        // The loss is a sum over many outputs: a smaller step keeps SGD from diverging.
        let sgd = SgdConfig { lr: 1e-3, ..SGD };
        let mut opt: Box<dyn Optimizer> = match (rule, zero) {
            (Rule::AdamW, true) => Box::new(DistributedOptimizer::adamw([&ddp], adamw)?),
            (Rule::AdamW, false) => Box::new(AdamW::new(params.clone(), adamw)?),
            (Rule::Sgd, true) => Box::new(DistributedOptimizer::sgd([&ddp], sgd)?),
            (Rule::Sgd, false) => Box::new(Sgd::new(params.clone(), sgd)?),
        };
        let seq = SEQ / 2;
        let part = |t: &Tensor| -> ferrotron_tape::Result<Tensor> {
            t.narrow(1, state.dp_rank() * BATCH, BATCH)?
                .narrow(0, state.tp_rank() * seq, seq)
        };
        let tape = Tape::new();
        for step in 0..STEPS {
            let mut rng = RngTracker::new(5 + step as u64, state.tp_rank());
            let out = model.forward(&tape, &part(&x)?, &mut rng)?;
            opt.zero_grad();
            ddp.backward(&out.mul(&part(&weights)?)?.sum()?)?;
            opt.step()?;
        }
        Ok(values(&params)?)
    })?;
    Ok(ranks)
}

#[test]
fn tensor_parallel_blocks_equal_plain_ddp_at_dp_2_and_3() -> Result<()> {
    for dp in [2, 3] {
        for rule in [Rule::AdamW, Rule::Sgd] {
            let plain = block_parameters(dp, rule, false)?;
            let zero = block_parameters(dp, rule, true)?;
            for (rank, (got, want)) in zero.iter().zip(&plain).enumerate() {
                let error = max_relative_error(got, want);
                assert!(
                    error <= 1e-6,
                    "TP=2 DP={dp} {rule:?} rank {rank}: relative error {error}"
                );
            }
        }
    }
    Ok(())
}

struct Doubling;

impl CommHook for Doubling {
    fn name(&self) -> &str {
        "doubling"
    }

    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work> {
        ferrotron_ddp::AllReduceAvg.start(dp, bucket)
    }
}

#[test]
fn misuse_is_a_typed_error() -> Result<()> {
    run_local(2, |comm| -> Result<()> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let params = wide_mlp(1);
        let plain =
            DistributedDataParallel::new(params.clone(), comm.clone(), DdpConfig::default())?;
        let err = DistributedOptimizer::adamw([&plain], ADAMW).unwrap_err();
        assert!(
            err.to_string().contains("use_distributed_optimizer"),
            "{err}"
        );
        drop(plain);

        let config = DdpConfig {
            comm_hook: Arc::new(Doubling),
            use_distributed_optimizer: true,
            ..DdpConfig::default()
        };
        let err = DistributedDataParallel::new(params.clone(), comm.clone(), config).unwrap_err();
        assert!(err.to_string().contains("cannot reduce-scatter"), "{err}");

        let ddp = DistributedDataParallel::new(params.clone(), comm.clone(), small_buckets(true))?;
        let mut opt = DistributedOptimizer::sgd([&ddp], SGD)?;
        let err = opt.step().unwrap_err();
        assert!(err.to_string().contains("no reduced gradients"), "{err}");
        let debug = format!("{opt:?}");
        assert!(
            debug.contains("Sgd") && debug.contains("group_sizes: [2]"),
            "{debug}"
        );

        let err = DistributedOptimizer::sgd(std::iter::empty(), SGD).unwrap_err();
        assert!(err.to_string().contains("at least one"), "{err}");
        // A second model chunk whose DDP reduces over another group.
        let alone = comm
            .split(Some(comm.rank() as u32), 0, "alone")?
            .expect("every rank has a color");
        let other = wide_mlp(2);
        let lonely = DistributedDataParallel::new(other, alone, small_buckets(true))?;
        let err = DistributedOptimizer::sgd([&ddp, &lonely], SGD).unwrap_err();
        assert!(
            err.to_string().contains("same data-parallel group"),
            "{err}"
        );

        let mut state = opt.state()?;
        state.params.pop();
        let err = opt.load_state(&state).unwrap_err();
        assert!(err.to_string().contains("holds 3 parameters"), "{err}");

        // Master weights: only for 16-bit formats, and only into 16-bit parameters.
        let err = DistributedOptimizer::sgd([&ddp], SGD)?
            .store_params_as(DType::F64)
            .unwrap_err();
        assert!(err.to_string().contains("bf16 or f16"), "{err}");
        let mut state = opt.state()?;
        let master = Tensor::zeros(&params[0].shape());
        state.params[0].buffers.push((MASTER_BUFFER.into(), master));
        let err = opt.load_state(&state).unwrap_err();
        assert!(err.to_string().contains("trains without"), "{err}");
        Ok(())
    })?;
    Ok(())
}
