//! What a checkpoint holds besides the weights and the optimizer state (which `layers`
//! writes per tensor-parallel rank): the trainer's position and history in
//! `trainer_state.json`, and each tensor-parallel rank's random streams (one set per
//! model chunk) in `rng_tp_{rank}_of_{size}.json`. Under pipeline parallelism each stage writes its
//! files into its own directory, [`stage_dir`]. Every file is written to a temporary name,
//! flushed and renamed into place; `trainer_state.json` is written last, so a directory
//! that has it is whole.
//!
//! Under a `--save` directory each save is a directory of its own, [`step_dir`], written
//! as [`partial_dir`] and renamed into place when whole, after which the `latest` marker
//! names it ([`commit_save`]); [`newest`] finds what `--resume` continues from.

use crate::model::GptConfig;
use anyhow::{bail, ensure, Context, Result};
use ferrotron_layers::Sharding;
use ferrotron_layers::{GradScalerState, RngState, RngStreamState, RngTracker};
use ferrotron_tape::Tensor;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const TRAINER_STATE: &str = "trainer_state.json";
/// Changes whenever the files' layout does. Format 1 (before tied embeddings and random
/// streams per chunk) still reads: its models are untied and drew no random numbers.
pub const FORMAT: u64 = 2;

/// The run's position: the step (the number of losses), the data position (steps ×
/// global batch samples), and what the next run must agree with.
pub struct TrainerState {
    /// The files' layout version (see [`FORMAT`]).
    pub format: u64,
    /// Tensor-parallel size of the saved shards.
    pub tp: usize,
    /// Pipeline stages, and model chunks per stage, the run was split into.
    pub pp: usize,
    pub chunks: usize,
    pub model: GptConfig,
    pub global_batch: usize,
    /// The global mean loss of every step so far.
    pub losses: Vec<f32>,
    /// Validation losses by step.
    pub validation: Vec<(usize, f32)>,
    /// The f16 loss scaler's state, when the run scales its loss.
    pub loss_scaler: Option<GradScalerState>,
}

impl TrainerState {
    pub fn write(&self, dir: &Path) -> Result<()> {
        let m = &self.model;
        let state = json!({
            "format": FORMAT,
            "step": self.losses.len(),
            "consumed_samples": self.losses.len() * self.global_batch,
            "global_batch": self.global_batch,
            "tp": self.tp,
            "pp": self.pp,
            "chunks": self.chunks,
            "model": {"vocab": m.vocab, "valid_vocab": m.valid_vocab, "layers": m.layers, "hidden": m.hidden,
                      "heads": m.heads, "query_groups": m.query_groups, "seq": m.seq, "tied": m.tied,
                      "experts": m.moe.map(|(moe, every)| json!({
                          "num_experts": moe.num_experts, "ffn_hidden": moe.ffn_hidden,
                          "shared_expert_ffn": moe.shared_expert_ffn, "every": every}))},
            // f32 → f64 is exact and JSON keeps f64 exactly, so the curve resumes
            // bit-identically.
            "losses": self.losses,
            "validation": self.validation,
            "loss_scaler": self.loss_scaler.map(|s| json!({
                "scale": s.scale, "growth_tracker": s.growth_tracker,
            })),
        });
        write_atomically(
            &dir.join(TRAINER_STATE),
            &serde_json::to_string_pretty(&state)?,
        )
    }

