//! Megatron's RNG streams for dropout inside and outside tensor-parallel regions.

use std::collections::BTreeMap;

use ferrotron_tape::Generator;

use crate::error::{Error, Result};

/// Offset of the model-parallel stream's seed, as Megatron-Core's `model_parallel_cuda_manual_seed`.
pub const MODEL_PARALLEL_SEED_OFFSET: u64 = 2718;

/// How far apart the seeds of consecutive pipeline stages are, as Megatron's
/// `_set_random_seed` (`seed + 100 · pipeline rank`).
pub const PIPELINE_SEED_STRIDE: u64 = 100;

/// Name of the stream that differs between tensor-parallel ranks.
pub const MODEL_PARALLEL_STREAM: &str = "model-parallel-rng";

/// Name of the stream shared by every tensor-parallel rank.
pub const DEFAULT_STREAM: &str = "default";

/// Saved state of every stream of an [`RngTracker`], for resuming a run with exactly the
/// draws it would have made: plain data, to be written into a checkpoint in any format.
/// (In JSON, write the words as integers with a reader that keeps all 64 bits, or as
/// strings: readers that parse numbers as `f64` lose bits above 2⁵³.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RngState {
    /// Every stream: default, model-parallel, then the added ones by name.
    pub streams: Vec<RngStreamState>,
}

/// One stream of an [`RngState`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RngStreamState {
    /// The stream's name ([`DEFAULT_STREAM`], [`MODEL_PARALLEL_STREAM`] or an added one).
    pub name: String,
    /// The seed the stream started from.
    pub seed: u64,
    /// The generator's internal state ([`Generator::state`]).
    pub words: Vec<u64>,
}

/// Named random streams, as Megatron-Core's `CudaRNGStatesTracker`.
///
/// * the **default** stream, seeded `seed` on every tensor-parallel rank: dropout on
///   replicated activations (after a row-parallel layer's reduction) draws the same mask
///   on every rank, so the ranks stay identical and equal the serial model;
/// * the **model-parallel** stream, seeded `seed + 2718 + tp_rank`: dropout on sharded
///   activations (attention probabilities of this rank's heads, sequence-parallel
///   parts) draws independent masks on each rank.
///
/// Further streams can be added by name (e.g. for expert parallelism). Every stream has
/// its own seed: two streams seeded alike would draw the same masks.
#[derive(Debug, Clone)]
pub struct RngTracker {
    default: Stream,
    model_parallel: Stream,
    extra: BTreeMap<String, Stream>,
}

/// A generator with the seed it started from, remembered so that seeds stay unique.
#[derive(Debug, Clone)]
struct Stream {
    seed: u64,
    generator: Generator,
}

impl Stream {
    fn new(seed: u64) -> Self {
        Stream {
            seed,
            generator: Generator::new(seed),
        }
    }
}

impl RngTracker {
    /// The default and model-parallel streams of tensor-parallel rank `tp_rank` of a
    /// model without pipeline stages (or of its first stage).
    pub fn new(seed: u64, tp_rank: usize) -> Self {
        let model_parallel_seed = seed
            .wrapping_add(MODEL_PARALLEL_SEED_OFFSET)
            .wrapping_add(tp_rank as u64);
        RngTracker {
            default: Stream::new(seed),
            model_parallel: Stream::new(model_parallel_seed),
            extra: BTreeMap::new(),
        }
    }

    /// The streams of tensor-parallel rank `tp_rank` in pipeline stage `stage`: seeded
    /// from `seed + 100 · stage` ([`PIPELINE_SEED_STRIDE`]), as Megatron seeds each
    /// pipeline rank, so that different stages draw different masks while the
    /// tensor-parallel ranks of one stage share the default stream. Stage 0 is
    /// [`new`](Self::new).
    ///
    /// Megatron gives the chunks of an interleaved schedule on one rank one tracker,
    /// drawn from in turn; a caller with a tracker per chunk passes the chunk's virtual
    /// stage (`chunk · pp + pp rank`) as `stage`, which is the pipeline rank without
    /// interleaving and keeps the chunks' streams apart with it.
    pub fn for_pipeline_stage(seed: u64, tp_rank: usize, stage: usize) -> Self {
        let offset = PIPELINE_SEED_STRIDE.wrapping_mul(stage as u64);
        RngTracker::new(seed.wrapping_add(offset), tp_rank)
    }

    /// The stream shared by every tensor-parallel rank.
    pub fn default_stream(&mut self) -> &mut Generator {
        &mut self.default.generator
    }

    /// The stream private to this tensor-parallel rank.
    pub fn model_parallel_stream(&mut self) -> &mut Generator {
        &mut self.model_parallel.generator
    }

