//! Runs a plan: forwards and backwards on the user's stages, activations and gradients
//! between ranks in batched exchanges, one tape per microbatch in flight.

use crate::error::{Error, Result};
use crate::schedule::{peak_in_flight, Action, Schedule};
use crate::trace::Span;
use exchange::{code, Posted};
use ferrotron_comm_core::{Communicator, DType};
use ferrotron_tape::{Device, GradHandle, Parameter, Tape, Tensor};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

mod exchange;

/// One model chunk of a pipeline stage, as this rank runs it.
pub trait Stage {
    /// The forward of `microbatch` on `tape`. `input` is the previous stage's activation,
    /// recorded on `tape` so that backward yields its gradient (`None` on the model's first
    /// stage, which reads its own data). Returns the activation for the next stage, of the
    /// step's fixed shape, or, on the model's last stage, the microbatch's loss (one
    /// element). The step's gradients are the mean over microbatches of each loss's.
    fn forward(
        &mut self,
        tape: &Tape,
        microbatch: usize,
        input: Option<&Tensor>,
    ) -> std::result::Result<Tensor, Box<dyn std::error::Error + Send + Sync>>;

    /// Called before each backward of this chunk; `last` is true for its last microbatch.
    /// A stage under data parallelism turns gradient sync on only then (as DDP's
    /// `no_sync` for the others), so each gradient is reduced once per step.
    fn before_backward(&mut self, last: bool) {
        let _ = last;
    }
}

/// What one step runs.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// The schedule.
    pub schedule: Schedule,
    /// Microbatches per step.
    pub microbatches: usize,
    /// The shape of every activation (and its gradient) between stages, fixed per step.
    pub shape: Vec<usize>,
    /// Record a timeline of the step, in microseconds since this instant (use one instant
    /// for every rank of a process so that their timelines line up).
    pub trace_epoch: Option<Instant>,
    /// Run forwards only, recording nothing for backward (evaluation, inference): the
    /// last stage's outputs come back in [`StepReport::outputs`], of any shape.
    pub forward_only: bool,
    /// Where the stages compute: received activations and gradients are placed there.
    pub device: Device,
    /// The format activations and their gradients are stored in and travel in (f32, or
    /// bf16 / f16 for a 16-bit model, as Megatron's `pipeline_dtype`): backward keeps a
    /// 16-bit activation's gradient in its format.
    pub dtype: DType,
    /// Read the last stage's losses into [`StepReport::losses`] when the step ends (one
    /// host wait on a device); off for stages that report their loss themselves, so the
    /// step reads nothing it does not use.
    pub read_losses: bool,
    /// Post each exchange's receives when the previous exchange ends (Megatron's
    /// `--overlap-p2p-comm`), so that a received tensor's copy runs beside the compute
    /// queued before it is needed instead of after it. The local backend only (threads):
    /// a stage that fails must withdraw the receives it posted, which MPI's cannot and
    /// NCCL cannot post alone; [`Pipeline::new`] refuses it elsewhere.
    pub overlap_p2p: bool,
}

impl PipelineConfig {
    /// A step of `microbatches` under `schedule`, exchanging tensors of `shape`.
    pub fn new(schedule: Schedule, microbatches: usize, shape: &[usize]) -> PipelineConfig {
        PipelineConfig {
            schedule,
            microbatches,
            shape: shape.to_vec(),
            trace_epoch: None,
            forward_only: false,
            device: Device::Cpu,
            dtype: DType::F32,
            read_losses: true,
            overlap_p2p: false,
        }
    }
}

/// What a step did on this rank.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// Each microbatch's loss, in microbatch order, on the rank holding the model's last
    /// stage; empty on the others, and when [`PipelineConfig::read_losses`] is off.
    pub losses: Vec<f32>,
    /// The most microbatches whose activations this rank held at once.
    pub peak_in_flight: usize,
    /// The step's forwards, backwards and exchanges, if tracing was on.
    pub timeline: Vec<Span>,
    /// Forward-only steps: each microbatch's output of the model's last stage, in
    /// microbatch order, on the rank holding it; empty elsewhere.
    pub outputs: Vec<Tensor>,
}

