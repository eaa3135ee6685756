//! The emulated device's modelled timeline: when each call a thread queues would run on
//! a GPU, from what it moves and computes rather than from the host's clock, so that how
//! much communication runs beside compute is a figure that is the same on every machine.
//!
//! Each emulated stream keeps the modelled time at which its queued work ends. A call
//! starts when the stream is free, when the events it waited for have passed, and not
//! before the host that queues it could have (the host's modelled time, which only host
//! waits move forward: a GPU's host runs ahead). It lasts what [`Model`] says for its
//! cost: a kernel the larger of its bytes over memory bandwidth and its flops over the
//! math rate, a collective its ring traffic over the link, each with a floor for launch
//! and latency. The model is a model: ranks are not made to wait for each other (a
//! collective starts when this rank's stream is ready), and the rates are one GPU's
//! (an H200's achievable figures, [`Model::H200`]).
//!
//! ```
//! use ferrotron_device::{timeline, Device, Role, Stream};
//!
//! let compute = Stream::new(Device::Emulated)?;
//! let comm = Stream::with_role(Device::Emulated, Role::Communication)?;
//! timeline::start();
//! let memory = compute.alloc(1 << 20)?;
//! // SAFETY: both halves lie in the allocation.
//! unsafe { compute.copy(memory.ptr(), memory.ptr() + (1 << 19), 1 << 19)? };
//! comm.wait(&compute.record()?)?;
//! timeline::charge_transfer(1 << 19);
//! // SAFETY: as above.
//! unsafe { comm.copy(memory.ptr() + (1 << 19), memory.ptr(), 1 << 19)? };
//! let line = timeline::finish();
//! // The communication stream's copy waited for the compute stream's: nothing overlaps.
//! assert_eq!(line.hidden_fraction(), Some(0.0));
//! # Ok::<(), ferrotron_device::Error>(())
//! ```

use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// What a stream is for: compute (kernels, products) or communication (collectives and
/// transfers queued beside compute).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Kernels and products.
    Compute,
    /// Collectives and point-to-point transfers.
    Communication,
}

impl Role {
    /// Its name, which also labels a stream made without one.
    pub fn name(self) -> &'static str {
        match self {
            Role::Compute => "compute",
            Role::Communication => "communication",
        }
    }
}

/// The rates a call's modelled duration is computed from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    /// Device memory bandwidth a kernel reaches, bytes per second.
    pub memory_bandwidth: f64,
    /// Floating-point operations per second a product reaches.
    pub flops: f64,
    /// Bandwidth of a collective's link, bytes per second (a ring's bus bandwidth).
    pub link_bandwidth: f64,
    /// The shortest kernel, seconds.
    pub launch: f64,
    /// A collective's fixed cost, seconds.
    pub link_latency: f64,
}

impl Model {
    /// An H200's achievable rates: 4 TB/s of HBM3e, 600 TFLOP/s of 16-bit products,
    /// 350 GB/s of NVLink bus bandwidth, 3 µs kernels and 10 µs collectives at least.
    pub const H200: Model = Model {
        memory_bandwidth: 4.0e12,
        flops: 600e12,
        link_bandwidth: 350e9,
        launch: 3e-6,
        link_latency: 10e-6,
    };

    /// The duration in seconds of a kernel that moves `bytes` and does `flops`.
    pub fn kernel(&self, bytes: u64, flops: u64) -> f64 {
        let memory = bytes as f64 / self.memory_bandwidth;
        let math = flops as f64 / self.flops;
        memory.max(math).max(self.launch)
    }

    /// A transfer of `bytes` over the link, in seconds.
    pub fn transfer(&self, bytes: u64) -> f64 {
        self.link_latency + bytes as f64 / self.link_bandwidth
    }
}

/// One call on the modelled timeline, in seconds from the recording's start.
#[derive(Clone, Debug, PartialEq)]
pub struct Interval {
    /// The stream it ran on (an id unique in the process).
    pub stream: u64,
    /// What the stream is for.
    pub role: Role,
    /// The stream's label: its role's name, or the group a communication stream serves.
    pub label: Arc<str>,
    /// The call.
    pub name: &'static str,
    /// When it starts.
    pub start: f64,
    /// When it ends.
    pub end: f64,
}

/// The calls a thread queued while recording, on every stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// In the order queued.
    pub intervals: Vec<Interval>,
}

impl Timeline {
    /// The time streams of `role` are busy (their intervals' union), in seconds.
    pub fn busy(&self, role: Role) -> f64 {
        length(&union(self.of(role)))
    }

    /// The share of communication-stream busy time during which a compute stream is
    /// busy too: how much communication is hidden behind compute. `None` when there was
    /// no communication.
    pub fn hidden_fraction(&self) -> Option<f64> {
        let comm = union(self.of(Role::Communication));
        let total = length(&comm);
        if total <= 0.0 {
            return None;
        }
        let compute = union(self.of(Role::Compute));
        Some(overlap(&comm, &compute) / total)
    }

