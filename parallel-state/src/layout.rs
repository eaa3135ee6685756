//! [`RankLayout`]: which ranks form which groups, computed without communication.

use crate::error::{Error, Result};
use crate::grid::{Family, Grid};
use crate::order::{Axis, Order};
use std::fmt;
use std::str::FromStr;

/// A family of process groups Megatron-Core creates in `initialize_model_parallel`.
///
/// Dense families come from the rank generator over `tp, cp, dp, pp`; expert families
/// from Megatron's second generator over `expert tp, ep, expert dp, pp` (context
/// parallelism folds into expert data parallelism there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// Tensor parallel (`"tp"`).
    Tp,
    /// Pipeline parallel (`"pp"`).
    Pp,
    /// Data parallel without context parallelism (`"dp"`).
    Dp,
    /// Context parallel (`"cp"`).
    Cp,
    /// Data and context parallel: where gradients are reduced (`"dp-cp"`).
    DpCp,
    /// Tensor and pipeline parallel, Megatron's *model-parallel* group (`"tp-pp"`).
    TpPp,
    /// Tensor and data parallel (`"tp-dp"`).
    TpDp,
    /// Tensor and context parallel (`"tp-cp"`).
    TpCp,
    /// Tensor, data and context parallel (`"tp-dp-cp"`).
    TpDpCp,
    /// Ranks holding the word embeddings: chosen stages of each pipeline
    /// (`"embedding"`).
    Embedding,
    /// Ranks holding the position embeddings (`"position-embedding"`).
    PositionEmbedding,
    /// Expert parallel (`"ep"`).
    Ep,
    /// Tensor parallel inside expert layers (`"expert-tp"`).
    ExpertTp,
    /// Expert tensor and expert parallel (`"expert-tp-ep"`).
    ExpertTpEp,
    /// Expert tensor, expert and pipeline parallel (`"expert-tp-ep-pp"`).
    ExpertTpEpPp,
    /// Data parallel of expert weights (`"expert-dp"`).
    ExpertDp,
}

impl GroupKind {
    /// Every family, in the order [`ParallelState`](crate::ParallelState) creates them.
    pub const ALL: [GroupKind; 16] = [
        GroupKind::Tp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::Cp,
        GroupKind::DpCp,
        GroupKind::TpPp,
        GroupKind::TpDp,
        GroupKind::TpCp,
        GroupKind::TpDpCp,
        GroupKind::Embedding,
        GroupKind::PositionEmbedding,
        GroupKind::Ep,
        GroupKind::ExpertTp,
        GroupKind::ExpertTpEp,
        GroupKind::ExpertTpEpPp,
        GroupKind::ExpertDp,
    ];

    /// The ten dense families the layout tool's `--json` output lists.
    pub const CORE: [GroupKind; 10] = [
        GroupKind::Tp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::Cp,
        GroupKind::DpCp,
        GroupKind::TpPp,
        GroupKind::TpDp,
        GroupKind::TpCp,
        GroupKind::Embedding,
        GroupKind::PositionEmbedding,
    ];

    /// The family's name, also its name in [`ParallelState`](crate::ParallelState)'s
    /// registry.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
            GroupKind::Cp => "cp",
            GroupKind::DpCp => "dp-cp",
            GroupKind::TpPp => "tp-pp",
            GroupKind::TpDp => "tp-dp",
            GroupKind::TpCp => "tp-cp",
            GroupKind::TpDpCp => "tp-dp-cp",
            GroupKind::Embedding => "embedding",
            GroupKind::PositionEmbedding => "position-embedding",
            GroupKind::Ep => "ep",
            GroupKind::ExpertTp => "expert-tp",
            GroupKind::ExpertTpEp => "expert-tp-ep",
            GroupKind::ExpertTpEpPp => "expert-tp-ep-pp",
            GroupKind::ExpertDp => "expert-dp",
        }
    }

    /// Whether every rank of the layout belongs to exactly one group of this family
    /// (false only for the embedding families, which hold chosen stages).
    pub fn covers_every_rank(self) -> bool {
        !matches!(self, GroupKind::Embedding | GroupKind::PositionEmbedding)
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GroupKind {
    type Err = Error;

    fn from_str(name: &str) -> Result<GroupKind> {
        GroupKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| Error::UnknownGroup {
                name: name.to_string(),
                known: GroupKind::ALL
                    .iter()
                    .map(|k| k.name().to_string())
                    .collect(),
            })
    }
}

