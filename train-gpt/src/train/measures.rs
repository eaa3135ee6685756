//! What the steps after the first cost, measured as they run: host↔device transfers,
//! host waits, the kernel profile, and on the emulated device the modelled timeline.

use crate::report::StepsProfile;
use ferrotron_tape::{timeline, Device, Transfers};
use std::time::Instant;

use super::*;

/// What a step after the first costs in host↔device traffic, on average.
pub(super) struct Steady {
    pub(super) transfers: Transfers,
    pub(super) host_waits: f64,
    pub(super) profile: Option<StepsProfile>,
    /// What share of the communication the compute hid (modelled, emulated device).
    pub(super) hidden: Option<Hidden>,
    /// A step's mean modelled time, seconds (emulated device).
    pub(super) modelled_step: Option<f64>,
}

/// The recorded steps' figures so far.
pub(super) struct Measures {
    transfers: Vec<Transfers>,
    waits: Vec<u64>,
    timeline: timeline::Timeline,
    makespans: Vec<f64>,
    profile: Option<StepsProfile>,
}

/// The counters when a recorded step started.
pub(super) struct Started {
    transfers: Transfers,
    waits: u64,
    at: Instant,
}

impl Measures {
    pub(super) fn new(config: &TrainConfig) -> Measures {
        Measures {
            transfers: Vec::new(),
            waits: Vec::new(),
            timeline: timeline::Timeline::default(),
            makespans: Vec::new(),
            profile: (config.profile && config.device != Device::Cpu).then(StepsProfile::default),
        }
    }

    /// Starts recording a step, if `steady` (not the first step, which also uploads the
    /// model's first use of each constant, unless it is the only one).
    pub(super) fn begin(&mut self, config: &TrainConfig, steady: bool) -> Option<Started> {
        if !steady {
            return None;
        }
        let device = config.device;
        let (transfers, waits) = (
            ferrotron_tape::transfers(device),
            ferrotron_tape::host_waits(device),
        );
        if self.profile.is_some() {
            ferrotron_tape::profile::start(device);
        }
        match config.trace {
            true => timeline::start_calls(),
            false => timeline::start(),
        }
        Some(Started {
            transfers,
            waits,
            at: Instant::now(),
        })
    }

    /// Ends the step `begin` started: its streams (kept in `history` when tracing), its
    /// transfers, host waits and profile.
    pub(super) fn end(
        &mut self,
        config: &TrainConfig,
        started: Started,
        history: &mut History,
    ) -> anyhow::Result<()> {
        let wall = started.at.elapsed();
        let streams = timeline::finish();
        if config.trace {
            history.streams = streams.clone();
        }
        self.makespans.extend(streams.makespan());
        self.timeline.extend(streams);
        // Read before the profile's own wait for its last timing event.
        let device = config.device;
        self.transfers
            .push(ferrotron_tape::transfers(device) - started.transfers);
        self.waits
            .push(ferrotron_tape::host_waits(device) - started.waits);
        if let Some(profile) = self.profile.as_mut() {
            profile.add(&ferrotron_tape::profile::finish()?, wall);
        }
        Ok(())
    }

    /// The means over the recorded steps.
    pub(super) fn steady(self) -> Steady {
        let steps = self.waits.len().max(1) as f64;
        Steady {
            transfers: mean(&self.transfers),
            host_waits: self.waits.iter().sum::<u64>() as f64 / steps,
            profile: self.profile,
            hidden: Hidden::of(&self.timeline),
            modelled_step: (!self.makespans.is_empty())
                .then(|| self.makespans.iter().sum::<f64>() / self.makespans.len() as f64),
        }
    }
}

/// The mean of per-step transfer counts (none: zero).
fn mean(steps: &[Transfers]) -> Transfers {
    let n = steps.len().max(1) as u64;
    let total = steps.iter().fold(Transfers::default(), |sum, &t| sum + t);
    Transfers {
        to_device_bytes: total.to_device_bytes / n,
        to_device_copies: total.to_device_copies / n,
        to_host_bytes: total.to_host_bytes / n,
        to_host_copies: total.to_host_copies / n,
    }
}
