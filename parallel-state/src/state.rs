//! [`ParallelState`]: one communicator per group of a [`RankLayout`], plus named groups.

use crate::error::{Error, Result};
use crate::layout::{Coordinates, ExpertCoordinates, GroupKind, RankLayout};
use ferrotron_comm_core::Communicator;
use std::collections::HashMap;
use std::sync::Arc;

/// This rank's communicators for every group family of a [`RankLayout`], and a registry
/// of groups by name.
///
/// It is a plain value: pass it to the layers and DDP that need it. Nothing is global,
/// so several states (over the same or different worlds) can live in one process.
///
/// Groups are found by family ([`tp`](Self::tp), [`dp`](Self::dp), …,
/// [`group`](Self::group)) or by name ([`group_named`](Self::group_named)): every
/// [`GroupKind`] is registered under its name (`"tp"`, `"dp-cp"`, `"tp-cp"`, …), and
/// [`add_group`](Self::add_group) registers rank lists of your own, such as the groups
/// in which DDP reduces the gradients of shared parameters.
#[derive(Clone)]
pub struct ParallelState {
    layout: RankLayout,
    world: Arc<dyn Communicator>,
    coordinates: Coordinates,
    expert_coordinates: ExpertCoordinates,
    tp: Arc<dyn Communicator>,
    pp: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    cp: Arc<dyn Communicator>,
    dp_cp: Arc<dyn Communicator>,
    model: Arc<dyn Communicator>,
    tp_dp: Arc<dyn Communicator>,
    tp_cp: Arc<dyn Communicator>,
    tp_dp_cp: Arc<dyn Communicator>,
    embedding: Option<Arc<dyn Communicator>>,
    position_embedding: Option<Arc<dyn Communicator>>,
    ep: Arc<dyn Communicator>,
    expert_tp: Arc<dyn Communicator>,
    expert_tp_ep: Arc<dyn Communicator>,
    expert_tp_ep_pp: Arc<dyn Communicator>,
    expert_dp: Arc<dyn Communicator>,
    user_groups: Vec<UserGroup>,
}

#[derive(Clone)]
struct UserGroup {
    name: String,
    ranks: Vec<usize>,
    comm: Option<Arc<dyn Communicator>>,
}

impl ParallelState {
    /// Splits `world` into every group of `layout`; a collective call: every rank of
    /// `world` must make it, with the same layout.
    ///
    /// Ranks of `world` are the layout's ranks. A rank outside the layout (below its
    /// offset or past its end) takes part in the splits, so its peers do not wait for
    /// it, and then gets [`Error::RankOutOfRange`].
    pub fn new(world: Arc<dyn Communicator>, layout: RankLayout) -> Result<ParallelState> {
        // Checks every rank agrees on, made before any split so that all fail together.
        let needed = layout.rank_offset() + layout.world_size();
        if world.size() < needed {
            return Err(Error::WorldTooSmall {
                world: world.size(),
                needed,
            });
        }
        if u32::try_from(layout.world_size()).is_err() {
            return Err(Error::WorldTooLarge {
                world: layout.world_size(),
            });
        }
        let rank = world.rank();
        let inside = layout.coordinates(rank);
        let mut split = HashMap::new();
        for kind in GroupKind::ALL {
            let membership = match inside {
                Ok(_) => layout.membership(kind, rank)?,
                Err(_) => None,
            };
            // Group indices and positions are below the world size, checked above to fit.
            let color = membership.map(|m| m.group as u32);
            let key = membership.map_or(0, |m| m.position as u32);
            split.insert(kind, world.split(color, key, kind.name())?);
        }
        let coordinates = inside?;
        let mut take = |kind: GroupKind| split.remove(&kind).flatten();
        let mut member = |kind: GroupKind| {
            take(kind).ok_or_else(|| Error::NotAMember {
                name: kind.name().to_string(),
                rank,
            })
        };
        Ok(ParallelState {
            expert_coordinates: layout.expert_coordinates(rank)?,
            coordinates,
            tp: member(GroupKind::Tp)?,
            pp: member(GroupKind::Pp)?,
            dp: member(GroupKind::Dp)?,
            cp: member(GroupKind::Cp)?,
            dp_cp: member(GroupKind::DpCp)?,
            model: member(GroupKind::TpPp)?,
            tp_dp: member(GroupKind::TpDp)?,
            tp_cp: member(GroupKind::TpCp)?,
            tp_dp_cp: member(GroupKind::TpDpCp)?,
            ep: member(GroupKind::Ep)?,
            expert_tp: member(GroupKind::ExpertTp)?,
            expert_tp_ep: member(GroupKind::ExpertTpEp)?,
            expert_tp_ep_pp: member(GroupKind::ExpertTpEpPp)?,
            expert_dp: member(GroupKind::ExpertDp)?,
            embedding: take(GroupKind::Embedding),
            position_embedding: take(GroupKind::PositionEmbedding),
            layout,
            world,
            user_groups: Vec::new(),
        })
    }