/// A pipeline stage, relative to the pipeline's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Stage 0.
    First,
    /// Stage `pp - 1`.
    Last,
    /// A stage by index.
    At(usize),
}

/// A rank's place along the dense axes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Coordinates {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Context-parallel rank.
    pub cp: usize,
    /// Data-parallel rank.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

/// A rank's place along the expert axes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExpertCoordinates {
    /// Expert tensor-parallel rank.
    pub tp: usize,
    /// Expert-parallel rank.
    pub ep: usize,
    /// Expert data-parallel rank.
    pub dp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

/// Where a rank sits in one family of groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Membership {
    /// Index of the group in the family, in Megatron's enumeration order.
    pub group: usize,
    /// The rank's position in that group (its rank in the group's communicator).
    pub position: usize,
    /// Number of ranks in the group.
    pub size: usize,
}

/// Describes a layout; [`build`](LayoutBuilder::build) checks it. Start from
/// [`RankLayout::builder`].
#[derive(Clone, Debug)]
pub struct LayoutBuilder {
    world_size: usize,
    tp: usize,
    pp: usize,
    cp: usize,
    ep: usize,
    expert_tp: Option<usize>,
    order: Order,
    rank_offset: usize,
    embedding_stages: Vec<Stage>,
    position_embedding_stages: Vec<Stage>,
}

impl LayoutBuilder {
    /// Tensor-parallel size (default 1).
    pub fn tp(mut self, size: usize) -> Self {
        self.tp = size;
        self
    }

    /// Pipeline-parallel size (default 1).
    pub fn pp(mut self, size: usize) -> Self {
        self.pp = size;
        self
    }

    /// Context-parallel size (default 1).
    pub fn cp(mut self, size: usize) -> Self {
        self.cp = size;
        self
    }

    /// Expert-parallel size (default 1).
    pub fn ep(mut self, size: usize) -> Self {
        self.ep = size;
        self
    }

    /// Tensor-parallel size inside expert layers (default: the dense `tp`).
    pub fn expert_tp(mut self, size: usize) -> Self {
        self.expert_tp = Some(size);
        self
    }

    /// Axis order, fastest-varying first (default `"tp-cp-ep-dp-pp"`).
    pub fn order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// First rank of the layout: its groups hold ranks `offset..offset + world_size`
    /// (default 0).
    pub fn rank_offset(mut self, offset: usize) -> Self {
        self.rank_offset = offset;
        self
    }

    /// Pipeline stages that hold the word embeddings (default first and last). An
    /// empty list means no embedding groups.
    pub fn embedding_stages(mut self, stages: impl IntoIterator<Item = Stage>) -> Self {
        self.embedding_stages = stages.into_iter().collect();
        self
    }

    /// Pipeline stages that hold the position embeddings (default first).
    pub fn position_embedding_stages(mut self, stages: impl IntoIterator<Item = Stage>) -> Self {
        self.position_embedding_stages = stages.into_iter().collect();
        self
    }

