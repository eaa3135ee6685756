//! Shared harness of the cross-crate tests: a small model built from `layers`, trained
//! under TP × DP with `ddp` on `run_local` rank threads, and the serial (one rank) run it
//! must equal. Each test binary uses a different subset.
#![allow(dead_code)]

use std::error::Error as StdError;
use std::sync::Arc;

use ferrotron_comm_core::{Communicator, LocalCommunicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
use ferrotron_layers::{
    part_of, BlockConfig, MasterInit, Module, ParallelMlp, RngTracker, ShardedParameter, Sharding,
    TensorParallel, TransformerBlock, TP_GROUP,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{
    AdamW, AdamWConfig, Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor,
};

/// What a rank closure returns on failure: boxing keeps the crates' own error types, so
/// tests can downcast them and walk their `source` chains.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Relative tolerance, with the rule of `layers`' tests:
/// `|got − want| ≤ RTOL · (|want| + max|want|)`.
pub const RTOL: f32 = 1e-5;

/// Asserts `got ≈ want` element by element under [`RTOL`].
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let (got, want) = (got.to_vec().unwrap(), want.to_vec().unwrap());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= RTOL * (w.abs() + scale),
            "{what}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

/// The model under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// One [`ParallelMlp`].
    Mlp,
    /// `n` pre-norm [`TransformerBlock`]s in a row.
    Blocks(usize),
}

/// The optimizer under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opt {
    /// SGD with momentum 0.9.
    Sgd,
    /// AdamW with its default betas, eps and weight decay.
    AdamW,
}

/// A model built from `layers` on one rank.
pub enum Net {
    Mlp(Box<ParallelMlp>),
    Blocks(Vec<TransformerBlock>),
}

impl Net {
    pub fn new(
        tp: &TensorParallel,
        arch: Arch,
        config: &BlockConfig,
        init: &MasterInit,
    ) -> ferrotron_layers::Result<Net> {
        Ok(match arch {
            Arch::Mlp => Net::Mlp(Box::new(ParallelMlp::new(tp, "mlp", config, init)?)),
            Arch::Blocks(n) => Net::Blocks(
                (0..n)
                    .map(|i| TransformerBlock::new(tp, &format!("block{i}"), config, init))
                    .collect::<ferrotron_layers::Result<_>>()?,
            ),
        })
    }

    /// `[sequence, batch, hidden] → [sequence, batch, hidden]` (this rank's sequence part
    /// under sequence parallelism).
    pub fn forward(
        &self,
        tape: &Tape,
        x: &Tensor,
        rng: &mut RngTracker,
    ) -> ferrotron_layers::Result<Tensor> {
        match self {
            Net::Mlp(mlp) => mlp.forward(tape, x),
            Net::Blocks(blocks) => {
                let mut h = x.clone();
                for block in blocks {
                    h = block.forward(tape, &h, rng)?;
                }
                Ok(h)
            }
        }
    }
}

impl Module for Net {
    fn parameters(&self) -> Vec<ShardedParameter> {
        match self {
            Net::Mlp(mlp) => mlp.parameters(),
            Net::Blocks(blocks) => blocks.iter().flat_map(Module::parameters).collect(),
        }
    }
}

/// One training run: model, parallel sizes, data and optimizer.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub arch: Arch,
    pub tp: usize,
    pub dp: usize,
    pub sequence_parallel: bool,
    pub opt: Opt,
    pub steps: usize,
    /// Sequence length (the first dimension of activations).
    pub seq: usize,
    /// Batch of one DP rank; the global batch is `dp · batch`.
    pub batch: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Seed of the master weights.
    pub init_seed: u64,
    /// Seed of the data.
    pub data_seed: u64,
    /// AdamW's epsilon. Attention's key bias has an exactly-zero gradient (softmax is
    /// invariant to adding `q·b` to every score), so f32 rounding noise of ~1e-9 is all
    /// its gradient holds; with the usual 1e-8 AdamW turns that noise into steps of ±lr,
    /// different noise in the serial and parallel runs. Models with attention use 1e-3,
    /// which keeps such noise below the tolerance and leaves real gradients Adam-scaled.
    pub adam_eps: f64,
    /// Where the parallel run keeps parameters and activations (the serial reference
    /// always runs on the CPU).
    pub device: ferrotron_tape::Device,
}