    /// The layout the groups were built from.
    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    /// The world communicator the groups were split from.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// This rank's dense coordinates.
    pub fn coordinates(&self) -> Coordinates {
        self.coordinates
    }

    /// This rank's expert coordinates.
    pub fn expert_coordinates(&self) -> ExpertCoordinates {
        self.expert_coordinates
    }

    /// This rank's group of a family; `None` only for an embedding family this rank's
    /// stage is not part of.
    pub fn group(&self, kind: GroupKind) -> Option<&Arc<dyn Communicator>> {
        match kind {
            GroupKind::Tp => Some(&self.tp),
            GroupKind::Pp => Some(&self.pp),
            GroupKind::Dp => Some(&self.dp),
            GroupKind::Cp => Some(&self.cp),
            GroupKind::DpCp => Some(&self.dp_cp),
            GroupKind::TpPp => Some(&self.model),
            GroupKind::TpDp => Some(&self.tp_dp),
            GroupKind::TpCp => Some(&self.tp_cp),
            GroupKind::TpDpCp => Some(&self.tp_dp_cp),
            GroupKind::Embedding => self.embedding.as_ref(),
            GroupKind::PositionEmbedding => self.position_embedding.as_ref(),
            GroupKind::Ep => Some(&self.ep),
            GroupKind::ExpertTp => Some(&self.expert_tp),
            GroupKind::ExpertTpEp => Some(&self.expert_tp_ep),
            GroupKind::ExpertTpEpPp => Some(&self.expert_tp_ep_pp),
            GroupKind::ExpertDp => Some(&self.expert_dp),
        }
    }

    /// Tensor-parallel group.
    pub fn tp(&self) -> &Arc<dyn Communicator> {
        &self.tp
    }

    /// Pipeline-parallel group.
    pub fn pp(&self) -> &Arc<dyn Communicator> {
        &self.pp
    }

    /// Data-parallel group (without context parallelism).
    pub fn dp(&self) -> &Arc<dyn Communicator> {
        &self.dp
    }

    /// Context-parallel group.
    pub fn cp(&self) -> &Arc<dyn Communicator> {
        &self.cp
    }

    /// Data- and context-parallel group: where dense gradients are reduced.
    pub fn dp_cp(&self) -> &Arc<dyn Communicator> {
        &self.dp_cp
    }

    /// The group dense gradients and the loss's token count are reduced over, Megatron's
    /// data-parallel group "with context parallelism": [`dp_cp`](Self::dp_cp) when the
    /// context-parallel group has more than one rank (each of its ranks' gradients
    /// covers only its own positions), else [`dp`](Self::dp) itself (the same ranks, so
    /// no second communicator is used).
    pub fn dp_with_cp(&self) -> &Arc<dyn Communicator> {
        match self.cp.size() {
            1 => &self.dp,
            _ => &self.dp_cp,
        }
    }

    /// Model-parallel group (tensor and pipeline parallel).
    pub fn model(&self) -> &Arc<dyn Communicator> {
        &self.model
    }

    /// Tensor- and data-parallel group.
    pub fn tp_dp(&self) -> &Arc<dyn Communicator> {
        &self.tp_dp
    }

    /// Tensor- and context-parallel group.
    pub fn tp_cp(&self) -> &Arc<dyn Communicator> {
        &self.tp_cp
    }

    /// Tensor-, data- and context-parallel group.
    pub fn tp_dp_cp(&self) -> &Arc<dyn Communicator> {
        &self.tp_dp_cp
    }

    /// Word-embedding group, if this rank's stage holds the embeddings.
    pub fn embedding(&self) -> Option<&Arc<dyn Communicator>> {
        self.embedding.as_ref()
    }

    /// Position-embedding group, if this rank's stage holds the position embeddings.
    pub fn position_embedding(&self) -> Option<&Arc<dyn Communicator>> {
        self.position_embedding.as_ref()
    }

    /// Expert-parallel group.
    pub fn ep(&self) -> &Arc<dyn Communicator> {
        &self.ep
    }

    /// Tensor-parallel group of expert layers.
    pub fn expert_tp(&self) -> &Arc<dyn Communicator> {
        &self.expert_tp
    }

    /// Expert tensor- and expert-parallel group.
    pub fn expert_tp_ep(&self) -> &Arc<dyn Communicator> {
        &self.expert_tp_ep
    }

    /// Expert tensor-, expert- and pipeline-parallel group.
    pub fn expert_tp_ep_pp(&self) -> &Arc<dyn Communicator> {
        &self.expert_tp_ep_pp
    }

    /// Data-parallel group of expert weights.
    pub fn expert_dp(&self) -> &Arc<dyn Communicator> {
        &self.expert_dp
    }

    /// Tensor-parallel rank.
    pub fn tp_rank(&self) -> usize {
        self.coordinates.tp
    }

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> usize {
        self.layout.tp()
    }