    pub fn read(dir: &Path) -> Result<TrainerState> {
        let path = dir.join(TRAINER_STATE);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "{} holds no complete checkpoint (no {TRAINER_STATE}); pass a directory \
                 written by --save",
                dir.display()
            )
        })?;
        let state: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let format = state["format"].as_u64();
        ensure!(
            matches!(format, Some(1..=FORMAT)),
            "{} has format {}, this program reads formats 1 to {FORMAT}",
            path.display(),
            state["format"]
        );
        let fields = Fields { path: &path };
        let validation = (state["validation"]
            .as_array()
            .with_context(|| fields.malformed())?)
        .iter()
        .map(|pair| Ok((fields.number(&pair[0])?, fields.float(&pair[1])? as f32)))
        .collect::<Result<Vec<_>>>()?;
        let read = TrainerState {
            format: format.unwrap_or(FORMAT),
            tp: fields.number(&state["tp"])?,
            // Checkpoints written before pipelines existed hold one stage.
            pp: fields.or_one(&state["pp"])?,
            chunks: fields.or_one(&state["chunks"])?,
            model: fields.model(&state["model"])?,
            global_batch: fields.number(&state["global_batch"])?,
            losses: (state["losses"]
                .as_array()
                .with_context(|| fields.malformed())?)
            .iter()
            .map(|v| Ok(fields.float(v)? as f32))
            .collect::<Result<Vec<_>>>()?,
            validation,
            loss_scaler: fields.scaler(&state["loss_scaler"])?,
        };
        ensure!(
            read.model.valid_vocab <= read.model.vocab,
            "{}: {} tokens do not fit the {}-entry vocabulary it records; the file is damaged",
            path.display(),
            read.model.valid_vocab,
            read.model.vocab
        );
        Ok(read)
    }

    /// The directories of every pipeline stage of the checkpoint in `dir`, each followed
    /// by its experts' directories (one per expert-parallel rank that saved).
    pub fn stage_dirs(&self, dir: &Path) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        for rank in 0..self.pp {
            let stage = stage_dir(dir, rank, self.pp);
            let mut experts: Vec<PathBuf> = std::fs::read_dir(&stage)
                .into_iter()
                .flatten()
                .flatten()
                .map(|entry| entry.path())
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("experts_"))
                })
                .collect();
            experts.sort();
            dirs.push(stage);
            dirs.extend(experts);
        }
        dirs
    }

    /// Checks that a run with these settings can continue this one (any tensor-parallel,
    /// pipeline and data-parallel layout with the same model and global batch).
    pub fn check_compatible(
        &self,
        model: &GptConfig,
        global_batch: usize,
        steps: usize,
    ) -> Result<()> {
        let (s, m) = (&self.model, model);
        ensure!(
            s.tied == m.tied,
            "the checkpoint's model has {} embeddings; {}",
            if s.tied { "tied" } else { "untied" },
            if s.tied {
                "drop --untie-embeddings-and-output-weights"
            } else {
                "pass --untie-embeddings-and-output-weights"
            }
        );
        ensure!(
            (s.valid_vocab, s.vocab) == (m.valid_vocab, m.vocab),
            "the checkpoint's model has {} tokens padded to {}, this run's {} padded to {}: \
             pass the checkpoint's tokenizer, and a --tp that pads it to the same size (the \
             vocabulary is padded to a multiple of 128 × TP)",
            s.valid_vocab,
            s.vocab,
            m.valid_vocab,
            m.vocab
        );
        ensure!(
            (s.layers, s.hidden, s.heads, s.seq) == (m.layers, m.hidden, m.heads, m.seq),
            "the checkpoint is of a model with --layers {} --hidden {} --heads {} --seq {}; \
             pass those",
            s.layers,
            s.hidden,
            s.heads,
            s.seq
        );
        let experts = |m: &GptConfig| {
            (m.moe).map(|(c, every)| (c.num_experts, c.ffn_hidden, every, c.shared_expert_ffn))
        };
        ensure!(
            experts(s) == experts(m),
            "the checkpoint's model has {}; this run's {}: pass the same --num-experts, \
             --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size and \
             --moe-layer-freq",
            describe_experts(experts(s)),
            describe_experts(experts(m))
        );
        ensure!(
            self.global_batch == global_batch,
            "the checkpoint trained on global batches of {} sequences; pass --batch and \
             --dp whose product is {} so the data continues where it stopped",
            self.global_batch,
            self.global_batch
        );
        if self.losses.len() >= steps {
            bail!(
                "the checkpoint is already at step {}; pass --steps above it",
                self.losses.len()
            );
        }
        Ok(())
    }
}

