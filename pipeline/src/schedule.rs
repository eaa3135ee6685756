//! The schedules as plans: for each rank, the ordered forwards, backwards and batched
//! exchanges it runs in one step. Plans are pure data, so their properties (every message
//! paired, no deadlock, the activation bound) are tested without running a model.
//!
//! The communication follows Megatron-Core's `schedules.py`: each exchange is what one of
//! its `send_*_recv_*` calls does, and adjacent exchanges are merged into one batch
//! (which can only let a rank finish sooner: every transfer is posted at once).

use crate::error::{Error, Result};

/// How a step drives its microbatches through the stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Every forward, then every backward (GPipe): activations of all microbatches are
    /// held at once.
    GPipe,
    /// One forward, one backward (PipeDream-Flush, Megatron's default): a warm-up of
    /// `pp − stage − 1` forwards, then alternation, then a cool-down; stage `s` holds at
    /// most `pp − s` microbatches' activations.
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank (Megatron's interleaved schedule):
    /// chunk `c` of rank `r` is virtual stage `c·pp + r`, and the bubble shrinks by the
    /// number of chunks. Needs microbatches in multiples of `pp`.
    Interleaved {
        /// Model chunks per rank (≥ 1).
        virtual_stages: usize,
    },
}

impl Schedule {
    /// Parses `gpipe`, `1f1b` or `interleaved` (the latter with `virtual_stages` chunks).
    pub fn from_name(name: &str, virtual_stages: usize) -> Result<Schedule> {
        match name {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            "interleaved" => Ok(Schedule::Interleaved { virtual_stages }),
            other => Err(Error::Config(format!(
                "unknown schedule '{other}'; use gpipe, 1f1b or interleaved"
            ))),
        }
    }

    /// The name [`from_name`](Self::from_name) parses.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved { .. } => "interleaved",
        }
    }

    /// Model chunks per rank: 1 except for the interleaved schedule.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }

    /// The idle fraction of a step in theory, for stages of equal cost and free
    /// communication: `(pp − 1)/(m + pp − 1)`, and `(pp − 1)/(v·m + pp − 1)` interleaved.
    pub fn bubble_fraction(self, pp: usize, microbatches: usize) -> f64 {
        let idle = pp.saturating_sub(1) as f64;
        idle / ((self.chunks() * microbatches) as f64 + idle)
    }

    /// What every step's microbatch count must be a multiple of over `pp` stages: `pp`
    /// for the interleaved schedule (it runs microbatches in groups of the pipeline
    /// size), 1 for the others. A forward-only pass of a single sequence (sampling, say)
    /// sends this many copies.
    pub fn microbatch_multiple(self, pp: usize) -> usize {
        match self {
            Schedule::Interleaved { .. } => pp.max(1),
            _ => 1,
        }
    }

    /// Checks that this schedule can run `microbatches` over `pp` stages.
    pub fn validate(self, pp: usize, microbatches: usize) -> Result<()> {
        if pp == 0 || microbatches == 0 {
            return Err(Error::Config(format!(
                "a pipeline needs at least one stage and one microbatch (got {pp} stages, \
                 {microbatches} microbatches)"
            )));
        }
        if let Schedule::Interleaved { virtual_stages } = self {
            if virtual_stages == 0 {
                return Err(Error::Config(
                    "the interleaved schedule needs at least one virtual stage per rank".into(),
                ));
            }
            if virtual_stages > 1 && pp == 1 {
                return Err(Error::Config(
                    "the interleaved schedule passes activations between ranks; with one \
                     pipeline stage, put every layer in one chunk (virtual stages 1)"
                        .into(),
                ));
            }
            if !microbatches.is_multiple_of(self.microbatch_multiple(pp)) {
                let lower = microbatches / pp * pp;
                let hint = if lower > 0 {
                    format!("{lower} or {}", lower + pp)
                } else {
                    pp.to_string()
                };
                return Err(Error::Config(format!(
                    "the interleaved schedule runs microbatches in groups of the pipeline size: \
                     {microbatches} microbatches is not a multiple of {pp} stages; use {hint}"
                )));
            }
        }
        Ok(())
    }

    /// Rank `rank`'s plan for one step of `microbatches` over `pp` stages.
    pub fn plan(self, pp: usize, rank: usize, microbatches: usize) -> Result<Vec<Action>> {
        self.validate(pp, microbatches)?;
        if rank >= pp {
            return Err(Error::Config(format!(
                "rank {rank} is not a stage of a {pp}-stage pipeline"
            )));
        }
        let mut plan = Plan::default();
        let shape = Shape {
            pp,
            rank,
            chunks: self.chunks(),
        };
        match self {
            Schedule::GPipe => gpipe(&mut plan, shape, microbatches),
            Schedule::OneFOneB => one_f_one_b(&mut plan, shape, microbatches),
            Schedule::Interleaved { .. } => interleaved(&mut plan, shape, microbatches),
        }
        Ok(plan.actions)
    }

    /// Rank `rank`'s plan for a forward-only step (evaluation, inference): the training
    /// plan without its backwards and gradient transfers.
    pub fn forward_plan(self, pp: usize, rank: usize, microbatches: usize) -> Result<Vec<Action>> {
        let mut plan = Plan::default();
        for action in self.plan(pp, rank, microbatches)? {
            match action {
                Action::Forward { chunk, microbatch } => plan.forward(chunk, microbatch),
                Action::Backward { .. } => {}
                Action::Exchange(transfers) => {
                    let forward = transfers
                        .into_iter()
                        .map(|t| (t, matches!(t, SendForward | RecvForward)))
                        .collect::<Vec<_>>();
                    plan.exchange(&forward);
                }
            }
        }
        Ok(plan.actions)
    }
}

