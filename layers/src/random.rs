//! Megatron's RNG streams for dropout inside and outside tensor-parallel regions.

use std::collections::BTreeMap;

use tape::Generator;

use crate::error::{Error, Result};

/// Offset of the model-parallel stream's seed, as Megatron-Core's `model_parallel_cuda_manual_seed`.
pub const MODEL_PARALLEL_SEED_OFFSET: u64 = 2718;

/// Name of the stream that differs between tensor-parallel ranks.
pub const MODEL_PARALLEL_STREAM: &str = "model-parallel-rng";

/// Named random streams, as Megatron-Core's `CudaRNGStatesTracker`.
///
/// * the **default** stream, seeded `seed` on every tensor-parallel rank: dropout on
///   replicated activations (after a row-parallel layer's reduction) draws the same mask
///   on every rank, so the ranks stay identical and equal the serial model;
/// * the **model-parallel** stream, seeded `seed + 2718 + tp_rank`: dropout on sharded
///   activations (attention probabilities of this rank's heads, sequence-parallel
///   parts) draws independent masks on each rank.
///
/// Further streams can be added by name (e.g. for expert parallelism).
#[derive(Debug, Clone)]
pub struct RngTracker {
    default: Generator,
    model_parallel: Generator,
    extra: BTreeMap<String, Generator>,
}

impl RngTracker {
    /// The default and model-parallel streams of tensor-parallel rank `tp_rank`.
    pub fn new(seed: u64, tp_rank: usize) -> Self {
        let model_parallel_seed = seed
            .wrapping_add(MODEL_PARALLEL_SEED_OFFSET)
            .wrapping_add(tp_rank as u64);
        RngTracker {
            default: Generator::new(seed),
            model_parallel: Generator::new(model_parallel_seed),
            extra: BTreeMap::new(),
        }
    }

    /// The stream shared by every tensor-parallel rank.
    pub fn default_stream(&mut self) -> &mut Generator {
        &mut self.default
    }

    /// The stream private to this tensor-parallel rank.
    pub fn model_parallel_stream(&mut self) -> &mut Generator {
        &mut self.model_parallel
    }

    /// Adds a stream; a name already taken (including `"default"` and
    /// [`MODEL_PARALLEL_STREAM`]) is an error, as in Megatron.
    pub fn add(&mut self, name: &str, seed: u64) -> Result<()> {
        if name == "default" || name == MODEL_PARALLEL_STREAM || self.extra.contains_key(name) {
            return Err(Error::config(
                "RngTracker::add",
                format!("a stream named '{name}' already exists"),
            ));
        }
        self.extra.insert(name.to_string(), Generator::new(seed));
        Ok(())
    }

    /// The stream called `name`, or an error naming the known ones.
    pub fn stream(&mut self, name: &str) -> Result<&mut Generator> {
        match name {
            "default" => return Ok(&mut self.default),
            MODEL_PARALLEL_STREAM => return Ok(&mut self.model_parallel),
            _ => {}
        }
        let known: Vec<String> = self.extra.keys().cloned().collect();
        self.extra.get_mut(name).ok_or_else(|| {
            Error::config(
                "RngTracker::stream",
                format!(
                    "no stream named '{name}'; known: default, {MODEL_PARALLEL_STREAM}, {}",
                    known.join(", ")
                ),
            )
        })
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
}