/// Every parameter of a checkpoint saved at tensor-parallel size `tp`, joined into its
/// full form, from all of its pipeline stages' directories (a tied embedding's two
/// copies are bit-identical: either serves).
pub fn read_stages(dirs: &[PathBuf], tp: usize) -> Result<BTreeMap<String, (Sharding, Tensor)>> {
    let mut full = BTreeMap::new();
    for dir in dirs {
        full.extend(ferrotron_layers::checkpoint::read_full_checkpoint(dir, tp)?);
    }
    Ok(full)
}

/// A model's experts as a check's message names them.
fn describe_experts(experts: Option<(usize, usize, usize, Option<usize>)>) -> String {
    match experts {
        None => "no experts".into(),
        Some((n, ffn, every, shared)) => {
            let shared = match shared {
                Some(width) => format!(" and a shared expert {width} wide"),
                None => String::new(),
            };
            format!("{n} experts {ffn} wide{shared} (--moe-layer-freq {every})")
        }
    }
}

/// Where expert-parallel rank `ep_rank` of `ep` keeps its experts' files within a
/// stage's directory: `experts_{rank}_of_{ep}`.
pub fn experts_dir(stage: &Path, ep_rank: usize, ep: usize) -> PathBuf {
    stage.join(format!("experts_{ep_rank}_of_{ep}"))
}

/// Where pipeline stage `pp_rank` of `pp` keeps its files: `dir` itself without
/// pipeline parallelism, else `dir/pp_{rank}_of_{pp}`.
pub fn stage_dir(dir: &Path, pp_rank: usize, pp: usize) -> PathBuf {
    if pp == 1 {
        dir.to_path_buf()
    } else {
        dir.join(format!("pp_{pp_rank}_of_{pp}"))
    }
}

fn rng_path(dir: &Path, tp_rank: usize, tp_size: usize) -> PathBuf {
    dir.join(format!("rng_tp_{tp_rank}_of_{tp_size}.json"))
}

/// This tensor-parallel rank's random streams, one set per model chunk: the file and its
/// text, taken now and written by [`write_atomically`] when the save writes.
pub fn rng_file(
    dir: &Path,
    rngs: &[RngTracker],
    tp_rank: usize,
    tp_size: usize,
) -> Result<(PathBuf, String)> {
    let chunks: Vec<Value> = rngs
        .iter()
        .map(|rng| {
            let streams: Vec<Value> = (rng.state().streams.iter())
                .map(|s| json!({"name": s.name, "seed": s.seed, "words": s.words}))
                .collect();
            json!({ "streams": streams })
        })
        .collect();
    let text = serde_json::to_string_pretty(&json!({ "chunks": chunks }))?;
    Ok((rng_path(dir, tp_rank, tp_size), text))
}

/// Restores the random streams saved by the same tensor-parallel rank into `rngs` (one
/// per chunk). At another tensor-parallel size the ranks' private streams have no
/// counterpart: the trackers keep their fresh seeds then, and dropout masks differ from
/// the uninterrupted run's. Format 1 drew no random numbers: nothing to restore.
pub fn restore_rng(
    dir: &Path,
    saved: &TrainerState,
    rngs: &mut [RngTracker],
    tp_rank: usize,
    tp_size: usize,
) -> Result<()> {
    if saved.tp != tp_size || saved.format < 2 {
        return Ok(());
    }
    let path = rng_path(dir, tp_rank, tp_size);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let value: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let bad = || format!("{} is malformed", path.display());
    let chunks = value["chunks"].as_array().with_context(bad)?;
    ensure!(
        chunks.len() == rngs.len(),
        "{} holds the random streams of {} model chunks, this rank has {}",
        path.display(),
        chunks.len(),
        rngs.len()
    );
    for (chunk, rng) in chunks.iter().zip(rngs) {
        let streams = chunk["streams"]
            .as_array()
            .with_context(bad)?
            .iter()
            .map(|s| {
                Ok(RngStreamState {
                    name: s["name"].as_str().with_context(bad)?.to_string(),
                    seed: s["seed"].as_u64().with_context(bad)?,
                    words: s["words"]
                        .as_array()
                        .with_context(bad)?
                        .iter()
                        .map(|w| w.as_u64().with_context(bad))
                        .collect::<Result<_>>()?,
                })
            })
            .collect::<Result<_>>()?;
        rng.restore(&RngState { streams })?;
    }
    Ok(())
}