impl StepReport {
    /// The mean of [`losses`](Self::losses) (the step's loss), on the last stage.
    pub fn mean_loss(&self) -> Option<f32> {
        (!self.losses.is_empty())
            .then(|| self.losses.iter().sum::<f32>() / self.losses.len() as f32)
    }
}

/// A pipeline over one pipeline-parallel group: this rank is stage `group.rank()` and
/// holds `schedule.chunks()` model chunks.
pub struct Pipeline {
    group: Arc<dyn Communicator>,
    config: PipelineConfig,
    plan: Vec<Action>,
}

impl Pipeline {
    /// Plans this rank's part of a step. Every rank of `group` must build its pipeline with
    /// the same configuration.
    pub fn new(group: Arc<dyn Communicator>, config: PipelineConfig) -> Result<Pipeline> {
        let (pp, rank, m) = (group.size(), group.rank(), config.microbatches);
        if code(config.dtype).is_none() {
            return Err(Error::Config(format!(
                "activations travel as f32, bf16 or f16, not {}; set PipelineConfig::dtype \
                 to their storage format",
                config.dtype
            )));
        }
        // A failing stage gives up the receives it posted ahead: only the local backend's
        // can be withdrawn (MPI's would wait for a peer that may never send; NCCL cannot
        // post a receive alone).
        if config.overlap_p2p && group.backend() != "local" {
            return Err(Error::Config(format!(
                "overlap_p2p posts receives ahead, which the {} backend cannot withdraw when \
                 a stage fails; turn it off there (the local backend supports it)",
                group.backend()
            )));
        }
        let plan = if config.forward_only {
            config.schedule.forward_plan(pp, rank, m)?
        } else {
            config.schedule.plan(pp, rank, m)?
        };
        Ok(Pipeline {
            group,
            config,
            plan,
        })
    }

    /// This rank's plan.
    pub fn plan(&self) -> &[Action] {
        &self.plan
    }

    /// The most microbatches this rank will hold at once under the plan.
    pub fn planned_peak_in_flight(&self) -> usize {
        peak_in_flight(&self.plan)
    }

    /// The virtual stage of this rank's chunk `chunk`: `chunk · pp + rank`.
    pub fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.group.size() + self.group.rank()
    }

    /// How many virtual stages the model has: `pp · chunks`.
    pub fn virtual_stages(&self) -> usize {
        self.group.size() * self.config.schedule.chunks()
    }

    /// Runs one step over this rank's chunks (as many as the schedule's chunks, in chunk
    /// order). Parameter gradients accumulate in the stages' parameters.
    pub fn run(&self, chunks: &mut [&mut dyn Stage]) -> Result<StepReport> {
        if chunks.len() != self.config.schedule.chunks() {
            return Err(Error::Config(format!(
                "the {} schedule runs {} model chunk(s) per rank, but {} were given",
                self.config.schedule.name(),
                self.config.schedule.chunks(),
                chunks.len()
            )));
        }
        let mut step = Step::new(self);
        let overlap = self.config.overlap_p2p;
        let mut exchanges = (self.plan.iter()).filter_map(|action| match action {
            Action::Exchange(transfers) => Some(transfers),
            _ => None,
        });
        if let (true, Some(first)) = (overlap, exchanges.next()) {
            step.post_receives(first)?;
        }
        for action in &self.plan {
            let started = Instant::now();
            match action {
                Action::Forward { chunk, microbatch } => {
                    step.forward(&mut *chunks[*chunk], *chunk, *microbatch)?
                }
                Action::Backward { chunk, microbatch } => {
                    step.backward(&mut *chunks[*chunk], *chunk, *microbatch)?
                }
                Action::Exchange(transfers) => {
                    step.exchange(transfers)?;
                    if let (true, Some(next)) = (overlap, exchanges.next()) {
                        step.post_receives(next)?;
                    }
                }
            }
            if let Some(epoch) = self.config.trace_epoch {
                step.report
                    .timeline
                    .push(Span::new(action.clone(), epoch, started));
            }
        }
        step.finish()
    }
}

