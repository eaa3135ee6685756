//! Saving: a checkpoint of every rank's shards, written while training goes on, and the
//! ranks' agreement to stop on a signal.

use crate::checkpoint::{self, TrainerState};
use anyhow::Result;
use ferrotron_comm_core::Communicator;
use ferrotron_layers::GradScaler;
use std::path::PathBuf;
use std::sync::Arc;

use super::*;

/// Whether a stop signal reached any rank: every rank asks after every step, so all of
/// them stop after the same one (a rank that saw the signal later still stops with the
/// rest). One small all-reduce of host memory a step when a signal is watched.
pub(super) fn stop_agreed(chunks: &Chunks<'_>) -> Result<bool> {
    let Some(flag) = chunks.config.stop else {
        return Ok(false);
    };
    let mut seen = [u8::from(flag.load(std::sync::atomic::Ordering::Relaxed))];
    let world = chunks.state.world();
    world.all_reduce(
        ferrotron_comm_core::BufMut::from(&mut seen[..]),
        ferrotron_comm_core::ReduceOp::Max,
    )?;
    Ok(seen[0] == 1)
}

/// Starts the checkpoint of the steps so far under `root`, in a partial directory: each
/// stage's weights, optimizer state and random streams are copied to host memory now and
/// written by this thread, or with `--async-save` by a background one while training
/// goes on. [`PendingSave::finish`] completes it.
pub(super) fn save(
    root: &std::path::Path,
    chunks: &mut Chunks<'_>,
    optimizer: &mut TrainOptimizer,
    scaler: Option<&GradScaler>,
    history: &History,
) -> Result<PendingSave> {
    let (state, config) = (chunks.state, chunks.config);
    let world = state.world();
    let step = history.losses.len();
    if world.rank() == 0 {
        checkpoint::prepare_save(root, step)?;
    }
    world.barrier()?;
    let dir = &checkpoint::partial_dir(root, step);
    let tp = chunks.models[0].tp();
    let (files, rng) = snapshot(dir, chunks, optimizer)?;
    let write = move || -> Result<()> {
        if rng.is_some() {
            crate::faults::point("before the shards", step);
        }
        for file in files {
            file.write()?;
        }
        if let Some((path, text)) = rng {
            checkpoint::write_atomically(&path, &text)?;
            crate::faults::point("after the shards", step);
        }
        Ok(())
    };
    let writer = match config.async_save {
        true => Some(std::thread::spawn(write)),
        false => {
            write()?;
            None
        }
    };
    let trainer_state = (world.rank() == 0).then(|| TrainerState {
        format: checkpoint::FORMAT,
        tp: tp.size(),
        pp: config.pp,
        chunks: config.pipeline.chunks(),
        model: config.model,
        global_batch: config.batch * state.dp_size(),
        losses: history.losses.clone(),
        validation: history.validation.clone(),
        loss_scaler: scaler.map(GradScaler::state),
    });
    Ok(PendingSave {
        root: root.to_path_buf(),
        step,
        writer,
        trainer_state,
    })
}

/// The files a rank writes of a checkpoint, and its random streams' file (path, text).
type Snapshot = (
    Vec<ferrotron_layers::checkpoint::PendingFile>,
    Option<(PathBuf, String)>,
);

/// This rank's files of a checkpoint in `dir`, copied to host memory now: the shards and
/// optimizer state it writes (every data-parallel rank takes the optimizer state, which
/// gathers a sharded one; one replica of each stage writes), and its random streams.
fn snapshot(
    dir: &std::path::Path,
    chunks: &mut Chunks<'_>,
    optimizer: &mut TrainOptimizer,
) -> Result<Snapshot> {
    let (state, config) = (chunks.state, chunks.config);
    let tp = chunks.models[0].tp();
    let optimizer_state = optimizer.as_dyn().state()?;
    let mut files = Vec::new();
    let mut rng = None;
    let stage = checkpoint::stage_dir(dir, state.pp_rank(), config.pp);
    let (rank, size) = (tp.rank(), tp.size());
    // Context-parallel ranks hold the same weights too; experts are the same on the ranks
    // of an expert-data-parallel group, and differ by expert-parallel rank.
    let has_experts = config.model.moe.is_some();
    let writers = [
        (
            state.dp_rank() == 0 && state.cp_rank() == 0,
            false,
            stage.clone(),
        ),
        (
            has_experts && state.expert_coordinates().dp == 0,
            true,
            checkpoint::experts_dir(&stage, state.ep_rank(), state.ep_size()),
        ),
    ];
    for (_, experts, dir) in writers.into_iter().filter(|w| w.0) {
        let part = ModelShare {
            models: chunks.models,
            experts,
        };
        let (params, optimizer_part) =
            part.optimizer_state(optimizer.model_params(), &optimizer_state);
        files.push(ferrotron_layers::checkpoint::snapshot_shard(
            &part, &dir, rank, size,
        )?);
        files.push(ferrotron_layers::checkpoint::snapshot_optimizer_state(
            &part,
            &params,
            &optimizer_part,
            &dir,
            rank,
            size,
        )?);
        if !experts {
            rng = Some(checkpoint::rng_file(&dir, chunks.rngs, rank, size)?);
        }
    }
    Ok((files, rng))
}

/// A save whose files are being written, in this thread or a background one.
pub(super) struct PendingSave {
    pub(super) root: PathBuf,
    pub(super) step: usize,
    pub(super) writer: Option<std::thread::JoinHandle<Result<()>>>,
    /// World rank 0's: written last, once every rank's files are there.
    pub(super) trainer_state: Option<TrainerState>,
}

impl PendingSave {
    /// Waits for this rank's files; once every rank's are written, world rank 0 writes
    /// the trainer state, renames the checkpoint into place and marks it the latest.
    /// Returns its directory.
    pub(super) fn finish(
        self,
        world: &Arc<dyn Communicator>,
        keep: Option<usize>,
    ) -> Result<PathBuf> {
        let (root, step) = (&self.root, self.step);
        if let Some(writer) = self.writer {
            writer
                .join()
                .map_err(|_| anyhow::anyhow!("the checkpoint writer of step {step} panicked"))??;
        }
        world.barrier()?;
        if let Some(state) = self.trainer_state {
            crate::faults::point("before the trainer state", step);
            state.write(&checkpoint::partial_dir(root, step))?;
            checkpoint::commit_save(root, step, keep)?;
        }
        world.barrier()?;
        Ok(checkpoint::step_dir(root, step))
    }
}