/// Writes `text` to a temporary name, flushes it to disk and renames it into place.
pub fn write_atomically(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temporary)?;
        std::io::Write::write_all(&mut file, text.as_bytes())?;
        file.sync_all()
    };
    write().with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot rename {} into place", temporary.display()))
}

/// Flushes a directory's entries (a rename in it) to disk.
fn sync_dir(dir: &Path) -> Result<()> {
    (std::fs::File::open(dir).and_then(|d| d.sync_all()))
        .with_context(|| format!("cannot flush {}", dir.display()))
}

/// The marker naming the newest complete checkpoint under a `--save` directory.
const LATEST: &str = "latest";

/// Where the checkpoint of `step` goes under `root`: `step_0000400`, Megatron's
/// `iter_0000400` under another name.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step_{step:07}"))
}

/// Where the checkpoint of `step` is written before it is complete.
pub fn partial_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!(".step_{step:07}.partial"))
}

/// What `--resume DIR` continues from: the checkpoint `DIR`'s `latest` marker names,
/// else (no marker, or one naming nothing complete) its complete `step_*` directory of
/// the highest step, else `DIR` itself when it is a checkpoint; `None` when it holds
/// none. The marker comes first because a run resumed from an earlier step saves below
/// the steps of the run it abandoned, whose directories may remain. Incomplete
/// checkpoints (no trainer state, which is written last) are never chosen.
pub fn newest(dir: &Path) -> Result<Option<PathBuf>> {
    let complete = |path: &Path| path.join(TRAINER_STATE).is_file();
    let marked = std::fs::read_to_string(dir.join(LATEST)).map(|name| dir.join(name.trim()));
    if let Some(marked) = marked.ok().filter(|path| complete(path)) {
        return Ok(Some(marked));
    }
    let highest = steps(dir)?
        .into_iter()
        .rev()
        .find(|(_, path)| complete(path));
    if let Some((_, path)) = highest {
        return Ok(Some(path));
    }
    Ok(complete(dir).then(|| dir.to_path_buf()))
}

/// The `step_*` directories under `root`, by step.
fn steps(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", root.display())),
    };
    let mut steps: Vec<(usize, PathBuf)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            let step = name.strip_prefix("step_")?.parse().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    steps.sort();
    Ok(steps)
}

/// Before the ranks write a save of `step`: clears what a crashed save of the same step
/// left (world rank 0 alone, before the others start writing).
pub fn prepare_save(root: &Path, step: usize) -> Result<()> {
    let partial = partial_dir(root, step);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("cannot clear {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))
}

/// Once every file of `step`'s save is in its partial directory (the trainer state
/// last): renames it into place, points `latest` at it and keeps the newest `keep`
/// checkpoints (all without `keep`). World rank 0 alone. A crash at any point leaves the
/// previous complete checkpoint, or this one, for `newest` to find.
pub fn commit_save(root: &Path, step: usize, keep: Option<usize>) -> Result<PathBuf> {
    let (partial, done) = (partial_dir(root, step), step_dir(root, step));
    // Every file is on disk already; their names, in each stage's directory, too.
    let listing = std::fs::read_dir(&partial)
        .with_context(|| format!("cannot list {}", partial.display()))?;
    for entry in listing {
        let path = entry?.path();
        if path.is_dir() {
            sync_dir(&path)?;
        }
    }
    sync_dir(&partial)?;
    crate::faults::point("before the rename", step);
    if done.exists() {
        // A save of this step already completed (a run resumed before it): replaced.
        std::fs::remove_dir_all(&done)
            .with_context(|| format!("cannot replace {}", done.display()))?;
    }
    std::fs::rename(&partial, &done)
        .with_context(|| format!("cannot rename {} into place", partial.display()))?;
    sync_dir(root)?;
    crate::faults::point("before the marker", step);
    let name = done.file_name().map(|n| n.to_string_lossy().into_owned());
    write_atomically(&root.join(LATEST), &name.unwrap_or_default())?;
    sync_dir(root)?;
    if let Some(keep) = keep {
        // The newest others below this one (which `latest` names); saves of higher steps
        // belong to a run this one resumed before, and are left alone.
        let others: Vec<_> = steps(root)?
            .into_iter()
            .filter(|(s, _)| *s < step)
            .collect();
        let old = others.len().saturating_sub(keep.saturating_sub(1));
        for (_, path) in &others[..old] {
            std::fs::remove_dir_all(path)
                .with_context(|| format!("cannot remove the old checkpoint {}", path.display()))?;
        }
    }
    Ok(done)
}

/// The fields of one `trainer_state.json`: a missing or mistyped one is an error naming
/// the file.
struct Fields<'a> {
    path: &'a Path,
}