    /// [`hidden_fraction`](Self::hidden_fraction) of each label's communication streams
    /// (one group's traffic: `tp`, `dp`), in label order.
    pub fn hidden_by_label(&self) -> Vec<(Arc<str>, f64)> {
        let compute = union(self.of(Role::Compute));
        let mut labels: Vec<&Arc<str>> = (self.intervals.iter())
            .filter(|i| i.role == Role::Communication)
            .map(|i| &i.label)
            .collect();
        labels.sort();
        labels.dedup();
        labels
            .into_iter()
            .filter_map(|label| {
                let comm =
                    union(self.spans(|i| i.role == Role::Communication && i.label == *label));
                let total = length(&comm);
                (total > 0.0).then(|| (label.clone(), overlap(&comm, &compute) / total))
            })
            .collect()
    }

    /// The time from its first call's start to its last call's end, in seconds: how long
    /// the recorded work (a step) takes on the modelled device. `None` when empty.
    pub fn makespan(&self) -> Option<f64> {
        let start = self.intervals.iter().map(|i| i.start).reduce(f64::min)?;
        let end = self.intervals.iter().map(|i| i.end).reduce(f64::max)?;
        Some(end - start)
    }

    /// Adds `other`'s intervals (another span of the same thread) after this one's.
    pub fn extend(&mut self, other: Timeline) {
        self.intervals.extend(other.intervals);
    }

    fn of(&self, role: Role) -> Vec<(f64, f64)> {
        self.spans(|i| i.role == role)
    }

    fn spans(&self, keep: impl Fn(&Interval) -> bool) -> Vec<(f64, f64)> {
        (self.intervals.iter())
            .filter(|i| keep(i) && i.end > i.start)
            .map(|i| (i.start, i.end))
            .collect()
    }
}

