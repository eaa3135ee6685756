//! Tensor-core instructions on the emulated device: `ldmatrix` and `mma.m16n8k16` as
//! warp-collective operations with the PTX ISA's fragment layouts, so a warp that loads
//! tiles from shared memory and multiplies them gets the matrices' product, and the
//! checker reports what a GPU would run wrongly: misaligned or undeclared row
//! addresses, rows read before any thread wrote them or with no barrier after the
//! write, and lanes that do not all arrive.

use std::ffi::c_void;

use ferrotron_device::tensor_cores::MatrixFormat;
use ferrotron_device::{Access, Device, Function, Grid, KernelArg, Stream, Thread};
use half::{bf16, f16};

#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    /// 16 × 16 A then 16 × 8 B (row-major `[k][n]`), 16-bit.
    x: u64,
    /// 16 × 8 D, f32.
    out: u64,
    /// What the kernel does wrong (0: nothing), and the format.
    fault: u32,
    format: u32,
}

// SAFETY: a #[repr(C)] struct of scalars, read by the kernels below as such.
unsafe impl KernelArg for Args {}

/// Faults a test plants in [`product`].
const NONE: u32 = 0;
const MISALIGNED: u32 = 1;
const NO_BARRIER: u32 = 2;
const UNWRITTEN: u32 = 3;
const HALF_THE_LANES: u32 = 4;
const OUTSIDE: u32 = 5;

/// One warp: stages A (row-major) and B (row-major `[k][n]`, so loaded `.trans`) in
/// shared memory, loads A's fragment with `ldmatrix.x4` and B's with
/// `ldmatrix.x4.trans` (two matrices, each twice), multiplies, and writes D row-major.
unsafe extern "C" fn product(args: *const c_void, thread: *mut Thread) {
    // SAFETY: launched with `Args` over 16·16 + 16·8 16-bit values of x and 16·8 f32s
    // of out, one warp.
    unsafe {
        let args = &*args.cast::<Args>();
        let t = &mut *thread;
        let lane = t.index() as usize;
        let a = t.shared(16 * 16 * 2, line!()).cast::<u16>();
        let b = t.shared(16 * 8 * 2, line!()).cast::<u16>();
        // Pairs of elements: the checker watches 4-byte words.
        let x = args.x as *const u32;
        if args.fault != UNWRITTEN {
            for i in (lane..16 * 8).step_by(32) {
                t.store(a.cast::<u32>().add(i), *x.add(i), line!());
            }
        }
        for i in (lane..16 * 4).step_by(32) {
            t.store(b.cast::<u32>().add(i), *x.add(128 + i), line!());
        }
        if args.fault != NO_BARRIER {
            t.barrier(line!());
        }
        // A: lanes 0-15 name rows 0-15 at column 0, lanes 16-31 at column 8.
        let mut row = a.add((lane % 16) * 16 + (lane / 16) * 8).cast::<u8>();
        if args.fault == MISALIGNED && lane == 3 {
            row = row.add(2);
        }
        if args.fault == OUTSIDE && lane == 9 {
            row = row.add(4096);
        }
        let fa = t.ldmatrix(4, false, row, line!());
        // B: matrix j is rows k = 8(j % 2) .. + 7 of [k][n].
        let fb = t.ldmatrix(4, true, b.add((lane % 16) * 8).cast(), line!());
        if args.fault == HALF_THE_LANES && lane >= 16 {
            return;
        }
        let format = MatrixFormat::of(args.format as i32).unwrap();
        let d = t.mma(format, fa, [fb[0], fb[1]], [1.0; 4], line!());
        let (g, q) = (lane / 4, lane % 4);
        let out = args.out as *mut f32;
        for (i, value) in d.into_iter().enumerate() {
            *out.add((g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1)) = value;
        }
    }
}

/// A[m][k] and B[k][n] as small integers over 16 (exact in both formats), and
/// `1 + A·B` in f64.
fn matrices() -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let a: Vec<f64> = (0..256)
        .map(|i| ((i * 7 % 23) as f64 - 11.0) / 16.0)
        .collect();
    let b: Vec<f64> = (0..128)
        .map(|i| ((i * 5 % 19) as f64 - 9.0) / 16.0)
        .collect();
    let d = (0..128)
        .map(|i| {
            let (m, n) = (i / 8, i % 8);
            1.0 + (0..16).map(|k| a[m * 16 + k] * b[k * 8 + n]).sum::<f64>()
        })
        .collect();
    (a, b, d)
}

/// Runs [`product`] with `fault` in `format`: D, or the launch's fault.
fn run(fault: u32, format: MatrixFormat) -> ferrotron_device::Result<Vec<f32>> {
    let (a, b, _) = matrices();
    let bits = |v: &f64| match format {
        MatrixFormat::Bf16 => bf16::from_f64(*v).to_bits(),
        MatrixFormat::F16 => f16::from_f64(*v).to_bits(),
    };
    let x: Vec<u8> = (a.iter().chain(&b))
        .flat_map(|v| bits(v).to_le_bytes())
        .collect();
    let stream = Stream::new(Device::Emulated)?;
    let input = stream.alloc(x.len())?;
    let out = stream.alloc(128 * 4)?;
    // SAFETY: the allocation holds the bytes.
    unsafe { stream.upload(input.ptr(), &x)? };
    let args = Args {
        x: input.ptr(),
        out: out.ptr(),
        fault,
        format: format as u32,
    };
    let accesses = [
        Access::read(input.ptr(), input.bytes()),
        Access::write(out.ptr(), out.bytes()),
    ];
    let function = Function::host_blocks("product", product);
    let grid = Grid {
        blocks: 1,
        threads: 32,
    };
    // SAFETY: the kernel stays within the buffers for one warp.
    unsafe { stream.launch_blocks(&function, grid, &[&args], &accesses)? };
    stream.synchronize()?;
    let mut bytes = vec![0u8; 128 * 4];
    // SAFETY: the allocation holds 128 f32s.
    unsafe { stream.download(&mut bytes, out.ptr())? };
    Ok(bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn fault(fault: u32) -> String {
    run(fault, MatrixFormat::Bf16)
        .expect_err("the planted fault is reported")
        .to_string()
}

#[test]
fn a_warp_multiplies_tiles_loaded_from_shared_memory() {
    let (_, _, expected) = matrices();
    for format in [MatrixFormat::Bf16, MatrixFormat::F16] {
        let d = run(NONE, format).unwrap();
        // Every product and partial sum is a multiple of 2⁻⁸ below 2⁷: exact in f32.
        let expected: Vec<f32> = expected.iter().map(|&v| v as f32).collect();
        assert_eq!(d, expected, "{format:?}");
    }
}

#[test]
fn a_misaligned_row_address_is_reported() {
    let message = fault(MISALIGNED);
    assert!(message.contains("not 16-byte aligned"), "{message}");
}

#[test]
fn a_row_outside_shared_memory_is_reported() {
    let message = fault(OUTSIDE);
    assert!(message.contains("outside the shared memory"), "{message}");
}

#[test]
fn rows_read_with_no_barrier_after_the_writes_are_reported() {
    let message = fault(NO_BARRIER);
    assert!(message.contains("with no barrier between"), "{message}");
}

#[test]
fn rows_no_thread_wrote_are_reported() {
    let message = fault(UNWRITTEN);
    assert!(
        message.contains("which no thread of the block wrote"),
        "{message}"
    );
}

#[test]
fn a_product_not_every_lane_reaches_is_reported() {
    let message = fault(HALF_THE_LANES);
    assert!(message.contains("not all its lanes reach"), "{message}");
}
