//! The vocabulary-parallel embedding (Megatron-Core's `VocabParallelEmbedding`).

use ferrotron_mappings::{reduce_from_region, reduce_scatter_to_sequence_parallel_region};
use ferrotron_tape::ndarray::{ArrayD, IxDyn};
use ferrotron_tape::{Tape, Tensor};

use crate::error::{Error, Result};
use crate::init::{sharded, MasterInit};
use crate::parallel::{ShardedParameter, Sharding, TensorParallel};

/// The token ids `start..end` of the whole vocabulary that one rank owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabRange {
    /// First id owned.
    pub start: usize,
    /// One past the last id owned.
    pub end: usize,
}

impl VocabRange {
    /// Rank `rank`'s range when `vocab_size` ids are divided among `size` ranks.
    ///
    /// The vocabulary is split unevenly when `size` does not divide it, by
    /// [`ferrotron_mappings::split_sizes`] (the first `vocab_size % size` ranks own one id more);
    /// nothing is padded, so logits and embeddings have exactly `vocab_size` rows in all.
    /// ```
    /// use ferrotron_layers::VocabRange;
    ///
    /// let ranges: Vec<_> = (0..4).map(|r| VocabRange::new(10, r, 4)).collect::<std::result::Result<_, _>>()?;
    /// assert_eq!(ranges.iter().map(|r| (r.start, r.end)).collect::<Vec<_>>(),
    ///            vec![(0, 3), (3, 6), (6, 8), (8, 10)]);
    /// # Ok::<(), ferrotron_layers::Error>(())
    /// ```
    pub fn new(vocab_size: usize, rank: usize, size: usize) -> Result<Self> {
        let (start, len) = crate::parallel::part_of(vocab_size, rank, size)?;
        Ok(VocabRange {
            start,
            end: start + len,
        })
    }

    /// Number of ids owned.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the range owns no id.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Whether `id` is owned.
    pub fn contains(&self, id: usize) -> bool {
        (self.start..self.end).contains(&id)
    }
}

/// An embedding table `[vocab_size, hidden]` whose rows (token ids) are divided among the
/// tensor-parallel ranks.
///
/// Each rank looks up the ids in its [`VocabRange`] and gives zeros for the others; the
/// ranks' results are summed (all-reduce), or under sequence parallelism summed and
/// divided along the first dimension of `ids_shape`, the sequence (reduce-scatter).
pub struct VocabParallelEmbedding {
    tp: TensorParallel,
    vocab_size: usize,
    range: VocabRange,
    weight: ShardedParameter,
}

impl VocabParallelEmbedding {
    /// A table called `name` (parameter `name.weight`) from `init`'s master weights.
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        vocab_size: usize,
        hidden: usize,
        init: &MasterInit,
    ) -> Result<Self> {
        const OP: &str = "VocabParallelEmbedding";
        if hidden == 0 || vocab_size == 0 {
            return Err(Error::config(
                OP,
                format!("sizes must be positive, got vocabulary {vocab_size}, hidden {hidden}"),
            ));
        }
        let range = VocabRange::new(vocab_size, tp.rank(), tp.size())?;
        let weight_name = format!("{name}.weight");
        let weight = sharded(
            tp,
            weight_name.clone(),
            &init.weight(&weight_name, &[vocab_size, hidden]),
            Sharding::Split {
                dim: 0,
                full_len: vocab_size,
            },
            false,
        )?;
        Ok(VocabParallelEmbedding {
            tp: tp.clone(),
            vocab_size,
            range,
            weight,
        })
    }

    /// The ids this rank owns.
    pub fn vocab_range(&self) -> VocabRange {
        self.range
    }

    /// The table: this rank's rows `[vocabulary part, hidden]`, which an output layer
    /// can share ([`ColumnParallelLinear::sharing_weight`](crate::ColumnParallelLinear::sharing_weight)).
    pub fn weight(&self) -> &ShardedParameter {
        &self.weight
    }

    /// Embeds `ids` laid out as `ids_shape` (under sequence parallelism the first
    /// dimension is the sequence). The output is `ids_shape + [hidden]`, under sequence
    /// parallelism this rank's part of the first dimension. An id outside the vocabulary
    /// is an [`Error::IdOutOfRange`] on the rank that sees it.
    pub fn forward(&self, tape: &Tape, ids: &[usize], ids_shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "VocabParallelEmbedding";
        if ids_shape.is_empty() || ids.len() != ids_shape.iter().product::<usize>() {
            return Err(Error::shape(
                OP,
                &[ids.len()],
                format!("one id per element of a non-empty ids_shape {ids_shape:?}"),
            ));
        }
        if let Some(&id) = ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(Error::IdOutOfRange {
                op: OP,
                id,
                vocab_size: self.vocab_size,
            });
        }
        let table = tape.watch(&self.weight.param)?;
        let group = self.tp.group();
        if self.tp.size() == 1 {
            return Ok(table.embedding(ids, ids_shape)?);
        }
        // Foreign ids look up local row 0, then their rows are zeroed.
        let local_ids: Vec<usize> = ids
            .iter()
            .map(|&id| {
                if self.range.contains(id) {
                    id - self.range.start
                } else {
                    0
                }
            })
            .collect();
        let mut mask_shape = ids_shape.to_vec();
        mask_shape.push(1);
        let foreign: Vec<bool> = ids.iter().map(|&id| !self.range.contains(id)).collect();
        let mask = ArrayD::from_shape_vec(IxDyn(&mask_shape), foreign)
            .map_err(|e| Error::shape(OP, ids_shape, e.to_string()))?;
        let partial = table
            .embedding(&local_ids, ids_shape)?
            .masked_fill(&mask, 0.0)?;
        if self.tp.sequence_parallel() {
            Ok(reduce_scatter_to_sequence_parallel_region(
                &partial, group, None,
            )?)
        } else {
            Ok(reduce_from_region(&partial, group)?)
        }
    }
}

impl crate::Module for VocabParallelEmbedding {
    fn parameters(&self) -> Vec<ShardedParameter> {
        vec![self.weight.clone()]
    }
}
