//! [`Device::Emulated`]: the device path run on the host. Kernels are the C builds of
//! `kernels/*.cu` (see `csrc/emulator.c`), memory is host memory, and GEMM is a
//! reference implementation of cuBLAS's column-major contract, so the row-major wrapper
//! in `ops` is checked exactly as cuBLAS will read it.

use half::{bf16, f16};

use super::HalfFormat;
use super::{Backend, Gemm, GemmFormat, HostBuilds, Kernel, Precision};
use crate::{Device, Error, Result};

/// The emulated device: a stream (whose worker runs the calls in order while the host
/// goes on) and the host builds of the kernels.
pub(crate) struct Emulator {
    stream: ferrotron_device::Stream,
}

impl Emulator {
    /// The emulated device's work on `stream`.
    pub(crate) fn new(stream: ferrotron_device::Stream) -> Emulator {
        Emulator { stream }
    }
}

impl Backend for Emulator {
    fn stream(&self) -> &ferrotron_device::Stream {
        &self.stream
    }

    fn function(
        &self,
        kernel: &Kernel,
        precision: Precision,
    ) -> Result<ferrotron_device::Function> {
        Ok(match &kernel.host {
            HostBuilds::Indices(builds) => {
                ferrotron_device::Function::host(kernel.name, builds[precision.index()])
            }
            HostBuilds::Blocks(builds) => {
                ferrotron_device::Function::host_blocks(kernel.name, builds[precision.index()])
            }
            HostBuilds::BlocksF32(build) if precision == Precision::F32 => {
                ferrotron_device::Function::host_blocks(kernel.name, *build)
            }
            HostBuilds::BlocksF32(_) => {
                return Err(crate::Error::invalid(
                    kernel.name,
                    "this kernel is built in f32 only: launch it from f32 tensors",
                ))
            }
        })
    }

    fn tensor_cores(&self) -> bool {
        true
    }

    unsafe fn gemm(&self, gemm: &Gemm) -> Result<()> {
        // Queued in the stream's order like a kernel: A and B read, C written.
        let (read, write) = (
            |p| ferrotron_device::Access::rest(p, false),
            |p| ferrotron_device::Access::rest(p, true),
        );
        let accesses = [read(gemm.a), read(gemm.b), write(gemm.c)];
        let gemm = *gemm;
        // SAFETY (of the closure's call): the caller guarantees the matrices' extents
        // until the work queued now has run.
        let work = move || unsafe {
            match gemm.format {
                GemmFormat::F32 => reference_gemm::<f32, f32>(&gemm),
                GemmFormat::F64 => reference_gemm::<f64, f64>(&gemm),
                GemmFormat::Bf16 => reference_gemm::<bf16, bf16>(&gemm),
                GemmFormat::F16 => reference_gemm::<f16, f16>(&gemm),
                GemmFormat::Bf16IntoF32 => reference_gemm::<bf16, f32>(&gemm),
                GemmFormat::F16IntoF32 => reference_gemm::<f16, f32>(&gemm),
            }
        };
        (self.stream.queue_host("gemm", &accesses, work))
            .map_err(Error::on_device("gemm", Device::Emulated))
    }
}

/// An element a GEMM reads and writes, and the type it accumulates in.
trait Stored: Copy {
    type Sum: crate::Element;
    fn widen(self) -> Self::Sum;
    fn narrow(sum: Self::Sum) -> Self;
}

macro_rules! accumulates_in_itself {
    ($($t:ty),*) => {$(
        impl Stored for $t {
            type Sum = $t;
            fn widen(self) -> $t {
                self
            }
            fn narrow(sum: $t) -> $t {
                sum
            }
        }
    )*};
}
accumulates_in_itself!(f32, f64);

macro_rules! accumulates_in_f32 {
    ($($t:ty),*) => {$(
        impl Stored for $t {
            type Sum = f32;
            fn widen(self) -> f32 {
                HalfFormat::widen(self)
            }
            fn narrow(sum: f32) -> $t {
                <$t as HalfFormat>::narrow(sum)
            }
        }
    )*};
}
accumulates_in_f32!(bf16, f16);

/// cuBLAS's strided-batched GEMM on column-major matrices of `T` into a C of `C`,
/// accumulating as cuBLAS does (in the type itself for f32 without TF32 and f64, in f32
/// for 16-bit matrices, whose result is rounded once to C's format). `beta == 0` ignores
/// C's old contents, NaNs included.
unsafe fn reference_gemm<T: Stored, C: Stored<Sum = T::Sum>>(g: &Gemm) {
    let (alpha, beta) = (
        <T::Sum as crate::Element>::from_f64(g.alpha),
        <T::Sum as crate::Element>::from_f64(g.beta),
    );
    for batch in 0..g.batch {
        let a = (g.a as *const T).wrapping_add(batch * g.stride_a);
        let b = (g.b as *const T).wrapping_add(batch * g.stride_b);
        let c = (g.c as *mut C).wrapping_add(batch * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = <T::Sum as crate::Element>::from_f64(0.0);
                for l in 0..g.k {
                    // SAFETY: indices within the extents the caller guarantees.
                    let x = unsafe {
                        *a.add(if g.transpose_a {
                            l + i * g.lda
                        } else {
                            i + l * g.lda
                        })
                    };
                    let y = unsafe {
                        *b.add(if g.transpose_b {
                            j + l * g.ldb
                        } else {
                            l + j * g.ldb
                        })
                    };
                    acc += x.widen() * y.widen();
                }
                // SAFETY: as above.
                let out = unsafe { &mut *c.add(i + j * g.ldc) };
                *out = C::narrow(if g.beta == 0.0 {
                    alpha * acc
                } else {
                    alpha * acc + beta * out.widen()
                });
            }
        }
    }
}