/// Sorted, disjoint intervals covering the same time as `spans`.
fn union(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

fn length(spans: &[(f64, f64)]) -> f64 {
    spans.iter().map(|(s, e)| e - s).sum()
}

/// The time two sorted, disjoint interval lists share.
fn overlap(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut shared) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let (start, end) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if end > start {
            shared += end - start;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    shared
}

/// What a thread records.
struct Recording {
    /// Every call, or (false) each stream's busy periods: a call that starts when the
    /// previous one on its stream ends extends it, so a step's recording stays small
    /// (the demo's memory figures count it).
    calls: bool,
    intervals: Vec<Interval>,
}

thread_local! {
    /// The intervals recorded since `start`, if recording.
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
    /// The host's modelled time: when it could queue its next call.
    static HOST_NOW: Cell<f64> = const { Cell::new(0.0) };
    /// The duration of the next call this thread queues, when its caller knows its cost.
    static PENDING: Cell<Option<f64>> = const { Cell::new(None) };
}

/// Starts recording when this thread's emulated streams are busy: each stream's calls
/// that follow one another without a gap are one interval, named after the first (a
/// recording under way is dropped). Enough for [`Timeline::hidden_fraction`].
pub fn start() {
    record(false);
}

/// Starts recording every call this thread queues on emulated streams, one interval
/// each (for a trace).
pub fn start_calls() {
    record(true);
}

fn record(calls: bool) {
    RECORDING.set(Some(Recording {
        calls,
        intervals: Vec::new(),
    }));
}

/// Ends this thread's recording and returns it (empty when nothing was recorded).
pub fn finish() -> Timeline {
    Timeline {
        intervals: RECORDING.take().map(|r| r.intervals).unwrap_or_default(),
    }
}

/// The next call this thread queues is a kernel that moves `bytes` and does `flops`
/// (`profile::measure` says so of each launch it measures, from its cost).
pub fn charge_kernel(bytes: u64, flops: u64) {
    PENDING.set(Some(Model::H200.kernel(bytes, flops)));
}

/// The next call this thread queues moves `bytes` over the link (a collective's ring
/// traffic, or a point-to-point message).
pub fn charge_transfer(bytes: u64) {
    PENDING.set(Some(Model::H200.transfer(bytes)));
}

/// Forgets a charge that no call took (the launch failed before it was queued).
pub fn clear_charge() {
    PENDING.set(None);
}

/// A call named `op` moving `bytes` is queued on a stream (its id, role and label) whose
/// work ends at `*ready`: moves `*ready` to the call's end and records it.
pub(crate) fn queued(
    (stream, role, label): (u64, Role, &Arc<str>),
    ready: &mut f64,
    op: &'static str,
    bytes: u64,
) {
    let duration = PENDING
        .take()
        .unwrap_or_else(|| Model::H200.kernel(bytes, 0));
    let start = ready.max(HOST_NOW.get());
    *ready = start + duration;
    RECORDING.with_borrow_mut(|recording| {
        let Some(Recording { calls, intervals }) = recording else {
            return;
        };
        let last = intervals.iter_mut().rev().find(|i| i.stream == stream);
        match last {
            Some(last) if !*calls && last.end == start => last.end = *ready,
            _ => intervals.push(Interval {
                stream,
                role,
                label: label.clone(),
                name: op,
                start,
                end: *ready,
            }),
        }
    });
}

/// The host has waited until modelled time `at`.
pub(crate) fn host_waited(at: f64) {
    HOST_NOW.set(HOST_NOW.get().max(at));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, Stream};

    fn interval(role: Role, start: f64, end: f64) -> Interval {
        Interval {
            stream: 0,
            role,
            label: role.name().into(),
            name: "call",
            start,
            end,
        }
    }

    #[test]
    fn the_hidden_share_is_the_communication_time_compute_covers() {
        let line = Timeline {
            intervals: vec![
                interval(Role::Compute, 0.0, 2.0),
                interval(Role::Compute, 1.0, 3.0),
                interval(Role::Compute, 6.0, 7.0),
                interval(Role::Communication, 2.0, 4.0),
                interval(Role::Communication, 5.0, 7.0),
            ],
        };
        assert_eq!(line.busy(Role::Compute), 4.0);
        assert_eq!(line.busy(Role::Communication), 4.0);
        // [2, 3] and [6, 7] of the four communication units.
        assert_eq!(line.hidden_fraction(), Some(0.5));
        assert_eq!(line.makespan(), Some(7.0));
        assert_eq!(Timeline::default().hidden_fraction(), None);
        assert_eq!(Timeline::default().makespan(), None);
    }

    #[test]
    fn each_groups_traffic_has_its_own_hidden_share() {
        let labelled = |label: &str, start, end| Interval {
            label: label.into(),
            ..interval(Role::Communication, start, end)
        };
        let line = Timeline {
            intervals: vec![
                interval(Role::Compute, 0.0, 4.0),
                labelled("tp", 4.0, 5.0),
                labelled("dp", 3.0, 5.0),
                labelled("dp", 1.0, 2.0),
            ],
        };
        let shares: Vec<(String, f64)> = (line.hidden_by_label().into_iter())
            .map(|(label, share)| (label.to_string(), share))
            .collect();
        // dp: [1, 2] and [3, 4] of its three units; tp: none of its one.
        assert_eq!(shares, [("dp".into(), 2.0 / 3.0), ("tp".into(), 0.0)]);
        // In all: the same two of the three units either group's traffic covers.
        assert_eq!(line.hidden_fraction(), Some(2.0 / 3.0));
    }

    #[test]
    fn calls_last_their_cost_and_start_after_what_the_host_waited_for() -> crate::Result<()> {
        let (compute, comm) = (
            Stream::new(Device::Emulated)?,
            Stream::with_role(Device::Emulated, Role::Communication)?,
        );
        let (memory, other) = (compute.alloc(1 << 20)?, comm.alloc(64)?);
        start_calls();
        charge_kernel(40_000_000, 0);
        // SAFETY: both halves lie in the allocation.
        unsafe { compute.copy(memory.ptr(), memory.ptr() + (1 << 19), 1 << 19)? };
        charge_transfer(35_000_000);
        // SAFETY: both ranges lie in the comm stream's own allocation.
        unsafe { comm.copy(other.ptr(), other.ptr() + 32, 8)? };
        compute.synchronize()?;
        charge_transfer(0);
        // SAFETY: as above.
        unsafe { comm.copy(other.ptr() + 8, other.ptr() + 40, 8)? };
        let line = finish();
        let [copy, sent, after] = &line.intervals[..] else {
            panic!("three calls: {line:?}");
        };
        let micros = |i: &Interval| ((i.end - i.start) * 1e6).round();
        // 40 MB at 4 TB/s; 35 MB at 350 GB/s after 10 µs; the link's floor.
        assert_eq!(
            (micros(copy), micros(sent), micros(after)),
            (10.0, 110.0, 10.0)
        );
        assert_eq!(copy.start, sent.start, "two streams run side by side");
        assert!(
            after.start >= copy.end,
            "a call queued after a host wait waits too"
        );
        // Recording busy periods, two back-to-back calls are one.
        start();
        charge_transfer(35_000_000);
        // SAFETY: as above.
        unsafe { comm.copy(other.ptr(), other.ptr() + 32, 8)? };
        // SAFETY: as above.
        unsafe { comm.copy(other.ptr() + 8, other.ptr() + 40, 8)? };
        assert_eq!(finish().intervals.len(), 1);
        Ok(())
    }
}
