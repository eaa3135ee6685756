//! The layouts of a world that fit a memory budget, with what each sends per step.

use crate::memory::{predict, Breakdown, Layout, Model, Recompute, Target};
use crate::traffic::traffic;
use crate::{Error, Result};
use ferrotron_pipeline::Schedule;

/// What every layout must keep the same, and the budget it must fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Search {
    /// Ranks (devices) in all: TP × PP × DP.
    pub world: usize,
    /// Bytes each rank may hold at its peak.
    pub budget: usize,
    /// Sequences per step over all data-parallel ranks.
    pub global_batch: usize,
    /// Sequences per microbatch.
    pub micro_batch: usize,
    /// The largest tensor-parallel size to consider (Megatron keeps TP inside a node:
    /// 8 on most GPU machines).
    pub max_tp: usize,
    /// Bytes of a stored activation or parameter: 4 for f32, 2 for bf16 and fp16.
    pub element: usize,
    /// Host or device memory.
    pub target: Target,
    /// As [`Layout::corpus_bytes`].
    pub corpus_bytes: usize,
}

/// One layout, its predicted peak and its traffic.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// Each stage's predicted peak per rank, stage 0 first.
    pub stages: Vec<Breakdown>,
    /// The largest of them.
    pub peak: usize,
    /// Bytes the busiest rank sends per step.
    pub traffic: f64,
    /// The schedule's idle fraction in theory.
    pub bubble: f64,
}

/// What a search found.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// TP × PP × DP and schedule combinations considered (each tried with every option).
    pub considered: usize,
    /// Those that fit, one per TP × PP × DP and schedule (the option with the least
    /// traffic, then the least recomputation, then the smallest peak), the least traffic
    /// first.
    pub fitting: Vec<Candidate>,
    /// The layout with the smallest peak, fitting or not.
    pub smallest: Candidate,
}

/// Every layout of `search.world` ranks for `model` that fits `search.budget`. Tensor
/// parallelism runs with sequence parallelism; each layout is tried with and without the
/// distributed optimizer (when DP > 1), with no, selective and full (uniform, one layer)
/// recomputation, and with 1F1B and each interleaved schedule the layers allow (GPipe
/// holds more than 1F1B and sends the same, so it never wins).
pub fn fit(model: &Model, search: &Search) -> Result<Fit> {
    let sizes = [
        search.world,
        search.budget,
        search.global_batch,
        search.micro_batch,
    ];
    if sizes.contains(&0) || search.max_tp == 0 {
        return Err(Error::Invalid(
            "world, budget, global batch, micro-batch size and largest TP must be at least 1"
                .into(),
        ));
    }
    let mut all = Vec::new();
    for layout in layouts(model, search) {
        let stages = predict(model, &layout)?;
        let sent = traffic(model, &layout)?;
        all.push(Candidate {
            peak: stages.iter().map(Breakdown::total).max().unwrap_or(0),
            stages,
            traffic: sent.iter().map(|t| t.total()).fold(0.0, f64::max),
            bubble: layout
                .schedule
                .bubble_fraction(layout.pp, layout.microbatches),
            layout,
        });
    }
    let considered = distinct(&all).len();
    let smallest = all.iter().min_by_key(|c| c.peak).cloned().ok_or_else(|| {
        Error::Invalid(format!(
            "no layout of {} ranks splits this model and a global batch of {} in \
             microbatches of {}: the world must be TP × PP × DP with TP dividing the {} \
             key/value heads, PP the {} layers, and DP × {} the global batch",
            search.world,
            search.global_batch,
            search.micro_batch,
            model.query_groups,
            model.layers,
            search.micro_batch
        ))
    })?;
    let mut fitting: Vec<Candidate> = all
        .into_iter()
        .filter(|c| c.peak <= search.budget)
        .collect();
    fitting.sort_by(|a, b| {
        a.traffic
            .total_cmp(&b.traffic)
            .then(cost(a.layout.recompute).cmp(&cost(b.layout.recompute)))
            .then(a.peak.cmp(&b.peak))
    });
    let mut seen = std::collections::HashSet::new();
    fitting.retain(|c| seen.insert(key(c)));
    Ok(Fit {
        considered,
        fitting,
        smallest,
    })
}

/// What tells layouts apart (DP follows from TP and PP).
fn key(candidate: &Candidate) -> (usize, usize, usize) {
    let layout = &candidate.layout;
    (layout.tp, layout.pp, layout.schedule.chunks())
}

fn distinct(candidates: &[Candidate]) -> std::collections::HashSet<(usize, usize, usize)> {
    candidates.iter().map(key).collect()
}

/// How much forward a recomputation repeats, in order.
fn cost(recompute: Recompute) -> u8 {
    match recompute {
        Recompute::None => 0,
        Recompute::Selective => 1,
        Recompute::Block { .. } | Recompute::Uniform { .. } => 2,
    }
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

fn layouts(model: &Model, search: &Search) -> Vec<Layout> {
    let mut out = Vec::new();
    let tps = divisors(model.query_groups)
        .filter(|&t| t <= search.max_tp && search.world.is_multiple_of(t));
    for tp in tps {
        let pps = divisors(model.layers).filter(|&p| (search.world / tp).is_multiple_of(p));
        for pp in pps.collect::<Vec<_>>() {
            let dp = search.world / (tp * pp);
            if !search.global_batch.is_multiple_of(dp * search.micro_batch) {
                continue;
            }
            let batch = search.global_batch / dp;
            let microbatches = batch / search.micro_batch;
            for schedule in schedules(model.layers, pp, microbatches) {
                for distributed_optimizer in [false, true] {
                    if distributed_optimizer && dp == 1 {
                        continue;
                    }
                    for recompute in [
                        Recompute::None,
                        Recompute::Selective,
                        Recompute::Uniform { layers: 1 },
                    ] {
                        out.push(Layout {
                            tp,
                            pp,
                            dp,
                            schedule,
                            microbatches,
                            batch,
                            element: search.element,
                            distributed_optimizer,
                            sequence_parallel: tp > 1,
                            recompute,
                            target: search.target,
                            corpus_bytes: search.corpus_bytes,
                        });
                    }
                }
            }
        }
    }
    out
}

fn schedules(layers: usize, pp: usize, microbatches: usize) -> Vec<Schedule> {
    let mut out = vec![Schedule::OneFOneB];
    if pp > 1 && microbatches.is_multiple_of(pp) {
        let interleaved = divisors(layers / pp)
            .filter(|&v| v > 1)
            .map(|virtual_stages| Schedule::Interleaved { virtual_stages });
        out.extend(interleaved);
    }
    out
}
