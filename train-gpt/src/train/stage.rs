//! The model's chunks on this rank as pipeline stages: forward over microbatches, the
//! loss, context-parallel cutting, and the experts' routing report.

use crate::model::{Gpt, Tokens};
use anyhow::Result;
use ferrotron_comm_core::{Communicator, CommunicatorExt};
use ferrotron_ddp::DistributedDataParallel;
use ferrotron_layers::{RngTracker, TensorParallel};
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{Tape, Tensor};
use std::sync::Arc;

use super::*;

/// This rank's chunks of the model with their DDPs and random streams, run as pipeline
/// stages over `state`'s pipeline group (one stage holding everything at `--pp 1`).
pub(super) struct Chunks<'a> {
    pub(super) models: &'a [Gpt],
    /// Every chunk's DDP, in chunk order, then the experts' DDPs.
    pub(super) ddps: &'a [DistributedDataParallel],
    /// Where in `ddps` each chunk's experts' DDP is, if it has experts.
    pub(super) expert_ddps: &'a [Option<usize>],
    pub(super) rngs: &'a mut [RngTracker],
    pub(super) state: &'a ParallelState,
    pub(super) config: &'a TrainConfig,
    /// What training multiplies the loss by before backward (fp16's loss scale).
    pub(super) loss_scale: f64,
}

/// What a pass through the stages is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Forward and backward; the last stage computes each microbatch's loss.
    Train,
    /// Forward only, with the loss.
    Evaluate,
    /// Forward only; the last stage gathers the logits at position `at`.
    Logits { at: usize },
}

impl Chunks<'_> {
    /// The mean over `microbatches` of each one's global token-mean loss, on every rank
    /// (the last stage computes it, then broadcasts it over the pipeline group). Training
    /// also runs backward and averages the gradients over data parallelism; `trace`
    /// returns the pass's timeline.
    pub(super) fn loss(
        &mut self,
        microbatches: &[Microbatch],
        pass: Pass,
        trace: bool,
    ) -> Result<(f32, Vec<ferrotron_pipeline::Span>)> {
        let seq = self.config.model.seq;
        let rows = microbatches[0].ids.len() / seq;
        let (results, timeline) = self.run(microbatches, (seq, rows), pass, trace)?;
        let mut loss = [results.iter().flatten().sum::<f32>() / results.len().max(1) as f32];
        self.state
            .pp()
            .broadcast_slice(&mut loss, self.config.pp - 1)?;
        Ok((loss[0], timeline))
    }

    /// The whole vocabulary's logits at the last position of one sequence `ids`, on the
    /// last stage's ranks (`None` on the others).
    pub(super) fn last_logits(&mut self, ids: &[usize]) -> Result<Option<Vec<f32>>> {
        // Sequence parallelism gives every tensor-parallel rank at least one position:
        // a shorter context is padded at the end, which causal attention keeps from
        // changing the logits before it.
        let tp = self.models[0].tp();
        let len = if tp.context_size() > 1 {
            // Context parallelism cuts the whole context into each rank's two chunks.
            self.config.model.seq
        } else if tp.sequence_parallel() {
            ids.len().max(tp.size())
        } else {
            ids.len()
        };
        let mut padded = ids.to_vec();
        padded.resize(len, 0);
        let copies = self.config.pipeline.microbatch_multiple(self.config.pp);
        let microbatches = vec![
            Microbatch {
                ids: padded,
                labels: Vec::new(),
                positions: None,
            };
            copies
        ];
        let pass = Pass::Logits { at: ids.len() - 1 };
        let (mut results, _) = self.run(&microbatches, (len, 1), pass, false)?;
        Ok((!results.is_empty()).then(|| results.swap_remove(0)))
    }

    /// One pass over `microbatches` of `(len, rows)` tokens each: what the last stage
    /// produced for each (its loss, or its logits), and the timeline if `trace`.
    pub(super) fn run(
        &mut self,
        microbatches: &[Microbatch],
        (len, rows): (usize, usize),
        pass: Pass,
        trace: bool,
    ) -> Result<(Vec<Vec<f32>>, Vec<ferrotron_pipeline::Span>)> {
        let tp = self.models[0].tp();
        // Under context parallelism each rank holds two chunks of every sequence.
        let sliced = context_parts(microbatches, (len, rows), tp)?;
        let (microbatches, len) = match &sliced {
            Some(sliced) => (&sliced[..], len / tp.context_size()),
            None => (microbatches, len),
        };
        let pipe = self.pipeline(microbatches.len(), (len, rows), pass, trace)?;
        // Each microbatch's auxiliary losses count as its share of the step, as its loss.
        let aux_scale = self.loss_scale / microbatches.len() as f64;
        for moe in self.models.iter().flat_map(Gpt::experts) {
            moe.set_aux_loss_scale(aux_scale);
        }
        let train = pass == Pass::Train;
        let mut stages: Vec<GptStage> = self
            .models
            .iter()
            .zip(self.ddps)
            .zip(self.expert_ddps)
            .zip(self.rngs.iter_mut())
            .map(|(((model, ddp), experts), rng)| GptStage {
                model,
                ddp: train.then_some(ddp),
                expert_ddp: experts.filter(|_| train).map(|i| &self.ddps[i]),
                rng,
                dp: self.state.dp_with_cp(),
                microbatches,
                len,
                pass,
                loss_scale: self.loss_scale,
                results: Vec::new(),
                means: Vec::new(),
            })
            .collect();
        let mut refs: Vec<&mut dyn ferrotron_pipeline::Stage> = stages
            .iter_mut()
            .map(|s| s as &mut dyn ferrotron_pipeline::Stage)
            .collect();
        let report = pipe.run(&mut refs)?;
        if pass == Pass::Train {
            for ddp in self.ddps {
                ddp.finish()?;
            }
        }
        let means: Vec<Tensor> = stages.iter_mut().flat_map(|s| s.means.drain(..)).collect();
        let mut results: Vec<Vec<f32>> = stages.into_iter().flat_map(|s| s.results).collect();
        if !means.is_empty() {
            // The step's losses in one read (one host wait), however many microbatches.
            let scalars = (means.iter())
                .map(|m| m.reshape(&[1]))
                .collect::<ferrotron_tape::Result<Vec<_>>>()?;
            let values = Tensor::concat(&scalars.iter().collect::<Vec<_>>(), 0)?.to_vec()?;
            results.extend(values.into_iter().map(|v| vec![v]));
        }
        Ok((results, report.timeline))
    }

    /// The pipeline of one pass over `count` microbatches of sequences of `len`
    /// (this rank's part under context parallelism) in `rows` rows.
    fn pipeline(
        &self,
        count: usize,
        (len, rows): (usize, usize),
        pass: Pass,
        trace: bool,
    ) -> Result<ferrotron_pipeline::Pipeline> {
        let tp = self.models[0].tp();
        // Under sequence parallelism each rank passes on its part of the sequence.
        let local = if tp.sequence_parallel() {
            tp.part(len)?.1
        } else {
            len
        };
        let shape = [local, rows, self.config.model.hidden];
        let mut config =
            ferrotron_pipeline::PipelineConfig::new(self.config.pipeline, count, &shape);
        config.forward_only = pass != Pass::Train;
        // The stages report the loss's global mean themselves.
        config.read_losses = false;
        config.device = self.config.device;
        config.dtype = self.config.precision;
        config.overlap_p2p = self.config.overlap_p2p;
        if trace {
            self.state.pp().barrier()?;
            config.trace_epoch = Some(std::time::Instant::now());
        }
        Ok(ferrotron_pipeline::Pipeline::new(
            self.state.pp().clone(),
            config,
        )?)
    }
}

