//! The model's share on this rank: its parameters in the optimizer's order, the weights
//! it starts from (seeded, a checkpoint, or a Hugging Face model, upcycled into experts).

use crate::checkpoint::{self, TrainerState};
use crate::model::Gpt;
use anyhow::{Context, Result};
use ferrotron_layers::{Module, ShardedParameter, Sharding};
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{Parameter, Tensor};
use std::collections::BTreeMap;

use super::*;

/// The experts' parameters of a rank's chunks, or all the others: what one writer of a
/// checkpoint saves.
pub(super) struct ModelShare<'a> {
    pub(super) models: &'a [Gpt],
    pub(super) experts: bool,
}

impl Module for ModelShare<'_> {
    fn parameters(&self) -> Vec<ShardedParameter> {
        (self.models.iter())
            .flat_map(Module::parameters)
            .filter(|p| p.expert == self.experts)
            .collect()
    }
}

impl ModelShare<'_> {
    /// This share's parameters among the optimizer's `all`, and their entries of `state`.
    pub(super) fn optimizer_state(
        &self,
        all: &[Parameter],
        state: &ferrotron_tape::OptimizerState,
    ) -> (Vec<Parameter>, ferrotron_tape::OptimizerState) {
        let mine: std::collections::HashSet<_> =
            self.parameters().iter().map(|p| p.param.id()).collect();
        let (params, entries) = (all.iter().zip(&state.params))
            .filter(|(p, _)| mine.contains(&p.id()))
            .map(|(p, e)| (p.clone(), e.clone()))
            .unzip();
        (
            params,
            ferrotron_tape::OptimizerState {
                steps: state.steps,
                params: entries,
            },
        )
    }
}

/// Reads a checkpoint's trainer state, checks that this run can continue it, and loads
/// this rank's weights from it (re-cut from the saved tensor-parallel size).
pub(super) fn load_weights(
    models: &[Gpt],
    dir: &std::path::Path,
    state: &ParallelState,
    config: &TrainConfig,
) -> Result<TrainerState> {
    let saved = TrainerState::read(dir)?;
    let global_batch = config.batch * state.dp_size();
    saved.check_compatible(&config.model, global_batch, config.steps)?;
    // Every saved stage's directory: at another pipeline layout a chunk's blocks may come
    // from any of them (blocks are named by their index in the whole model).
    let dirs = saved.stage_dirs(dir);
    let full = checkpoint::read_stages(&dirs, saved.tp)?;
    // Before the output layer lost its bias (as Megatron's has none), untied runs saved
    // one; dropping it would change the model they continue.
    anyhow::ensure!(
        !full.contains_key("head.bias"),
        "{}: its untied output layer has a bias, which the demo's no longer has (Megatron's \
         has none); continue it with the version that saved it, or start afresh",
        dir.display()
    );
    for model in models {
        model.load(&full, dir)?;
    }
    Ok(saved)
}

/// `state`, whose entries follow `module`'s parameters, with its entries in the order of
/// `params` (the same parameters, as an optimizer lists them).
pub(super) fn in_order_of(
    module: &dyn Module,
    params: &[Parameter],
    state: ferrotron_tape::OptimizerState,
) -> Result<ferrotron_tape::OptimizerState> {
    let mut entries: std::collections::HashMap<_, _> = (module.parameters().into_iter())
        .map(|p| p.param.id())
        .zip(state.params)
        .collect();
    let params = params
        .iter()
        .map(|p| {
            entries
                .remove(&p.id())
                .with_context(|| format!("the checkpoint's optimizer state lacks '{}'", p.name()))
        })
        .collect::<Result<_>>()?;
    Ok(ferrotron_tape::OptimizerState {
        steps: state.steps,
        params,
    })
}

/// Starts from a GPT-2 directory's weights: this rank keeps its part of each. A mixture
/// of experts is upcycled from the dense MLP in its place, as Megatron's
/// `--moe-use-upcycling` does: every expert starts as a copy of it and the router keeps
/// its fresh draw, so that with the softmax after the top-k (weights adding up to 1) and
/// no token dropped the model computes what the dense one did.
pub(super) fn load_pretrained(
    models: &[Gpt],
    dir: &std::path::Path,
    config: &TrainConfig,
) -> Result<()> {
    let (_, weights) = crate::hf::import(dir)?;
    let mut tensors = crate::hf::tensors(weights, config.model.vocab)?;
    if let (Some((moe, _)), Some(bias)) = (config.model.moe, tensors.get("block0.mlp.fc1.bias")) {
        anyhow::ensure!(
            bias.shape() == [moe.ffn_hidden],
            "upcycling copies each block's MLP into its experts: pass --moe-ffn-hidden-size {} \
             (the checkpoint's MLP width) or leave it out",
            bias.numel()
        );
    }
    let mut full: BTreeMap<String, (Sharding, Tensor)> = BTreeMap::new();
    for p in models.iter().flat_map(Module::parameters) {
        let name = p.param.name().to_string();
        let tensor = match upcycled_from(&name) {
            Some(Upcycled::Router) => p.param.value()?,
            Some(Upcycled::Expert(dense)) => match tensors.get(&dense) {
                Some(tensor) => tensor.clone(),
                None => continue, // the load reports it missing
            },
            None => match tensors.remove(&name) {
                Some(tensor) => tensor,
                None => continue,
            },
        };
        full.insert(name, (p.sharding, tensor));
    }
    for model in models {
        model.load(&full, dir)?;
    }
    Ok(())
}

/// Where a mixture of experts' parameter starts when a dense checkpoint is upcycled.
pub(super) enum Upcycled {
    /// The router keeps its initial values (the checkpoint has none).
    Router,
    /// An expert's tensor copies the dense MLP's of that name.
    Expert(String),
}

/// `blockN.mlp.experts.E.rest` starts from `blockN.mlp.rest`; `blockN.mlp.router.weight`
/// from nothing; any other name from itself (`None`).
pub(super) fn upcycled_from(name: &str) -> Option<Upcycled> {
    if name.ends_with(".mlp.router.weight") {
        return Some(Upcycled::Router);
    }
    let (block, rest) = name.split_once(".mlp.experts.")?;
    let (_, tensor) = rest.split_once('.')?;
    Some(Upcycled::Expert(format!("{block}.mlp.{tensor}")))
}
