//! Per-kernel profiles: how many times each kernel ran, the bytes it read and wrote, the
//! floating-point operations it did, and on CUDA the time it took, for the device work a
//! thread queues while it records.
//!
//! The crates that launch kernels say what each launch moves ([`Cost`]: the bytes of
//! the arrays it reads and writes, each counted once, and for products their flops) and
//! run it through [`measure`]; on CUDA a pair of timing events brackets each launch while
//! a profile is recorded, and [`finish`] reads them (it waits for the last one). Nothing
//! is recorded, and nothing added to a launch, on a thread that is not recording. The
//! emulated device has no time; its launch and byte counts are the same as a GPU's.
//!
//! ```
//! use ferrotron_device::{profile, Device, Stream};
//!
//! let stream = Stream::new(Device::Emulated)?;
//! profile::start(Device::Emulated);
//! let cost = profile::Cost { read: 64, written: 64, flops: 0 };
//! profile::measure(&stream, "scale", "f32", cost, || Ok(()))?;
//! let profile = profile::finish()?;
//! assert_eq!(profile.kernels[0].name, "scale_f32");
//! assert_eq!((profile.kernels[0].launches, profile.kernels[0].read), (1, 64));
//! # Ok::<(), ferrotron_device::Error>(())
//! ```

use std::cell::RefCell;
use std::time::Duration;

use crate::error::Result;
use crate::stream::Stream;
use crate::Device;

/// What one launch moves and computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Bytes of device memory the launch reads (each element once).
    pub read: u64,
    /// Bytes it writes.
    pub written: u64,
    /// Floating-point operations (a product's 2·m·n·k; 0 for memory-bound kernels).
    pub flops: u64,
}

/// One kernel's line of a [`Profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct KernelStats {
    /// The kernel and its build (`softmax_rows_f32`, `gemm_bf16`).
    pub name: String,
    /// Launches recorded.
    pub launches: u64,
    /// Bytes read over all launches.
    pub read: u64,
    /// Bytes written over all launches.
    pub written: u64,
    /// Floating-point operations over all launches.
    pub flops: u64,
    /// Time on the device over all launches (CUDA only).
    pub time: Option<Duration>,
}

impl KernelStats {
    /// Bytes read and written.
    pub fn bytes(&self) -> u64 {
        self.read + self.written
    }
}

/// The kernels one thread launched while recording, the most expensive first (by time
/// where measured, else by bytes moved).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// One line per kernel and build.
    pub kernels: Vec<KernelStats>,
}

impl Profile {
    /// Adds `other`'s lines to this profile's (a kernel in both sums its figures), and
    /// sorts them again: the profile of several spans.
    pub fn add(&mut self, other: &Profile) {
        for kernel in &other.kernels {
            match self.kernels.iter_mut().find(|k| k.name == kernel.name) {
                Some(line) => {
                    line.launches += kernel.launches;
                    line.read += kernel.read;
                    line.written += kernel.written;
                    line.flops += kernel.flops;
                    line.time = match (line.time, kernel.time) {
                        (None, None) => None,
                        (a, b) => Some(a.unwrap_or_default() + b.unwrap_or_default()),
                    };
                }
                None => self.kernels.push(kernel.clone()),
            }
        }
        sort(&mut self.kernels);
    }

    /// All kernels' launches, bytes and flops together (and time, where measured).
    pub fn total(&self) -> KernelStats {
        let mut total = KernelStats {
            name: "total".into(),
            launches: 0,
            read: 0,
            written: 0,
            flops: 0,
            time: None,
        };
        for kernel in &self.kernels {
            total.launches += kernel.launches;
            total.read += kernel.read;
            total.written += kernel.written;
            total.flops += kernel.flops;
            if let Some(time) = kernel.time {
                total.time = Some(total.time.unwrap_or_default() + time);
            }
        }
        total
    }
}

/// A profile being recorded on this thread.
struct Recording {
    device: Device,
    /// Each line's kernel and build, in `kernels`' order.
    keys: Vec<(&'static str, &'static str)>,
    kernels: Vec<KernelStats>,
    /// Each timed launch's line and its bracketing events, read by `finish`.
    #[cfg(feature = "cuda")]
    timed: Vec<(usize, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Starts recording this thread's launches on `device` (a recording already under way
/// is dropped).
pub fn start(device: Device) {
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            device,
            keys: Vec::new(),
            kernels: Vec::new(),
            #[cfg(feature = "cuda")]
            timed: Vec::new(),
        })
    });
}

/// Whether this thread is recording launches on `device`.
pub fn recording(device: Device) -> bool {
    RECORDING.with(|r| r.borrow().as_ref().is_some_and(|r| r.device == device))
}