/// Each microbatch cut to this rank's two chunks of every sequence under context
/// parallelism; `None` without it.
fn context_parts(
    microbatches: &[Microbatch],
    (len, rows): (usize, usize),
    tp: &TensorParallel,
) -> Result<Option<Vec<Microbatch>>> {
    if tp.context_size() == 1 {
        return Ok(None);
    }
    let part = |values: &[_]| context_part(values, len, rows, tp);
    let sliced = (microbatches.iter())
        .map(|m| {
            Ok(Microbatch {
                ids: part(&m.ids)?,
                labels: context_part(&m.labels, len, rows, tp)?,
                positions: (m.positions.as_ref()).map(|p| part(p)).transpose()?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Some(sliced))
}

/// One model chunk as a pipeline stage: the forward of a microbatch and, on the last
/// stage, what the pass is for.
pub(super) struct GptStage<'a> {
    pub(super) model: &'a Gpt,
    pub(super) ddp: Option<&'a DistributedDataParallel>,
    pub(super) expert_ddp: Option<&'a DistributedDataParallel>,
    pub(super) rng: &'a mut RngTracker,
    pub(super) dp: &'a Arc<dyn Communicator>,
    pub(super) microbatches: &'a [Microbatch],
    pub(super) len: usize,
    pub(super) pass: Pass,
    /// What training multiplies the loss by before backward.
    pub(super) loss_scale: f64,
    /// The last stage's logits of each microbatch.
    pub(super) results: Vec<Vec<f32>>,
    /// The last stage's loss (its global mean) of each microbatch, on the device until
    /// the step ends.
    pub(super) means: Vec<Tensor>,
}

impl ferrotron_pipeline::Stage for GptStage<'_> {
    fn forward(
        &mut self,
        tape: &Tape,
        microbatch: usize,
        input: Option<&ferrotron_tape::Tensor>,
    ) -> std::result::Result<ferrotron_tape::Tensor, Box<dyn std::error::Error + Send + Sync>> {
        let Microbatch {
            ids,
            labels,
            positions,
        } = &self.microbatches[microbatch];
        let rows = ids.len() / self.len;
        // Only training draws dropout masks.
        let rng = (self.pass == Pass::Train).then_some(&mut *self.rng);
        let tokens = Tokens {
            ids,
            positions: positions.as_deref(),
        };
        let output = self
            .model
            .forward_chunk(tape, tokens, input, self.len, rows, rng)?;
        if !self.model.is_last() {
            return Ok(output);
        }
        if let Pass::Logits { at } = self.pass {
            self.results.push(self.logits_at(&output, at)?);
            return Ok(output);
        }
        let loss = self.model.loss(&output, labels, self.dp)?;
        self.means.push(loss.global_mean);
        // The scaler's `scale_loss`, by its value: the stage holds the scale, not the
        // scaler (which the training loop updates between steps).
        if self.pass == Pass::Train && self.loss_scale != 1.0 {
            return Ok(loss.loss.scale(self.loss_scale)?);
        }
        Ok(loss.loss)
    }

    fn before_backward(&mut self, last: bool) {
        for ddp in self.ddp.iter().chain(&self.expert_ddp) {
            ddp.set_sync_enabled(last);
        }
    }
}

impl GptStage<'_> {
    /// The whole vocabulary's logits at position `at` of the sequence, on every rank of
    /// the last stage: the context-parallel rank holding it gathers them over its
    /// tensor-parallel group and hands them to the others.
    pub(super) fn logits_at(&self, output: &Tensor, at: usize) -> Result<Vec<f32>> {
        let tp = self.model.tp();
        let vocab = self.model.config().vocab;
        let sizes = ferrotron_mappings::split_sizes(vocab, tp.size())?;
        let (owner, local) = match tp.context_size() {
            1 => (0, at),
            cp => ferrotron_layers::context_parallel_position(at, self.len * cp, cp)?,
        };
        let mut logits = vec![0.0; vocab];
        if owner == tp.context_rank() {
            let last = output.narrow(0, local, 1)?;
            let full = ferrotron_mappings::gather_from_region(&last, tp.group(), 2, Some(&sizes))?;
            logits = full.to_vec()?;
        }
        if let Some(group) = tp.context_parallel() {
            group.broadcast_slice(&mut logits, owner)?;
        }
        Ok(logits)
    }
}