    /// Checks the configuration the way Megatron-Core does and computes the layout.
    pub fn build(self) -> Result<RankLayout> {
        let expert_tp = self.expert_tp.unwrap_or(self.tp);
        for (what, size) in [
            ("world size", self.world_size),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("expert tp", expert_tp),
        ] {
            if size == 0 {
                return Err(Error::ZeroSize { what });
            }
        }
        let world = self.world_size;
        let dp = world / divisor(world, "tp·pp·cp", &[self.tp, self.pp, self.cp])?;
        let expert_dp = world / divisor(world, "expert tp·ep·pp", &[expert_tp, self.ep, self.pp])?;
        let order_text = self.order.to_string();
        for (axis, label, size) in [
            (Axis::Tp, "tp", self.tp),
            (Axis::Cp, "cp", self.cp),
            (Axis::Dp, "dp", dp),
            (Axis::Pp, "pp", self.pp),
            (Axis::Tp, "expert tp", expert_tp),
            (Axis::Ep, "ep", self.ep),
            (Axis::Dp, "expert dp", expert_dp),
        ] {
            if size > 1 && !self.order.contains(axis) {
                return Err(Error::MissingOrderAxis {
                    axis: label,
                    size,
                    order: order_text,
                });
            }
        }
        let axes = self.order.completed();
        let dense = Grid::new(&axes, |axis| match axis {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Ep => 1,
            Axis::Dp => dp,
            Axis::Pp => self.pp,
        });
        let expert = Grid::new(&axes, |axis| match axis {
            Axis::Tp => expert_tp,
            Axis::Cp => 1,
            Axis::Ep => self.ep,
            Axis::Dp => expert_dp,
            Axis::Pp => self.pp,
        });
        let pp_last = self.order.axes().last() == Some(&Axis::Pp);
        if self.pp > 1 && !pp_last && expert_dp != dp {
            return Err(Error::ExpertMismatch {
                reason: format!(
                    "with order {order_text:?} (pp not last) and pp = {}, the expert data-parallel \
                     size ({expert_dp} = world / (expert tp·ep·pp)) must equal dp ({dp}); \
                     put pp last in the order or choose sizes that make them equal",
                    self.pp
                ),
            });
        }
        if self.pp > 1 && dense.stride(Axis::Pp) != expert.stride(Axis::Pp) {
            return Err(Error::ExpertMismatch {
                reason: format!(
                    "the pipeline groups differ between dense layers (stride {}) and expert \
                     layers (stride {}) under order {order_text:?}; put pp last in the order",
                    dense.stride(Axis::Pp),
                    expert.stride(Axis::Pp)
                ),
            });
        }
        if self.rank_offset.checked_add(world).is_none() {
            return Err(Error::RankOutOfRange {
                rank: self.rank_offset,
                first: 0,
                last: usize::MAX - world,
            });
        }
        Ok(RankLayout {
            world_size: world,
            rank_offset: self.rank_offset,
            order: self.order,
            embedding_stages: resolve_stages("embedding", &self.embedding_stages, self.pp)?,
            position_embedding_stages: resolve_stages(
                "position-embedding",
                &self.position_embedding_stages,
                self.pp,
            )?,
            dense,
            expert,
        })
    }
}

/// The product of `factors` if it divides `world`.
fn divisor(world: usize, names: &str, factors: &[usize]) -> Result<usize> {
    let product = factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .unwrap_or(usize::MAX);
    if world.is_multiple_of(product) {
        return Ok(product);
    }
    let shown: Vec<String> = factors.iter().map(|f| f.to_string()).collect();
    Err(Error::NotDivisible {
        world,
        what: format!("{names} ({})", shown.join("·")),
        product,
    })
}

fn resolve_stages(group: &'static str, stages: &[Stage], pp: usize) -> Result<Vec<usize>> {
    let mut resolved = stages
        .iter()
        .map(|stage| match *stage {
            Stage::First => Ok(0),
            Stage::Last => Ok(pp - 1),
            Stage::At(stage) if stage < pp => Ok(stage),
            Stage::At(stage) => Err(Error::StageOutOfRange { group, stage, pp }),
        })
        .collect::<Result<Vec<_>>>()?;
    resolved.sort_unstable();
    resolved.dedup();
    Ok(resolved)
}

/// Megatron-Core's rank layout for one configuration: the rank lists of every group and
/// each rank's coordinates, with no communication.
///
/// Queries about one rank ([`coordinates`](Self::coordinates),
/// [`group_of`](Self::group_of), [`membership`](Self::membership)) cost O(group size),
/// so they are instant even for a million ranks; [`groups`](Self::groups) enumerates a
/// whole family.
///
/// ```
/// use ferrotron_parallel_state::{GroupKind, RankLayout};
/// let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
/// assert_eq!(layout.dp(), 2);
/// assert_eq!(layout.groups(GroupKind::Tp), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
/// assert_eq!(layout.group_of(GroupKind::Pp, 5)?, Some(vec![1, 5]));
/// # Ok::<(), ferrotron_parallel_state::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankLayout {
    world_size: usize,
    rank_offset: usize,
    order: Order,
    embedding_stages: Vec<usize>,
    position_embedding_stages: Vec<usize>,
    dense: Grid,
    expert: Grid,
}

impl RankLayout {
    /// Starts describing a layout of `world_size` ranks (every parallel size 1, order
    /// `"tp-cp-ep-dp-pp"`, no offset, embeddings on the first and last stages, position
    /// embeddings on the first).
    pub fn builder(world_size: usize) -> LayoutBuilder {
        LayoutBuilder {
            world_size,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            expert_tp: None,
            order: Order::default(),
            rank_offset: 0,
            embedding_stages: vec![Stage::First, Stage::Last],
            position_embedding_stages: vec![Stage::First],
        }
    }