impl Setup {
    /// A small model: width 8, 2 heads, sequence 4, batch 2 per DP rank.
    pub fn new(arch: Arch, tp: usize, dp: usize, opt: Opt, steps: usize) -> Setup {
        Setup {
            arch,
            tp,
            dp,
            sequence_parallel: false,
            opt,
            steps,
            seq: 4,
            batch: 2,
            hidden: 8,
            heads: 2,
            init_seed: 42,
            data_seed: 1000,
            adam_eps: match arch {
                Arch::Mlp => 1e-8,
                Arch::Blocks(_) => 1e-3,
            },
            device: ferrotron_tape::Device::Cpu,
        }
    }

    pub fn config(&self) -> BlockConfig {
        BlockConfig::new(self.hidden, self.heads)
    }

    pub fn init(&self) -> MasterInit {
        MasterInit::new(self.init_seed, 0.2)
    }

    /// The whole batch of step `step`: input and target, `[seq, dp · batch, hidden]`.
    pub fn global_batch(&self, step: usize) -> (Tensor, Tensor) {
        let mut rng = Generator::new(self.data_seed + step as u64);
        let shape = [self.seq, self.dp * self.batch, self.hidden];
        (
            Tensor::randn(&shape, 1.0, &mut rng),
            Tensor::randn(&shape, 1.0, &mut rng),
        )
    }

    /// Elements of one DP rank's (sequence-complete) output: the loss divisor.
    pub fn dp_rank_elements(&self) -> usize {
        self.seq * self.batch * self.hidden
    }
}

pub fn optimizer(
    setup: &Setup,
    params: Vec<Parameter>,
) -> ferrotron_tape::Result<Box<dyn Optimizer>> {
    Ok(match setup.opt {
        Opt::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: 0.9,
                ..SgdConfig::new(0.05)
            },
        )?),
        Opt::AdamW => Box::new(AdamW::new(
            params,
            AdamWConfig {
                lr: 0.01,
                eps: setup.adam_eps,
                ..AdamWConfig::default()
            },
        )?),
    })
}

/// `Σ (output − target)² / divisor`.
pub fn squared_error(
    output: &Tensor,
    target: &Tensor,
    divisor: usize,
) -> ferrotron_tape::Result<Tensor> {
    let diff = output.sub(target)?;
    diff.mul(&diff)?.sum()?.scale(1.0 / divisor as f64)
}

/// Small bucket caps, so that the model spreads over several buckets and their
/// reductions overlap backward.
pub fn small_buckets() -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 256,
        bucket_cap_bytes: 2048,
        ..DdpConfig::default()
    }
}

/// What one rank of a TP × DP run ends with.
#[derive(Debug)]
pub struct RankResult {
    pub world_rank: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
    /// This rank's loss of each step: the DP rank's loss without sequence parallelism,
    /// this TP rank's share of it (they sum to it) with.
    pub losses: Vec<f32>,
    /// Parameters that ask for DDP's extra `"tp"` reduction (`grad_reduce_group`).
    pub marked: Vec<String>,
    /// Every parameter after the last step, with its sharding.
    pub params: Vec<(String, Sharding, Tensor)>,
}

/// Called on every rank before each backward pass: `(world rank, step)`. Returning an
/// error (or panicking) simulates a failing rank.
pub type BeforeBackward<'a> = &'a (dyn Fn(usize, usize) -> Result<(), BoxError> + Sync);