/// This context-parallel rank's positions of sequence-first `values` (`len` positions of
/// `rows` each): its two chunks, in the order it holds them. Empty stays empty.
fn context_part<T: Copy>(
    values: &[T],
    len: usize,
    rows: usize,
    tp: &TensorParallel,
) -> Result<Vec<T>> {
    let (rank, size) = (tp.context_rank(), tp.context_size());
    Ok(ferrotron_layers::context_parallel_batch(
        values, len, rows, rank, size,
    )?)
}

/// The step's routing over every mixture of experts of the model and every rank's
/// tokens, as a line: token slots per expert (summed over the layers) and the fraction
/// dropped. `None` for a dense model. Collective over the data- (and context-) parallel
/// and pipeline groups.
pub(super) fn expert_routing(chunks: &Chunks<'_>) -> Result<Option<String>> {
    let Some((config, _)) = chunks.config.model.moe else {
        return Ok(None);
    };
    let mut counts = vec![0.0f64; config.num_experts + 1];
    for moe in chunks.models.iter().flat_map(Gpt::experts) {
        let stats = moe.take_stats();
        for (total, n) in counts.iter_mut().zip(&stats.tokens_per_expert) {
            *total += *n as f64;
        }
        counts[config.num_experts] += stats.dropped as f64;
    }
    let state = chunks.state;
    for group in [state.dp_with_cp(), state.pp()] {
        group.all_reduce_slice(&mut counts, ferrotron_comm_core::ReduceOp::Sum)?;
    }
    let (per_expert, dropped) = counts.split_at(config.num_experts);
    let slots: f64 = per_expert.iter().sum();
    let list: Vec<String> = per_expert.iter().map(|n| format!("{n:.0}")).collect();
    Ok(Some(format!(
        "  experts: token slots {} | dropped {:.1}%",
        list.join(" "),
        100.0 * dropped[0] / slots.max(1.0)
    )))
}