    /// Pipeline stage of this rank.
    pub fn pp_rank(&self) -> usize {
        self.coordinates.pp
    }

    /// Number of pipeline stages.
    pub fn pp_size(&self) -> usize {
        self.layout.pp()
    }

    /// Data-parallel rank.
    pub fn dp_rank(&self) -> usize {
        self.coordinates.dp
    }

    /// Data-parallel size.
    pub fn dp_size(&self) -> usize {
        self.layout.dp()
    }

    /// Context-parallel rank.
    pub fn cp_rank(&self) -> usize {
        self.coordinates.cp
    }

    /// Context-parallel size.
    pub fn cp_size(&self) -> usize {
        self.layout.cp()
    }

    /// Expert-parallel rank.
    pub fn ep_rank(&self) -> usize {
        self.expert_coordinates.ep
    }

    /// Expert-parallel size.
    pub fn ep_size(&self) -> usize {
        self.layout.ep()
    }

    /// Whether this rank runs the first pipeline stage.
    pub fn is_first_stage(&self) -> bool {
        self.coordinates.pp == 0
    }

    /// Whether this rank runs the last pipeline stage.
    pub fn is_last_stage(&self) -> bool {
        self.coordinates.pp + 1 == self.layout.pp()
    }

    /// World rank of the next pipeline stage (the last wraps to the first).
    pub fn next_pipeline_rank(&self) -> Result<usize> {
        self.layout.next_pipeline_rank(self.rank())
    }

    /// World rank of the previous pipeline stage (the first wraps to the last).
    pub fn previous_pipeline_rank(&self) -> Result<usize> {
        self.layout.previous_pipeline_rank(self.rank())
    }

    /// Registers `ranks` (world ranks, in the order they get group ranks) as a group
    /// called `name`; a collective call over the world: every world rank must make it
    /// with the same arguments. Ranks not listed are not members.
    pub fn add_group(&mut self, name: &str, ranks: &[usize]) -> Result<()> {
        let invalid = |reason: String| Error::InvalidGroupRanks {
            name: name.to_string(),
            reason,
        };
        if self.group_names().contains(&name) {
            return Err(Error::DuplicateGroupName {
                name: name.to_string(),
            });
        }
        if ranks.is_empty() {
            return Err(invalid("the rank list is empty".into()));
        }
        let world_size = self.world.size();
        let mut seen = vec![false; world_size];
        for &rank in ranks {
            match seen.get_mut(rank) {
                None => {
                    return Err(invalid(format!(
                        "rank {rank} is not in the world of {world_size} ranks (0..={})",
                        world_size - 1
                    )))
                }
                Some(true) => return Err(invalid(format!("rank {rank} is listed twice"))),
                Some(slot) => *slot = true,
            }
        }
        let position = ranks.iter().position(|&r| r == self.rank());
        if position.is_some_and(|p| u32::try_from(p).is_err()) {
            return Err(invalid("more ranks than a u32 split key can order".into()));
        }
        let comm = self
            .world
            .split(position.map(|_| 0), position.unwrap_or(0) as u32, name)?;
        self.user_groups.push(UserGroup {
            name: name.to_string(),
            ranks: ranks.to_vec(),
            comm,
        });
        Ok(())
    }

    /// Every registered name: the [`GroupKind`] names, then groups added with
    /// [`add_group`](Self::add_group), in the order they were added.
    #[doc(alias = "get_names")]
    pub fn group_names(&self) -> Vec<&str> {
        GroupKind::ALL
            .iter()
            .map(|k| k.name())
            .chain(self.user_groups.iter().map(|g| g.name.as_str()))
            .collect()
    }

    /// This rank's communicator of the group called `name`.
    #[doc(alias = "get_group")]
    pub fn group_named(&self, name: &str) -> Result<&Arc<dyn Communicator>> {
        let comm = match name.parse::<GroupKind>() {
            Ok(kind) => self.group(kind),
            Err(_) => self
                .user_groups
                .iter()
                .find(|g| g.name == name)
                .ok_or_else(|| Error::UnknownGroup {
                    name: name.to_string(),
                    known: self.group_names().iter().map(|n| n.to_string()).collect(),
                })?
                .comm
                .as_ref(),
        };
        comm.ok_or_else(|| Error::NotAMember {
            name: name.to_string(),
            rank: self.rank(),
        })
    }

    /// Size of this rank's group called `name`.
    #[doc(alias = "get_size")]
    pub fn size_named(&self, name: &str) -> Result<usize> {
        Ok(self.group_named(name)?.size())
    }

    /// The world ranks of a group added with [`add_group`](Self::add_group), as given,
    /// whether or not this rank is a member.
    pub fn user_group_ranks(&self, name: &str) -> Option<&[usize]> {
        self.user_groups
            .iter()
            .find(|g| g.name == name)
            .map(|g| g.ranks.as_slice())
    }
}
