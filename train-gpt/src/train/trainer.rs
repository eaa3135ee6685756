//! The step loop: forward and backward over microbatches, gradient reduction, clipping,
//! the optimizer step and the loss scale, with what each step records.

use crate::checkpoint::{self, TrainerState};
use crate::data::{Corpus, DistributedSampler, Split};
use crate::memory::{self, Phase};
use crate::model::{Gpt, RankModel};
use crate::report::Progress;
use anyhow::{bail, Result};
use ferrotron_comm_core::CommunicatorExt;
use ferrotron_layers::{GradScaler, Module, ShardedParameter};
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{DType, Parameter};
use std::path::PathBuf;

use super::*;

/// What the steps so far produced.
#[derive(Default)]
pub(super) struct History {
    pub(super) losses: Vec<f32>,
    pub(super) validation: Vec<(usize, f32)>,
    pub(super) grad_norms: Vec<(usize, f64)>,
    pub(super) tied_copies: Option<TiedCopies>,
    /// The last step's pipeline timeline, when tracing.
    pub(super) timeline: Vec<ferrotron_pipeline::Span>,
    /// The last step's device streams on the modelled timeline, when tracing (emulated).
    pub(super) streams: ferrotron_tape::timeline::Timeline,
    /// The checkpoints this run wrote.
    pub(super) saved: Vec<PathBuf>,
    /// The step a stop signal ended the run after.
    pub(super) stopped: Option<usize>,
    /// How long training stood still for saves (all of a save, or with `--async-save`
    /// its copy to host memory and the wait for the previous one).
    pub(super) save_wait: std::time::Duration,
}

/// The per-step machinery of one rank: the optimizer, the loss scaler, the sampler.
pub(super) struct Trainer<'a> {
    pub(super) optimizer: TrainOptimizer,
    pub(super) scaler: Option<GradScaler>,
    pub(super) sampler: DistributedSampler,
    /// This rank's parameters, as clipping and unscaling take them.
    pub(super) params: Vec<ShardedParameter>,
    /// This rank's copy of a tied embedding another stage also holds.
    pub(super) tied_copy: Option<Parameter>,
    pub(super) progress: Option<&'a Progress>,
    /// The save still being written (`--async-save`).
    pub(super) pending_save: Option<PendingSave>,
}

impl<'a> Trainer<'a> {
    pub(super) fn new(
        optimizer: TrainOptimizer,
        chunks: &Chunks<'_>,
        corpus: &Corpus,
        progress: Option<&'a Progress>,
    ) -> Result<Self> {
        let (config, state) = (chunks.config, chunks.state);
        Ok(Trainer {
            optimizer,
            scaler: config.loss_scaler.map(GradScaler::new).transpose()?,
            sampler: sampler(corpus, config, state),
            params: chunks.models.iter().flat_map(Module::parameters).collect(),
            tied_copy: chunks.models.iter().find_map(Gpt::tied_copy),
            progress,
            pending_save: None,
        })
    }

    /// Continues where the checkpoint in `dir` stopped: the optimizer state, every
    /// chunk's random streams, the loss scale and the curves so far (the weights are
    /// already loaded).
    pub(super) fn resume(
        &mut self,
        dir: &std::path::Path,
        saved: &TrainerState,
        chunks: &mut Chunks<'_>,
        history: &mut History,
    ) -> Result<()> {
        let (state, config) = (chunks.state, chunks.config);
        let tp = chunks.models[0].tp();
        let rank_model = RankModel(chunks.models);
        let dirs = saved.stage_dirs(dir);
        let dirs: Vec<&std::path::Path> = dirs.iter().map(PathBuf::as_path).collect();
        let optimizer_state = ferrotron_layers::checkpoint::load_optimizer_state_across(
            &rank_model,
            &dirs,
            saved.tp,
            tp.rank(),
            tp.size(),
        )?;
        // Listed in the model's order; the distributed optimizer lists experts last.
        let optimizer_state =
            in_order_of(&rank_model, self.optimizer.model_params(), optimizer_state)?;
        self.optimizer.as_dyn().load_state(&optimizer_state)?;
        // Random streams belong to a chunk of one layout: restored only at the saved one.
        if (saved.pp, saved.chunks) == (config.pp, config.pipeline.chunks()) {
            let dir = checkpoint::stage_dir(dir, state.pp_rank(), config.pp);
            checkpoint::restore_rng(&dir, saved, chunks.rngs, tp.rank(), tp.size())?;
        }
        if let (Some(scaler), Some(state)) = (&mut self.scaler, saved.loss_scaler) {
            scaler.load_state(state)?;
        }
        history.losses.extend_from_slice(&saved.losses);
        history.validation.extend_from_slice(&saved.validation);
        Ok(())
    }