/// One rank of a TP × DP training run: `ParallelState` over `comm`, the model from the
/// master weights, DDP over the DP group (`DistributedDataParallel::for_model`, whose
/// extra reductions sum the sequence-parallel gradients over `"tp"`), and `setup.steps` optimizer steps on this
/// rank's part of each global batch.
pub fn train_rank(
    comm: LocalCommunicator,
    setup: &Setup,
    before_backward: BeforeBackward<'_>,
) -> Result<RankResult, BoxError> {
    let world = setup.tp * setup.dp;
    let layout = RankLayout::builder(world).tp(setup.tp).build()?;
    let state = ParallelState::new(Arc::new(comm) as Arc<dyn Communicator>, layout)?;
    let (tp_rank, dp_rank) = (state.tp_rank(), state.dp_rank());
    let tp = TensorParallel::from_state(&state).with_sequence_parallel(setup.sequence_parallel);
    let net = Net::new(&tp, setup.arch, &setup.config(), &setup.init())?;
    for p in net.parameters() {
        p.param
            .set_value(p.param.value()?.to_device(setup.device)?)?;
    }

    let sharded = net.parameters();
    let marked = sharded
        .iter()
        .filter(|p| p.grad_reduce_group == Some(TP_GROUP))
        .map(|p| p.param.name().to_string())
        .collect();
    let params: Vec<Parameter> = sharded.iter().map(|p| p.param.clone()).collect();
    let ddp = DistributedDataParallel::for_model(&net, &state, small_buckets())?;
    let mut opt = optimizer(setup, params)?;
    let mut rng = RngTracker::new(1234, tp_rank);

    let (seq_start, seq_len) = if setup.sequence_parallel {
        part_of(setup.seq, tp_rank, setup.tp)?
    } else {
        (0, setup.seq)
    };
    let mut losses = Vec::with_capacity(setup.steps);
    for step in 0..setup.steps {
        let (x, target) = setup.global_batch(step);
        let rows = |t: &Tensor| -> ferrotron_tape::Result<Tensor> {
            t.narrow(1, dp_rank * setup.batch, setup.batch)?
                .narrow(0, seq_start, seq_len)
        };
        let (x, target) = (rows(&x)?, rows(&target)?);
        let (x, target) = (x.to_device(setup.device)?, target.to_device(setup.device)?);
        let tape = Tape::new();
        opt.zero_grad();
        let output = net.forward(&tape, &x, &mut rng)?;
        let loss = squared_error(&output, &target, setup.dp_rank_elements())?;
        before_backward(state.rank(), step)?;
        ddp.backward(&loss)?;
        opt.step()?;
        losses.push(loss.item()?);
    }
    Ok(RankResult {
        world_rank: state.rank(),
        tp_rank,
        dp_rank,
        losses,
        marked,
        params: sharded
            .iter()
            .map(|p| Ok((p.param.name().to_string(), p.sharding, p.param.value()?)))
            .collect::<ferrotron_tape::Result<_>>()?,
    })
}

/// Never fails.
pub fn no_failure(_rank: usize, _step: usize) -> Result<(), BoxError> {
    Ok(())
}

/// A whole TP × DP run on `tp · dp` rank threads, results in world-rank order.
pub fn train_parallel(setup: &Setup) -> anyhow::Result<Vec<RankResult>> {
    Ok(ferrotron_comm_core::run_local(
        setup.tp * setup.dp,
        |comm| train_rank(comm, setup, &no_failure),
    )?)
}

/// The serial reference: one rank, TP = DP = 1, no DDP, trained on the whole global batch
/// (the concatenation of the DP ranks' batches) from the same master weights.
pub struct SerialRun {
    pub losses: Vec<f32>,
    pub params: Vec<(String, Tensor)>,
}

pub fn train_serial(setup: &Setup) -> anyhow::Result<SerialRun> {
    let mut runs = ferrotron_comm_core::run_local(1, |comm| -> Result<SerialRun, BoxError> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let net = Net::new(&tp, setup.arch, &setup.config(), &setup.init())?;
        let params: Vec<Parameter> = net.parameters().into_iter().map(|p| p.param).collect();
        let mut opt = optimizer(setup, params.clone())?;
        let mut rng = RngTracker::new(1234, 0);
        let mut losses = Vec::new();
        for step in 0..setup.steps {
            let (x, target) = setup.global_batch(step);
            let tape = Tape::new();
            opt.zero_grad();
            let output = net.forward(&tape, &x, &mut rng)?;
            let loss = squared_error(&output, &target, setup.dp * setup.dp_rank_elements())?;
            loss.backward()?;
            opt.step()?;
            losses.push(loss.item()?);
        }
        Ok(SerialRun {
            losses,
            params: params
                .iter()
                .map(|p| Ok((p.name().to_string(), p.value()?)))
                .collect::<ferrotron_tape::Result<_>>()?,
        })
    })?;
    Ok(runs.remove(0))
}