/// One thing a rank does in a step, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of `microbatch` through this rank's model chunk `chunk`.
    Forward {
        /// The model chunk (0 unless interleaved).
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// The backward of `microbatch` through chunk `chunk`.
    Backward {
        /// The model chunk.
        chunk: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// One batched exchange with the neighbouring ranks: the transfers, in order.
    Exchange(Vec<Transfer>),
}

/// One transfer of an exchange. What it carries follows from the plan: a send carries
/// the output (or input gradient) of this rank's latest forward (backward), a receive
/// the input (output gradient) of this rank's next forward (backward) that needs one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// An activation to the next rank.
    SendForward,
    /// An input gradient to the previous rank.
    SendBackward,
    /// An activation from the previous rank.
    RecvForward,
    /// An output gradient from the next rank.
    RecvBackward,
}

#[derive(Clone, Copy)]
struct Shape {
    pp: usize,
    rank: usize,
    chunks: usize,
}

impl Shape {
    fn first_rank(self) -> bool {
        self.rank == 0
    }
    fn last_rank(self) -> bool {
        self.rank + 1 == self.pp
    }
    /// Whether chunk `chunk` of this rank is the model's first (last) virtual stage.
    fn first_stage(self, chunk: usize) -> bool {
        self.first_rank() && chunk == 0
    }
    fn last_stage(self, chunk: usize) -> bool {
        self.last_rank() && chunk + 1 == self.chunks
    }
}

#[derive(Default)]
struct Plan {
    actions: Vec<Action>,
}

impl Plan {
    fn forward(&mut self, chunk: usize, microbatch: usize) {
        self.actions.push(Action::Forward { chunk, microbatch });
    }
    fn backward(&mut self, chunk: usize, microbatch: usize) {
        self.actions.push(Action::Backward { chunk, microbatch });
    }
    /// Appends the transfers whose flag is set, joining a directly preceding exchange.
    fn exchange(&mut self, transfers: &[(Transfer, bool)]) {
        let wanted: Vec<Transfer> = transfers.iter().filter(|t| t.1).map(|t| t.0).collect();
        if wanted.is_empty() {
            return;
        }
        match self.actions.last_mut() {
            Some(Action::Exchange(batch)) => batch.extend(wanted),
            _ => self.actions.push(Action::Exchange(wanted)),
        }
    }
}

use Transfer::{RecvBackward, RecvForward, SendBackward, SendForward};

fn gpipe(plan: &mut Plan, s: Shape, m: usize) {
    for mb in 0..m {
        plan.exchange(&[(RecvForward, !s.first_rank())]);
        plan.forward(0, mb);
        plan.exchange(&[(SendForward, !s.last_rank())]);
    }
    for mb in 0..m {
        plan.exchange(&[(RecvBackward, !s.last_rank())]);
        plan.backward(0, mb);
        plan.exchange(&[(SendBackward, !s.first_rank())]);
    }
}

