//! Counts of copies between host and device memory, so that users and tests can see
//! what a training step moves (a device-resident step moves only its batch and loss).
//!
//! Counted per thread, on the thread that asks for the copy: ranks run as threads by
//! the local backend, or as processes, each see their own. Counting is the only state
//! here; nothing reads it but [`transfers`].

use std::cell::RefCell;
use std::collections::HashMap;

use crate::Device;

/// Host↔device copies one thread has asked for on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Bytes copied from host memory to the device.
    pub to_device_bytes: u64,
    /// Copies from host memory to the device.
    pub to_device_copies: u64,
    /// Bytes copied from the device to host memory.
    pub to_host_bytes: u64,
    /// Copies from the device to host memory.
    pub to_host_copies: u64,
}

impl std::ops::Add for Transfers {
    type Output = Transfers;

    /// Both readings' copies together (two measured spans).
    fn add(self, other: Transfers) -> Transfers {
        Transfers {
            to_device_bytes: self.to_device_bytes + other.to_device_bytes,
            to_device_copies: self.to_device_copies + other.to_device_copies,
            to_host_bytes: self.to_host_bytes + other.to_host_bytes,
            to_host_copies: self.to_host_copies + other.to_host_copies,
        }
    }
}

impl std::ops::Sub for Transfers {
    type Output = Transfers;

    /// What was copied between two readings (`later - earlier`).
    fn sub(self, earlier: Transfers) -> Transfers {
        Transfers {
            to_device_bytes: self.to_device_bytes - earlier.to_device_bytes,
            to_device_copies: self.to_device_copies - earlier.to_device_copies,
            to_host_bytes: self.to_host_bytes - earlier.to_host_bytes,
            to_host_copies: self.to_host_copies - earlier.to_host_copies,
        }
    }
}

thread_local! {
    static COUNTS: RefCell<HashMap<Device, Transfers>> = RefCell::new(HashMap::new());
}

/// The copies between host memory and `device` this thread has asked for so far
/// (`Tensor::to_device`, `to_vec`, `item`, ops that stage through the host). Subtract
/// two readings to measure a step.
///
/// ```
/// use tape::{transfers, Device, Tensor};
///
/// let before = transfers(Device::Emulated);
/// let x = Tensor::<f32>::ones(&[4]).to_device(Device::Emulated)?;
/// let moved = transfers(Device::Emulated) - before;
/// assert_eq!((moved.to_device_copies, moved.to_device_bytes), (1, 16));
/// # Ok::<(), tape::Error>(())
/// ```
pub fn transfers(device: Device) -> Transfers {
    COUNTS.with(|counts| counts.borrow().get(&device).copied().unwrap_or_default())
}

/// Counts a copy of `bytes` bytes to (`to_device`) or from `device`.
pub(crate) fn count(device: Device, bytes: usize, to_device: bool) {
    COUNTS.with(|counts| {
        let mut counts = counts.borrow_mut();
        let entry = counts.entry(device).or_default();
        if to_device {
            entry.to_device_bytes += bytes as u64;
            entry.to_device_copies += 1;
        } else {
            entry.to_host_bytes += bytes as u64;
            entry.to_host_copies += 1;
        }
    });
}