/// Asserts that a TP × DP run equals the serial run: the global loss of every step, and
/// every parameter of every DP replica after the last step, unsharded over its TP group.
pub fn assert_matches_serial(what: &str, setup: &Setup, ranks: &[RankResult], serial: &SerialRun) {
    assert_eq!(ranks.len(), setup.tp * setup.dp, "{what}: rank count");
    // group[d][t]: the rank at DP index d, TP index t.
    let mut group: Vec<Vec<&RankResult>> = vec![Vec::new(); setup.dp];
    for r in ranks {
        group[r.dp_rank].push(r);
    }
    for replica in &mut group {
        replica.sort_by_key(|r| r.tp_rank);
        assert_eq!(replica.len(), setup.tp, "{what}: TP group size");
    }

    for step in 0..setup.steps {
        let mut global = 0.0f64;
        for replica in &group {
            let dp_loss = if setup.sequence_parallel {
                replica.iter().map(|r| r.losses[step] as f64).sum::<f64>()
            } else {
                for r in replica {
                    let (got, want) = (r.losses[step], replica[0].losses[step]);
                    assert!(
                        (got - want).abs() <= RTOL * 2.0 * want.abs(),
                        "{what}: step {step} loss of rank {} is {got}, its TP peer has {want}",
                        r.world_rank
                    );
                }
                replica[0].losses[step] as f64
            };
            global += dp_loss / setup.dp as f64;
        }
        let want = serial.losses[step];
        let got = global as f32;
        assert!(
            (got - want).abs() <= RTOL * 2.0 * want.abs(),
            "{what}: step {step} loss {got}, serial {want}"
        );
    }

    for (dp_rank, replica) in group.iter().enumerate() {
        assert_eq!(
            replica[0].params.len(),
            serial.params.len(),
            "{what}: parameter count"
        );
        for (index, (name, want)) in serial.params.iter().enumerate() {
            let (got_name, sharding, _) = &replica[0].params[index];
            assert_eq!(got_name, name, "{what}: parameter order");
            let parts: Vec<Tensor> = replica.iter().map(|r| r.params[index].2.clone()).collect();
            if *sharding == Sharding::Replicated {
                for (tp_rank, p) in parts.iter().enumerate() {
                    assert_close(
                        &format!("{what}: {name} on DP {dp_rank} TP {tp_rank} vs TP 0"),
                        p,
                        &parts[0],
                    );
                }
            }
            let full = sharding.unshard(&parts).expect("unshard");
            assert_close(
                &format!(
                    "{what}: {name} of DP replica {dp_rank} after {} steps",
                    setup.steps
                ),
                &full,
                want,
            );
        }
    }
}

/// The `ferrotron_comm_core::Error` behind a failure, found by walking the crates' error types
/// (whose `#[error(transparent)]` variants hide the wrapped error from `source()`) and
/// `std::error::Error::source` chains (tape's `Custom`, `run_local`'s `RankFailed`).
pub fn comm_error<'a>(
    error: &'a (dyn StdError + 'static),
) -> Option<&'a ferrotron_comm_core::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(c) = e.downcast_ref::<ferrotron_comm_core::Error>() {
            match c {
                ferrotron_comm_core::Error::RankFailed { source, .. } => {
                    current = Some(&**source);
                    continue;
                }
                other => return Some(other),
            }
        }
        let next: Option<&(dyn StdError + 'static)> =
            if let Some(l) = e.downcast_ref::<ferrotron_layers::Error>() {
                match l {
                    ferrotron_layers::Error::Comm(c) => return Some(c),
                    ferrotron_layers::Error::Tape(t) => Some(t),
                    ferrotron_layers::Error::Mappings(m) => Some(m),
                    ferrotron_layers::Error::ParallelState(p) => Some(p),
                    other => other.source(),
                }
            } else if let Some(d) = e.downcast_ref::<ferrotron_ddp::Error>() {
                match d {
                    ferrotron_ddp::Error::Comm(c) => return Some(c),
                    ferrotron_ddp::Error::Tape(t) => Some(t),
                    ferrotron_ddp::Error::ParallelState(p) => Some(p),
                    other => other.source(),
                }
            } else if let Some(m) = e.downcast_ref::<ferrotron_mappings::Error>() {
                match m {
                    ferrotron_mappings::Error::Comm(c) => return Some(c),
                    ferrotron_mappings::Error::Tape(t) => Some(t),
                    other => other.source(),
                }
            } else if let Some(p) = e.downcast_ref::<ferrotron_parallel_state::Error>() {
                match p {
                    ferrotron_parallel_state::Error::Comm(c) => return Some(c),
                    other => other.source(),
                }
            } else if let Some(ferrotron_tape::Error::Custom { source, .. }) =
                e.downcast_ref::<ferrotron_tape::Error>()
            {
                Some(&**source)
            } else {
                e.source()
            };
        current = next;
    }
    None
}