    /// Adds a stream. A name already taken (including [`DEFAULT_STREAM`] and
    /// [`MODEL_PARALLEL_STREAM`]) is [`Error::Config`]; a seed another stream already
    /// uses (the default seed, this rank's model-parallel seed, an added stream's) is
    /// [`Error::DuplicateSeed`], as Megatron's `seed … already exists`.
    pub fn add(&mut self, name: &str, seed: u64) -> Result<()> {
        const OP: &str = "RngTracker::add";
        if self.streams().any(|(taken, _)| taken == name) {
            return Err(Error::config(
                OP,
                format!("a stream named '{name}' already exists"),
            ));
        }
        if let Some((owner, _)) = self.streams().find(|(_, stream)| stream.seed == seed) {
            return Err(Error::DuplicateSeed {
                op: OP,
                seed,
                stream: owner.to_string(),
            });
        }
        self.extra.insert(name.to_string(), Stream::new(seed));
        Ok(())
    }

    /// The stream called `name`, or an error naming the known ones.
    pub fn stream(&mut self, name: &str) -> Result<&mut Generator> {
        match name {
            DEFAULT_STREAM => return Ok(&mut self.default.generator),
            MODEL_PARALLEL_STREAM => return Ok(&mut self.model_parallel.generator),
            _ => {}
        }
        let known: Vec<String> = self.extra.keys().cloned().collect();
        match self.extra.get_mut(name) {
            Some(stream) => Ok(&mut stream.generator),
            None => Err(Error::config(
                "RngTracker::stream",
                format!(
                    "no stream named '{name}'; known: {DEFAULT_STREAM}, {MODEL_PARALLEL_STREAM}, {}",
                    known.join(", ")
                ),
            )),
        }
    }

    /// The stream for dropout on activations that are sharded across tensor-parallel
    /// ranks (`true`) or replicated on all of them (`false`).
    pub fn for_activations(&mut self, sharded: bool) -> &mut Generator {
        if sharded {
            self.model_parallel_stream()
        } else {
            self.default_stream()
        }
    }

    /// Every stream's seed and generator state; [`restore`](Self::restore) continues
    /// from here with bit-identical draws.
    pub fn state(&self) -> RngState {
        RngState {
            streams: self
                .streams()
                .map(|(name, stream)| RngStreamState {
                    name: name.to_string(),
                    seed: stream.seed,
                    words: stream.generator.state(),
                })
                .collect(),
        }
    }

    /// Puts every stream back where [`state`](Self::state) found it. Build the tracker as
    /// the saved one was (same seed, tensor-parallel rank and added streams), then
    /// restore. The state must hold exactly this tracker's streams, each with the seed it
    /// has here (so a state saved on another rank or with another seed is refused);
    /// anything else is [`Error::RngStateMismatch`], and the tracker is left unchanged.
    pub fn restore(&mut self, state: &RngState) -> Result<()> {
        let mismatch = |reason: String| Error::RngStateMismatch { reason };
        let mut restored: BTreeMap<&str, Generator> = BTreeMap::new();
        for saved in &state.streams {
            let name = saved.name.as_str();
            let Some((_, stream)) = self.streams().find(|(known, _)| *known == name) else {
                return Err(mismatch(format!(
                    "the state has a stream '{name}' that this tracker lacks; add it first"
                )));
            };
            if stream.seed != saved.seed {
                return Err(mismatch(format!(
                    "stream '{name}' is seeded {} here but {} in the state (saved with \
                     another seed or on another tensor-parallel rank?)",
                    stream.seed, saved.seed
                )));
            }
            let generator = Generator::from_state(&saved.words)
                .map_err(|error| mismatch(format!("stream '{name}': {error}")))?;
            if restored.insert(name, generator).is_some() {
                return Err(mismatch(format!("stream '{name}' appears twice")));
            }
        }
        if let Some((missing, _)) = self
            .streams()
            .find(|(name, _)| !restored.contains_key(name))
        {
            return Err(mismatch(format!(
                "the state lacks this tracker's stream '{missing}'"
            )));
        }
        for (name, generator) in restored {
            *self.stream(name)? = generator;
        }
        Ok(())
    }

    /// Every stream with its name: default, model-parallel, then the added ones by name.
    fn streams(&self) -> impl Iterator<Item = (&str, &Stream)> {
        [
            (DEFAULT_STREAM, &self.default),
            (MODEL_PARALLEL_STREAM, &self.model_parallel),
        ]
        .into_iter()
        .chain(
            self.extra
                .iter()
                .map(|(name, stream)| (name.as_str(), stream)),
        )
    }
}