type Key = (usize, usize);

/// A microbatch between its forward and its backward on this rank.
struct InFlight {
    /// The received activation, whose gradient goes back to the previous stage.
    input: Option<Parameter>,
    /// Where backward starts: the activation sent on, or the loss, without its values
    /// (Megatron's `deallocate_output_tensor`); `None` if nothing trainable led to it.
    output: Option<GradHandle>,
}

/// The bookkeeping of one step on this rank.
struct Step<'p> {
    pipeline: &'p Pipeline,
    in_flight: HashMap<Key, InFlight>,
    received: HashMap<Key, Tensor>,
    gradients: HashMap<Key, Tensor>,
    /// The forwards (backwards) that will need a received activation (gradient), in the
    /// order the plan runs them: receives fill them in this order.
    awaiting_input: VecDeque<Key>,
    awaiting_gradient: VecDeque<Key>,
    /// The latest forward's output (backward's input gradient) until an exchange sends it.
    to_send_forward: Option<(Key, Tensor)>,
    to_send_backward: Option<(Key, Tensor)>,
    /// Receives posted ahead, one entry per exchange, in plan order.
    posted: VecDeque<Vec<Posted>>,
    backwards_done: Vec<usize>,
    /// The last stage's losses, by microbatch, read together when the step ends.
    losses: Vec<(usize, Tensor)>,
    report: StepReport,
}

