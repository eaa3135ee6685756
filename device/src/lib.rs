//! The ground floor of ferrotron: everything about devices, in one place for the crates
//! above it (comm-core's communicators, tape's tensors).
//!
//! - [`Device`]: the CPU, a CUDA device, or the emulated device (the CUDA code path run on
//!   the host, so device code is tested on every machine);
//! - [`Stream`] and [`Event`] as values: work queued on a stream runs in order; an event
//!   marks a point another stream can wait for on the device, or the host can wait for;
//! - [`DeviceMemory`]: allocations made and freed in a stream's order (how tensors hold
//!   their memory); copies between host and device and within a device;
//! - [`PinnedMemory`]: page-locked host memory whose copies to and from a device are
//!   queued without the host waiting, and waited for before the host touches it;
//! - [`Module`] and [`Function`]: kernels compiled by NVRTC (CUDA) or built for the host
//!   (emulated), launched on a stream over independent indices, or as a [`Grid`] of
//!   cooperating blocks ([`blocks`]: barriers, warp shuffles and shared memory, run by the
//!   emulated device with a GPU's semantics and checked for races), whose warps also
//!   run [`tensor_cores`]' matrix instructions with the PTX fragment layouts;
//! - counters of host↔device [`transfers`] and of [`host_waits`], per thread and device,
//!   and per-kernel [`profile`]s (launches, bytes, flops; time on CUDA);
//! - with the `cuda` feature, [`cuda`]: finding the CUDA libraries at run time (the
//!   workspace builds and runs without them), one context per device per process, and
//!   NVRTC's cache.
//!
//! ```
//! use ferrotron_device::{host_waits, Device, Stream};
//!
//! // Two streams of one device: the second waits, on the device, for the first's copy.
//! let (first, second) = (Stream::new(Device::Emulated)?, Stream::new(Device::Emulated)?);
//! let memory = first.alloc(4)?;
//! // SAFETY: the allocation holds 4 bytes.
//! unsafe { first.copy(memory.ptr(), memory.ptr(), 4)? };
//! let done = first.record()?;
//! second.wait(&done)?; // the host does not wait here...
//! let waits = host_waits(Device::Emulated);
//! second.synchronize()?; // ...but here it does, and it is counted
//! assert_eq!(host_waits(Device::Emulated), waits + 1);
//! # Ok::<(), ferrotron_device::Error>(())
//! ```
//!
//! # Cargo features
//! None is on by default.
//! * `cuda`: CUDA devices through cudarc (contexts, NVRTC kernels, cuBLAS); the libraries
//!   are loaded at run time, so it builds without a CUDA toolkit.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod blocks;
mod checker;
mod counters;
#[cfg(feature = "cuda")]
pub mod cuda;
mod emulated;
mod error;
pub mod kernels;
mod memory;
mod module;
mod pinned;
mod place;
pub mod profile;
mod stream;
pub mod tensor_cores;
pub mod timeline;

pub use blocks::{BlockKernel, Grid, Thread};
pub use checker::{host_access, Access};
pub use counters::{
    allocating_bookkeeping, device_memory, host_waits, reset_device_peak, transfers, DeviceHeld,
    Transfers,
};
pub use error::{Error, Result};
pub use memory::DeviceMemory;
pub use module::{Arg, Function, HostKernel, KernelArg, Module};
pub use pinned::PinnedMemory;
pub use place::{Device, NotADevice};
pub use stream::{
    finish_own_streams, own_stream, own_streams, use_own_streams, Event, HandOff, Stream,
};
pub use timeline::Role;