    /// Number of ranks in the layout.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// First rank of the layout.
    pub fn rank_offset(&self) -> usize {
        self.rank_offset
    }

    /// The order as configured (axes it leaves out come last, in [`Axis::ALL`] order).
    pub fn order(&self) -> &Order {
        &self.order
    }

    /// Tensor-parallel size.
    pub fn tp(&self) -> usize {
        self.dense.size(Axis::Tp)
    }

    /// Pipeline-parallel size.
    pub fn pp(&self) -> usize {
        self.dense.size(Axis::Pp)
    }

    /// Context-parallel size.
    pub fn cp(&self) -> usize {
        self.dense.size(Axis::Cp)
    }

    /// Data-parallel size: `world / (tp·pp·cp)`.
    pub fn dp(&self) -> usize {
        self.dense.size(Axis::Dp)
    }

    /// Expert-parallel size.
    pub fn ep(&self) -> usize {
        self.expert.size(Axis::Ep)
    }

    /// Tensor-parallel size inside expert layers.
    pub fn expert_tp(&self) -> usize {
        self.expert.size(Axis::Tp)
    }

    /// Expert data-parallel size: `world / (expert_tp·ep·pp)`.
    pub fn expert_dp(&self) -> usize {
        self.expert.size(Axis::Dp)
    }

    /// Pipeline stages holding the word embeddings, ascending.
    pub fn embedding_stages(&self) -> &[usize] {
        &self.embedding_stages
    }

    /// Pipeline stages holding the position embeddings, ascending.
    pub fn position_embedding_stages(&self) -> &[usize] {
        &self.position_embedding_stages
    }

    /// Number of groups in a family.
    pub fn group_count(&self, kind: GroupKind) -> usize {
        match self.stages(kind) {
            Some([]) => 0,
            Some(_) => self.family(GroupKind::Pp).group_count(),
            None => self.family(kind).group_count(),
        }
    }

    /// Group `index` of a family (ranks ascending), or `None` past the last group.
    pub fn group(&self, kind: GroupKind, index: usize) -> Option<Vec<usize>> {
        if index >= self.group_count(kind) {
            return None;
        }
        let local = match self.stages(kind) {
            Some(stages) => {
                let pipeline = self.family(GroupKind::Pp).group(index);
                stages.iter().map(|&s| pipeline[s]).collect()
            }
            None => self.family(kind).group(index),
        };
        Some(self.to_global(local))
    }