impl Fields<'_> {
    fn malformed(&self) -> String {
        format!(
            "{} is malformed; was it written by train-gpt?",
            self.path.display()
        )
    }

    fn number(&self, value: &Value) -> Result<usize> {
        (value.as_u64().map(|n| n as usize)).with_context(|| self.malformed())
    }

    fn float(&self, value: &Value) -> Result<f64> {
        value.as_f64().with_context(|| self.malformed())
    }

    /// A count that older checkpoints do not record: one.
    fn or_one(&self, value: &Value) -> Result<usize> {
        match value {
            Value::Null => Ok(1),
            value => self.number(value),
        }
    }

    fn model(&self, model: &Value) -> Result<GptConfig> {
        Ok(GptConfig {
            vocab: self.number(&model["vocab"])?,
            // Older checkpoints hold bytes, every entry a token.
            valid_vocab: match &model["valid_vocab"] {
                Value::Null => self.number(&model["vocab"])?,
                valid => self.number(valid)?,
            },
            layers: self.number(&model["layers"])?,
            hidden: self.number(&model["hidden"])?,
            heads: self.number(&model["heads"])?,
            // Checkpoints from before grouped-query attention have a key and value per
            // head.
            query_groups: match &model["query_groups"] {
                Value::Null => None,
                groups => Some(self.number(groups)?),
            },
            // Fused or not is a setting of each run: both give the same model.
            attention: ferrotron_tape::AttentionKernel::Fused,
            seq: self.number(&model["seq"])?,
            // Format 1 had no tied embeddings.
            tied: model["tied"].as_bool().unwrap_or(false),
            // Dropout is a setting of each run, not of the weights.
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
            recompute_attention_core: false,
            moe: self.experts(&model["experts"])?,
        })
    }

    /// The experts' shapes; routing is a setting of each run, like dropout.
    fn experts(&self, experts: &Value) -> Result<Option<(ferrotron_layers::MoeConfig, usize)>> {
        if experts.is_null() {
            return Ok(None);
        }
        let config = ferrotron_layers::MoeConfig {
            // Checkpoints from before shared experts have none.
            shared_expert_ffn: match &experts["shared_expert_ffn"] {
                Value::Null => None,
                width => Some(self.number(width)?),
            },
            ..ferrotron_layers::MoeConfig::new(
                self.number(&experts["num_experts"])?,
                1,
                self.number(&experts["ffn_hidden"])?,
            )
        };
        Ok(Some((config, self.number(&experts["every"])?)))
    }

    fn scaler(&self, scaler: &Value) -> Result<Option<GradScalerState>> {
        if scaler.is_null() {
            return Ok(None);
        }
        Ok(Some(GradScalerState {
            scale: self.float(&scaler["scale"])?,
            growth_tracker: (scaler["growth_tracker"].as_u64())
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| self.malformed())?,
        }))
    }
}