    /// The steps from where `history` ends to `--steps`, with the validation loss when
    /// due; returns the host↔device copies and host waits of a step, averaged over the
    /// steps after the first (which also uploads the model's first use of each constant).
    pub(super) fn train(
        &mut self,
        chunks: &mut Chunks<'_>,
        corpus: &Corpus,
        history: &mut History,
    ) -> Result<Steady> {
        let config = chunks.config;
        let first_step = history.losses.len();
        let mut measures = Measures::new(config);
        for step in first_step..config.steps {
            let steady = step > first_step || config.steps == first_step + 1;
            let started = measures.begin(config, steady);
            self.step(chunks, corpus, step, history)?;
            if let Some(started) = started {
                measures.end(config, started, history)?;
            }
            if self.after_step(chunks, corpus, step + 1, history)? {
                history.stopped = Some(step + 1);
                break;
            }
        }
        self.finish_save(chunks, history)?;
        if let Some(progress) = self.progress {
            progress.finish();
        }
        Ok(measures.steady())
    }

    /// What follows step `done` (counted from 1): `--check`'s comparison of the tied
    /// copies, the ranks' agreement to stop on a signal, the validation loss and the save
    /// when due. Returns whether to stop.
    fn after_step(
        &mut self,
        chunks: &mut Chunks<'_>,
        corpus: &Corpus,
        done: usize,
        history: &mut History,
    ) -> Result<bool> {
        let config = chunks.config;
        // `--check`'s own reads of the tied copies, outside the step's counts.
        if config.check_tied {
            self.compare_tied_copies(chunks.state, done - 1, history)?;
        }
        crate::faults::kill_point(chunks.state.world().rank(), done);
        let stop = stop_agreed(chunks)?;
        let interval = config.eval_interval;
        if interval > 0 && (done.is_multiple_of(interval) || done == config.steps) && !stop {
            let _passes = memory::enter(Phase::Passes);
            let loss = validation_loss(chunks, corpus)?;
            history.validation.push((done, loss));
        }
        let every = config.save_interval.unwrap_or(0);
        let due = done == config.steps || stop || (every > 0 && done.is_multiple_of(every));
        if let (Some(root), true) = (&config.save, due) {
            let started = std::time::Instant::now();
            let _saving = memory::enter(Phase::Checkpoint);
            // One save in flight at a time: the previous one completes first.
            self.finish_save(chunks, history)?;
            let pending = save(
                root,
                chunks,
                &mut self.optimizer,
                self.scaler.as_ref(),
                history,
            )?;
            self.pending_save = Some(pending);
            if !config.async_save {
                self.finish_save(chunks, history)?;
            }
            history.save_wait += started.elapsed();
        }
        Ok(stop)
    }

    /// Completes the save in flight, if any, recording its directory.
    pub(super) fn finish_save(&mut self, chunks: &Chunks<'_>, history: &mut History) -> Result<()> {
        if let Some(pending) = self.pending_save.take() {
            let saved = pending.finish(chunks.state.world(), chunks.config.save_keep)?;
            history.saved.push(saved);
        }
        Ok(())
    }

    /// One training step (0-based `step`): forward and backward of every microbatch
    /// (each gradient bucket reduced as backward completes it), unscaling and clipping,
    /// the update, the loss scale.
    pub(super) fn step(
        &mut self,
        chunks: &mut Chunks<'_>,
        corpus: &Corpus,
        step: usize,
        history: &mut History,
    ) -> Result<()> {
        let (config, state) = (chunks.config, chunks.state);
        if let Some(fail) = &config.fail_collective {
            fail.arm_at(state.world().rank(), step + 1);
        }
        self.optimizer.as_dyn().zero_grad();
        let reading = memory::enter(Phase::Data);
        let microbatches = microbatches(corpus, Split::Train, &self.sampler.starts(step), config)?;
        drop(reading);
        chunks.loss_scale = self.loss_scale(chunks, step);
        let passes = memory::enter(Phase::Passes);
        // Routing counts of this step's training pass only.
        (chunks.models.iter().flat_map(Gpt::experts)).for_each(|moe| drop(moe.take_stats()));
        let trace = config.trace && step + 1 == config.steps;
        let (step_loss, spans) = chunks.loss(&microbatches, Pass::Train, trace)?;
        drop(passes);
        history.timeline = spans;
        let routing = expert_routing(chunks)?;
        let _optimizer = memory::enter(Phase::Optimizer);
        // Every rank holds the same global mean, so all of them stop here together.
        if !step_loss.is_finite() {
            bail!(diverged(step, step_loss, history, config));
        }
        let unscaled = match &self.scaler {
            Some(scaler) => {
                let tp = chunks.models[0].tp();
                (self.optimizer).unscale_grads(scaler, &self.params, tp, &[state.pp()])?
            }
            None => true,
        };
        let finite = unscaled && self.clip(chunks, step, history)?;
        if finite {
            self.optimizer.as_dyn().step()?;
        }
        self.update_scaler(unscaled, step);
        history.losses.push(step_loss);
        if let Some(progress) = self.progress {
            progress.step(step + 1, step_loss);
            routing.inspect(|line| progress.note(line));
        }
        Ok(())
    }