impl<'p> Step<'p> {
    fn new(pipeline: &'p Pipeline) -> Step<'p> {
        let last = pipeline.virtual_stages() - 1;
        let mut awaiting_input = VecDeque::new();
        let mut awaiting_gradient = VecDeque::new();
        for action in &pipeline.plan {
            match *action {
                Action::Forward { chunk, microbatch } if pipeline.virtual_stage(chunk) != 0 => {
                    awaiting_input.push_back((chunk, microbatch))
                }
                Action::Backward { chunk, microbatch } if pipeline.virtual_stage(chunk) != last => {
                    awaiting_gradient.push_back((chunk, microbatch))
                }
                _ => {}
            }
        }
        Step {
            pipeline,
            in_flight: HashMap::new(),
            received: HashMap::new(),
            gradients: HashMap::new(),
            awaiting_input,
            awaiting_gradient,
            to_send_forward: None,
            to_send_backward: None,
            posted: VecDeque::new(),
            backwards_done: vec![0; pipeline.config.schedule.chunks()],
            losses: Vec::new(),
            report: StepReport::default(),
        }
    }

    /// The step's report, with the losses read from the device in one transfer (one host
    /// wait per step, however many microbatches).
    fn finish(mut self) -> Result<StepReport> {
        if self.losses.is_empty() || !self.pipeline.config.read_losses {
            return Ok(self.report);
        }
        // f32 whatever format a stage's loss is stored in, so they concatenate.
        let scalars = (self.losses.iter())
            .map(|(_, loss)| loss.to_dtype(DType::F32)?.reshape(&[1]))
            .collect::<ferrotron_tape::Result<Vec<_>>>()?;
        let values = Tensor::concat(&scalars.iter().collect::<Vec<_>>(), 0)?.to_vec()?;
        let count = self.losses.iter().map(|&(m, _)| m + 1).max().unwrap_or(0);
        self.report.losses = vec![f32::NAN; count];
        for (&(microbatch, _), value) in self.losses.iter().zip(values) {
            self.report.losses[microbatch] = value;
        }
        Ok(self.report)
    }

    /// The format of what travels forward (activations) or backward (gradients).
    /// What a transfer carries: activations and their gradients alike.
    fn format(&self) -> DType {
        self.pipeline.config.dtype
    }

    fn is_last_stage(&self, chunk: usize) -> bool {
        self.pipeline.virtual_stage(chunk) + 1 == self.pipeline.virtual_stages()
    }

    fn forward(&mut self, stage: &mut dyn Stage, chunk: usize, microbatch: usize) -> Result<()> {
        let vstage = self.pipeline.virtual_stage(chunk);
        let tape = Tape::new();
        let input = if vstage == 0 {
            None
        } else {
            let value = self
                .received
                .remove(&(chunk, microbatch))
                .ok_or_else(|| out_of_step("an activation", vstage, microbatch))?;
            Some(Parameter::activation("pipeline.input", value))
        };
        let watched = input.as_ref().map(|p| tape.watch(p)).transpose()?;
        let forward_only = self.pipeline.config.forward_only;
        let mut run = || stage.forward(&tape, microbatch, watched.as_ref());
        let output = if forward_only {
            tape.no_grad(run)
        } else {
            run()
        }
        .map_err(|source| Error::Stage {
            stage: vstage,
            microbatch,
            source,
        })?;
        if forward_only {
            self.report.peak_in_flight = 1;
            if self.is_last_stage(chunk) {
                self.report.outputs.push(output);
            } else {
                self.to_send_forward = Some(((chunk, microbatch), output));
            }
            return Ok(());
        }
        let handle = output.grad_handle();
        if self.is_last_stage(chunk) {
            if output.numel() != 1 {
                return Err(Error::Config(format!(
                    "the last stage's forward must return the microbatch's loss (one \
                     element), but returned shape {:?}",
                    output.shape()
                )));
            }
            // Read when the step ends, with the other microbatches' losses.
            self.losses.push((microbatch, output.detach()));
        } else {
            // The next exchange sends it, and then nothing here holds its values.
            self.to_send_forward = Some(((chunk, microbatch), output));
        }
        let flight = InFlight {
            input,
            output: handle,
        };
        self.in_flight.insert((chunk, microbatch), flight);
        self.report.peak_in_flight = self.report.peak_in_flight.max(self.in_flight.len());
        Ok(())
    }

    fn backward(&mut self, stage: &mut dyn Stage, chunk: usize, microbatch: usize) -> Result<()> {
        let vstage = self.pipeline.virtual_stage(chunk);
        let flight = self
            .in_flight
            .remove(&(chunk, microbatch))
            .ok_or_else(|| out_of_step("a forward", vstage, microbatch))?;
        self.backwards_done[chunk] += 1;
        stage.before_backward(self.backwards_done[chunk] == self.pipeline.config.microbatches);
        let gradient = if self.is_last_stage(chunk) {
            None
        } else {
            let received = self.gradients.remove(&(chunk, microbatch));
            Some(received.ok_or_else(|| out_of_step("a gradient", vstage, microbatch))?)
        };
        // An output that does not depend on anything trainable has nothing to propagate.
        if let Some(output) = &flight.output {
            let seed = match gradient {
                Some(gradient) => gradient,
                None => {
                    let scale = 1.0 / self.pipeline.config.microbatches as f32;
                    Tensor::full(output.shape(), scale)
                }
            };
            output.backward_with_grad(&seed.to_device(output.device())?)?;
        }
        if let Some(input) = flight.input {
            let grad = match input.grad() {
                Some(grad) => grad,
                None => {
                    let config = &self.pipeline.config;
                    Tensor::full_as(&input.shape(), 0.0, config.dtype, config.device)?
                }
            };
            self.to_send_backward = Some(((chunk, microbatch), grad));
        }
        Ok(())
    }
}

fn out_of_step(what: &str, stage: usize, microbatch: usize) -> Error {
    Error::Config(format!(
        "internal: stage {stage} got {what} for microbatch {microbatch} out of step; every \
         rank of the pipeline group must run the same schedule and microbatch count"
    ))
}