fn one_f_one_b(plan: &mut Plan, s: Shape, m: usize) {
    let warmup = (s.pp - s.rank - 1).min(m);
    let steady = m - warmup;
    let (recv_f, send_f) = (!s.first_rank(), !s.last_rank());
    let (recv_b, send_b) = (!s.last_rank(), !s.first_rank());
    for mb in 0..warmup {
        plan.exchange(&[(RecvForward, recv_f)]);
        plan.forward(0, mb);
        plan.exchange(&[(SendForward, send_f)]);
    }
    if steady > 0 {
        plan.exchange(&[(RecvForward, recv_f)]);
    }
    for i in 0..steady {
        plan.forward(0, warmup + i);
        plan.exchange(&[(SendForward, send_f), (RecvBackward, recv_b)]);
        plan.backward(0, i);
        let last = i + 1 == steady;
        plan.exchange(&[(SendBackward, send_b), (RecvForward, recv_f && !last)]);
    }
    for mb in steady..m {
        plan.exchange(&[(RecvBackward, recv_b)]);
        plan.backward(0, mb);
        plan.exchange(&[(SendBackward, send_b)]);
    }
}

/// Megatron's interleaved schedule: virtual microbatch `k` of `m·v` runs chunk
/// [`chunk_of`] on microbatch [`microbatch_of`], forwards in order and backwards with the
/// chunks reversed; receives are issued one step ahead, as Megatron's are.
fn interleaved(plan: &mut Plan, s: Shape, m: usize) {
    let (pp, v) = (s.pp, s.chunks);
    let total = m * v;
    let chunk = |k: isize, forward: bool| {
        let c = (k.rem_euclid((pp * v) as isize) as usize) / pp;
        if forward {
            c
        } else {
            v - 1 - c
        }
    };
    let microbatch = |k: usize| k / (pp * v) * pp + k % pp;
    let all_warmup = m == pp;
    let warmup = if all_warmup {
        total
    } else {
        ((pp - s.rank - 1) * 2 + (v - 1) * pp).min(total)
    };
    let steady = total - warmup;

    plan.exchange(&[(RecvForward, !s.first_rank())]);
    for k in 0..warmup {
        let c = chunk(k as isize, true);
        plan.forward(c, microbatch(k));
        let next = chunk(k as isize + 1, true);
        let recv_prev = !(s.first_rank() && next == 0) && k + 1 != total;
        let send = !s.last_stage(c);
        let recv_next = k + 1 == warmup && !all_warmup && !s.last_rank();
        plan.exchange(&[
            (SendForward, send),
            (RecvForward, recv_prev),
            (RecvBackward, recv_next),
        ]);
    }
    for i in 0..steady {
        let fk = i + warmup;
        let (fc, bc) = (chunk(fk as isize, true), chunk(i as isize, false));
        plan.forward(fc, microbatch(fk));
        plan.backward(bc, microbatch(i));
        // The first rank receives nothing for a forward of the first chunk, the last
        // rank no gradient for a backward of its last chunk; nothing after the last step.
        let lag = pp as isize - 1;
        let recv_prev =
            !(s.first_rank() && chunk(fk as isize - lag, true) == v - 1) && i + 1 != steady;
        let recv_next = !(s.last_rank() && chunk(i as isize - lag, false) == 0);
        plan.exchange(&[
            (SendForward, !s.last_stage(fc)),
            (SendBackward, !s.first_stage(bc)),
            (RecvForward, recv_prev),
            (RecvBackward, recv_next),
        ]);
    }
    if all_warmup {
        plan.exchange(&[(RecvBackward, !s.last_rank())]);
    }
    for k in steady..total {
        let c = chunk(k as isize, false);
        plan.backward(c, microbatch(k));
        let next = chunk(k as isize + 1, false);
        let recv_next = !(s.last_rank() && next == v - 1) && k + 1 != total;
        plan.exchange(&[(SendBackward, !s.first_stage(c)), (RecvBackward, recv_next)]);
    }
}

/// The most microbatches whose activations a rank holds at once under `plan`: forwards
/// done whose backward has not run yet.
pub fn peak_in_flight(plan: &[Action]) -> usize {
    let mut live = 0usize;
    let mut peak = 0;
    for action in plan {
        match action {
            Action::Forward { .. } => {
                live += 1;
                peak = peak.max(live);
            }
            Action::Backward { .. } => live = live.saturating_sub(1),
            Action::Exchange(_) => {}
        }
    }
    peak
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