/// Runs `launch` (which queues one kernel, `kernel`'s build `build`, on `stream`) and, if
/// this thread records a profile of the stream's device, counts it with `cost` and, on
/// CUDA, times it between two events: [`begin`] and [`Span::end`] around it.
pub fn measure<R>(
    stream: &Stream,
    kernel: &'static str,
    build: &'static str,
    cost: Cost,
    launch: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let span = begin(stream)?;
    crate::timeline::charge_kernel(cost.read + cost.written, cost.flops);
    // A launch that queued nothing (no items, or an error) leaves no charge behind for
    // the next call to take.
    let result = launch();
    crate::timeline::clear_charge();
    let result = result?;
    if let Some(span) = span {
        span.end(stream, kernel, build, cost)?;
    }
    Ok(result)
}

/// A launch being measured: opened by [`begin`] before it is queued, closed by
/// [`end`](Span::end) after.
pub struct Span {
    #[cfg(feature = "cuda")]
    start: Option<cudarc::driver::CudaEvent>,
}

/// Opens a [`Span`] for a launch about to be queued on `stream`, if this thread records a
/// profile of its device (on CUDA, records the span's starting event).
pub fn begin(stream: &Stream) -> Result<Option<Span>> {
    if !recording(stream.device()) {
        return Ok(None);
    }
    Ok(Some(Span {
        #[cfg(feature = "cuda")]
        start: timing_event(stream)?,
    }))
}

impl Span {
    /// Counts the launch just queued on `stream` as one of `kernel`'s build `build` with
    /// `cost` (on CUDA, records the span's ending event for [`finish`] to read).
    pub fn end(
        self,
        stream: &Stream,
        kernel: &'static str,
        build: &'static str,
        cost: Cost,
    ) -> Result<()> {
        let line = RECORDING.with(|r| {
            let mut r = r.borrow_mut();
            let Recording { keys, kernels, .. } = r.as_mut()?;
            let line = match keys.iter().position(|k| *k == (kernel, build)) {
                Some(line) => line,
                None => {
                    keys.push((kernel, build));
                    kernels.push(KernelStats {
                        name: format!("{kernel}_{build}"),
                        launches: 0,
                        read: 0,
                        written: 0,
                        flops: 0,
                        time: None,
                    });
                    kernels.len() - 1
                }
            };
            let stats = &mut kernels[line];
            stats.launches += 1;
            stats.read += cost.read;
            stats.written += cost.written;
            stats.flops += cost.flops;
            Some(line)
        });
        #[cfg(feature = "cuda")]
        if let (Some(line), Some(start)) = (line, self.start) {
            if let Some(end) = timing_event(stream)? {
                RECORDING.with(|r| {
                    if let Some(r) = r.borrow_mut().as_mut() {
                        r.timed.push((line, start, end));
                    }
                });
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (line, stream);
        Ok(())
    }
}

/// An event that records time, on a CUDA stream (`None` elsewhere).
#[cfg(feature = "cuda")]
fn timing_event(stream: &Stream) -> Result<Option<cudarc::driver::CudaEvent>> {
    let Some(cuda) = stream.cuda() else {
        return Ok(None);
    };
    stream.bind()?;
    let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    cuda.record_event(Some(flags))
        .map(Some)
        .map_err(crate::cuda::driver_error("cuEventRecord"))
}

/// Ends this thread's recording and returns its profile; on CUDA it first waits for the
/// last timed launch (one host wait, counted). Empty when nothing was recorded.
pub fn finish() -> Result<Profile> {
    let Some(recording) = RECORDING.with(|r| r.borrow_mut().take()) else {
        return Ok(Profile::default());
    };
    #[allow(unused_mut)]
    let mut kernels = recording.kernels;
    #[cfg(feature = "cuda")]
    if let Some((_, _, last)) = recording.timed.last() {
        crate::counters::count_host_wait(recording.device);
        last.synchronize()
            .map_err(crate::cuda::driver_error("cuEventSynchronize"))?;
        for (line, start, end) in &recording.timed {
            let ms = start
                .elapsed_ms(end)
                .map_err(crate::cuda::driver_error("cuEventElapsedTime"))?;
            let time = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            let stats = &mut kernels[*line];
            stats.time = Some(stats.time.unwrap_or_default() + time);
        }
    }
    sort(&mut kernels);
    Ok(Profile { kernels })
}

/// The most expensive first: by time where measured, else by bytes moved.
fn sort(kernels: &mut [KernelStats]) {
    kernels.sort_by(|a, b| {
        (b.time.cmp(&a.time))
            .then(b.bytes().cmp(&a.bytes()))
            .then(a.name.cmp(&b.name))
    });
}