    /// What step `step` multiplies its loss by: the loss scale (1 without one), or
    /// infinity on the rank `--inject-grad-overflow` names for this step (the last one).
    fn loss_scale(&self, chunks: &Chunks<'_>, step: usize) -> f64 {
        let (config, state) = (chunks.config, chunks.state);
        let tp = chunks.models[0].tp();
        let last_rank = state.pp_rank() + 1 == config.pp
            && tp.rank() + 1 == tp.size()
            && state.dp_rank() + 1 == state.dp_size();
        match config.inject_grad_overflow == Some(step + 1) && last_rank {
            true => f64::INFINITY,
            false => self.scaler.as_ref().map_or(1.0, GradScaler::scale),
        }
    }

    /// Clips to `--clip-grad`, recording the norm: `false` (skip the step on every
    /// rank) when it is not finite.
    pub(super) fn clip(
        &mut self,
        chunks: &Chunks<'_>,
        step: usize,
        history: &mut History,
    ) -> Result<bool> {
        let Some(max_norm) = chunks.config.clip_grad else {
            return Ok(true);
        };
        let tp = chunks.models[0].tp();
        let groups = [chunks.state.pp()];
        let norm = self
            .optimizer
            .clip_grad_norm(&self.params, tp, &groups, max_norm)?;
        history.grad_norms.push((step + 1, norm.norm));
        if let (false, Some(progress)) = (norm.is_finite(), self.progress) {
            progress.note(&format!(
                "step {}: the gradient norm is {}; step skipped on every rank",
                step + 1,
                norm.norm
            ));
        }
        Ok(norm.is_finite())
    }

    /// Moves fp16's loss scale after a step that was (`unscaled`) or was not skipped.
    pub(super) fn update_scaler(&mut self, unscaled: bool, step: usize) {
        let Some(scaler) = &mut self.scaler else {
            return;
        };
        let before = scaler.scale();
        scaler.update(unscaled);
        if let (false, Some(progress)) = (unscaled, self.progress) {
            progress.note(&format!(
                "step {}: gradients overflowed at loss scale {}; step skipped on every \
                 rank, loss scale now {}",
                step + 1,
                readable(before),
                readable(scaler.scale())
            ));
        }
    }

    /// Compares this rank's copy of the tied embedding with the other stage's, bit by
    /// bit, over the embedding group (the ranks of the first and last stage).
    pub(super) fn compare_tied_copies(
        &self,
        state: &ParallelState,
        step: usize,
        history: &mut History,
    ) -> Result<()> {
        let (Some(copy), Some(group)) = (&self.tied_copy, state.embedding()) else {
            return Ok(());
        };
        let value = copy.value()?.to_dtype(DType::F32)?.to_vec()?;
        let all: Vec<f32> = group.all_gather_vec(&value)?;
        let (first, last) = all.split_at(value.len());
        let differing = (first.iter().zip(last))
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let record = history.tied_copies.get_or_insert_with(TiedCopies::default);
        record.steps += 1;
        if differing > 0 && record.first_difference.is_none() {
            record.first_difference = Some((step + 1, differing));
        }
        Ok(())
    }
}

/// Why training stops at step `step` (0-based), whose loss is not finite, and what to
/// change.
fn diverged(step: usize, loss: f32, history: &History, config: &TrainConfig) -> String {
    let before = (history.losses.last()).map_or("none".into(), |l| l.to_string());
    let clip = match config.clip_grad {
        Some(norm) => format!("clip harder (--clip-grad, now {norm})"),
        None => "clip with --clip-grad (now off)".to_string(),
    };
    format!(
        "step {}: the loss is {loss} (step {step} had {before}): training diverged; lower \
         --lr (now {}), lengthen --lr-warmup-steps (now {}) or {clip}",
        step + 1,
        config.schedule.lr,
        config.schedule.warmup_steps
    )
}