    /// Every group of a family, in Megatron's order, each with ranks ascending.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        (0..self.group_count(kind))
            .filter_map(|index| self.group(kind, index))
            .collect()
    }

    /// Where `rank` sits in a family; `None` for a rank outside every embedding group.
    pub fn membership(&self, kind: GroupKind, rank: usize) -> Result<Option<Membership>> {
        let local = self.local(rank)?;
        Ok(match self.stages(kind) {
            Some(stages) => {
                let (group, stage) = self.family(GroupKind::Pp).locate(local);
                stages
                    .iter()
                    .position(|&s| s == stage)
                    .map(|position| Membership {
                        group,
                        position,
                        size: stages.len(),
                    })
            }
            None => {
                let family = self.family(kind);
                let (group, position) = family.locate(local);
                Some(Membership {
                    group,
                    position,
                    size: family.group_size(),
                })
            }
        })
    }

    /// The ranks of `rank`'s group in a family, computed in O(group size); `None` for a
    /// rank outside every embedding group.
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Result<Option<Vec<usize>>> {
        Ok(self
            .membership(kind, rank)?
            .and_then(|m| self.group(kind, m.group)))
    }

    /// `rank`'s coordinates along the dense axes.
    pub fn coordinates(&self, rank: usize) -> Result<Coordinates> {
        let local = self.local(rank)?;
        Ok(Coordinates {
            tp: self.dense.coordinate(local, Axis::Tp),
            cp: self.dense.coordinate(local, Axis::Cp),
            dp: self.dense.coordinate(local, Axis::Dp),
            pp: self.dense.coordinate(local, Axis::Pp),
        })
    }

    /// `rank`'s coordinates along the expert axes.
    pub fn expert_coordinates(&self, rank: usize) -> Result<ExpertCoordinates> {
        let local = self.local(rank)?;
        Ok(ExpertCoordinates {
            tp: self.expert.coordinate(local, Axis::Tp),
            ep: self.expert.coordinate(local, Axis::Ep),
            dp: self.expert.coordinate(local, Axis::Dp),
            pp: self.expert.coordinate(local, Axis::Pp),
        })
    }

    /// The rank at dense `coordinates`: the inverse of [`coordinates`](Self::coordinates).
    pub fn rank_of(&self, coordinates: Coordinates) -> Result<usize> {
        let mut local = 0;
        for (axis, value) in [
            (Axis::Tp, coordinates.tp),
            (Axis::Cp, coordinates.cp),
            (Axis::Dp, coordinates.dp),
            (Axis::Pp, coordinates.pp),
        ] {
            let size = self.dense.size(axis);
            if value >= size {
                return Err(Error::CoordinateOutOfRange {
                    axis: axis.token(),
                    value,
                    size,
                });
            }
            local += value * self.dense.stride(axis);
        }
        Ok(self.rank_offset + local)
    }

    /// Whether `rank` runs the first pipeline stage.
    pub fn is_first_stage(&self, rank: usize) -> Result<bool> {
        Ok(self.coordinates(rank)?.pp == 0)
    }

    /// Whether `rank` runs the last pipeline stage.
    pub fn is_last_stage(&self, rank: usize) -> Result<bool> {
        Ok(self.coordinates(rank)?.pp == self.pp() - 1)
    }

    /// The rank running the next stage of `rank`'s pipeline; the last stage wraps to
    /// the first, as in Megatron.
    pub fn next_pipeline_rank(&self, rank: usize) -> Result<usize> {
        self.pipeline_neighbour(rank, 1)
    }

    /// The rank running the previous stage of `rank`'s pipeline; the first stage wraps
    /// to the last, as in Megatron.
    pub fn previous_pipeline_rank(&self, rank: usize) -> Result<usize> {
        self.pipeline_neighbour(rank, self.pp() - 1)
    }

    fn pipeline_neighbour(&self, rank: usize, step: usize) -> Result<usize> {
        let coordinates = self.coordinates(rank)?;
        self.rank_of(Coordinates {
            pp: (coordinates.pp + step) % self.pp(),
            ..coordinates
        })
    }

    /// The chosen stages for the embedding families, `None` for the others.
    fn stages(&self, kind: GroupKind) -> Option<&[usize]> {
        match kind {
            GroupKind::Embedding => Some(&self.embedding_stages),
            GroupKind::PositionEmbedding => Some(&self.position_embedding_stages),
            _ => None,
        }
    }

    fn family(&self, kind: GroupKind) -> Family {
        use Axis::*;
        let (grid, free): (&Grid, &[Axis]) = match kind {
            GroupKind::Tp => (&self.dense, &[Tp]),
            GroupKind::Pp | GroupKind::Embedding | GroupKind::PositionEmbedding => {
                (&self.dense, &[Pp])
            }
            GroupKind::Dp => (&self.dense, &[Dp]),
            GroupKind::Cp => (&self.dense, &[Cp]),
            GroupKind::DpCp => (&self.dense, &[Dp, Cp]),
            GroupKind::TpPp => (&self.dense, &[Tp, Pp]),
            GroupKind::TpDp => (&self.dense, &[Tp, Dp]),
            GroupKind::TpCp => (&self.dense, &[Tp, Cp]),
            GroupKind::TpDpCp => (&self.dense, &[Tp, Dp, Cp]),
            GroupKind::Ep => (&self.expert, &[Ep]),
            GroupKind::ExpertTp => (&self.expert, &[Tp]),
            GroupKind::ExpertTpEp => (&self.expert, &[Tp, Ep]),
            GroupKind::ExpertTpEpPp => (&self.expert, &[Tp, Ep, Pp]),
            GroupKind::ExpertDp => (&self.expert, &[Dp]),
        };
        grid.family(free)
    }

    fn local(&self, rank: usize) -> Result<usize> {
        rank.checked_sub(self.rank_offset)
            .filter(|&local| local < self.world_size)
            .ok_or(Error::RankOutOfRange {
                rank,
                first: self.rank_offset,
                last: self.rank_offset + (self.world_size - 1),
            })
    }

    fn to_global(&self, mut local: Vec<usize>) -> Vec<usize> {
        for rank in &mut local {
            *rank += self.rank_offset;
        }
        local
    }
}
