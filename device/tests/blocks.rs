//! Cooperative kernels on the emulated device: blocks of threads meet at barriers and
//! warp shuffles with a GPU's semantics, and the checker reports what a GPU would run
//! wrongly or hang on: a shared-memory race with no barrier between, shared memory read
//! before any thread wrote it, a barrier not every thread reaches, warp lanes that do not
//! all meet, and grids a GPU refuses.

use std::ffi::c_void;

use ferrotron_device::blocks::Reduction;
use ferrotron_device::{Access, Device, Function, Grid, KernelArg, Stream, Thread};

#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    out: u64,
    x: u64,
    n: u64,
}

// SAFETY: a #[repr(C)] struct of scalars, read by the kernels below as such.
unsafe impl KernelArg for Args {}

/// The kernels' view of their launch.
///
/// # Safety
/// `args` and `thread` must come from a launch of this file's kernels.
unsafe fn launch<'a>(args: *const c_void, thread: *mut Thread) -> (&'a Args, &'a mut Thread) {
    // SAFETY: as the caller guarantees.
    unsafe { (&*args.cast::<Args>(), &mut *thread) }
}

/// The sum of a warp's values by a butterfly of xor shuffles, as GPU kernels reduce.
fn warp_sum(thread: &mut Thread, mut value: f32) -> f32 {
    let lane = thread.index() % 32;
    for mask in [16, 8, 4, 2, 1] {
        let bits = thread.shuffle(u64::from(value.to_bits()), lane ^ mask, line!());
        value += f32::from_bits(bits as u32);
    }
    value
}

/// out[block] = the sum of the block's `threads` values of x: warp sums, written to
/// shared memory by each warp's lane 0, summed by warp 0 after a barrier.
unsafe extern "C" fn block_sum(args: *const c_void, thread: *mut Thread) {
    // SAFETY: launched with `Args` over `blocks × threads` f32s of x and `blocks` of out.
    unsafe {
        let (args, t) = launch(args, thread);
        let (i, lane, warp) = (t.index(), t.index() % 32, t.index() / 32);
        let warps = t.threads() / 32;
        let partial = t.shared(4 * warps as usize, line!()).cast::<f32>();
        let x = *(args.x as *const f32).add((t.block() * t.threads() + i) as usize);
        let sum = warp_sum(t, x);
        if lane == 0 {
            t.store(partial.add(warp as usize), sum, line!());
        }
        t.barrier(line!());
        if warp == 0 {
            let mine = match lane < warps {
                true => t.load(partial.add(lane as usize), line!()),
                false => 0.0,
            };
            let total = warp_sum(t, mine);
            if lane == 0 {
                *(args.out as *mut f32).add(t.block() as usize) = total;
            }
        }
    }
}

/// Thread 0 writes a shared word that thread 1 reads: with a barrier between when
/// `args.n` is 1, without when 0.
unsafe extern "C" fn handoff(args: *const c_void, thread: *mut Thread) {
    // SAFETY: launched with `Args` whose out holds one f32.
    unsafe {
        let (args, t) = launch(args, thread);
        let word = t.shared(4, line!()).cast::<f32>();
        if t.index() == 0 {
            t.store(word, 7.0, line!());
        }
        if args.n == 1 {
            t.barrier(line!());
        }
        if t.index() == 1 {
            *(args.out as *mut f32) = t.load(word, line!());
        }
    }
}

/// Every thread reads a shared word that the last thread then overwrites with no barrier.
unsafe extern "C" fn overwrite_after_reads(_: *const c_void, thread: *mut Thread) {
    // SAFETY: shared memory only.
    unsafe {
        let t = &mut *thread;
        let word = t.shared(4, line!()).cast::<f32>();
        if t.index() == 0 {
            t.store(word, 1.0, line!());
        }
        t.barrier(line!());
        let _ = t.load(word, line!());
        if t.index() == t.threads() - 1 {
            t.store(word, 2.0, line!());
        }
    }
}

/// Reads shared memory that nobody wrote.
unsafe extern "C" fn uninitialized(_: *const c_void, thread: *mut Thread) {
    // SAFETY: shared memory only.
    unsafe {
        let t = &mut *thread;
        let word = t.shared(4, line!()).cast::<f32>();
        let _ = t.load(word, line!());
    }
}

/// The first warp waits at a barrier that the others return without reaching.
unsafe extern "C" fn divergent_barrier(_: *const c_void, thread: *mut Thread) {
    // SAFETY: no memory.
    unsafe {
        let t = &mut *thread;
        if t.index() < 32 {
            t.barrier(line!());
        }
    }
}

/// Half of each warp shuffles; the other half returns.
unsafe extern "C" fn half_warp_shuffle(_: *const c_void, thread: *mut Thread) {
    // SAFETY: no memory.
    unsafe {
        let t = &mut *thread;
        if t.index() % 32 < 16 {
            t.shuffle(1, 0, line!());
        }
    }
}

/// out[i] = the warp's sum of x by the one-meeting reduction, out[n + i] = the same by
/// five shuffles.
unsafe extern "C" fn sum_both_ways(args: *const c_void, thread: *mut Thread) {
    // SAFETY: launched with `Args` over `blocks × threads` f32s of x and twice that of out.
    unsafe {
        let (args, t) = launch(args, thread);
        let i = (t.block() * t.threads() + t.index()) as usize;
        let x = *(args.x as *const f32).add(i);
        let reduced = t.reduce(u64::from(x.to_bits()), Reduction::SumF32, line!());
        let out = args.out as *mut f32;
        *out.add(i) = f32::from_bits(reduced as u32);
        *out.add(args.n as usize + i) = warp_sum(t, x);
    }
}

/// out[i] = x[the next lane's i] within each warp: a rotation by shuffles.
unsafe extern "C" fn rotate(args: *const c_void, thread: *mut Thread) {
    // SAFETY: launched with `Args` over `blocks × threads` f32s of x and of out.
    unsafe {
        let (args, t) = launch(args, thread);
        let i = (t.block() * t.threads() + t.index()) as usize;
        let x = *(args.x as *const f32).add(i);
        let next = (t.index() + 1) % 32;
        let got = t.shuffle(u64::from(x.to_bits()), next, line!());
        *(args.out as *mut f32).add(i) = f32::from_bits(got as u32);
    }
}

/// Declares more shared memory than a `usize` holds once rounded up (a faulty size
/// computed from arguments), then returns.
unsafe extern "C" fn absurd_declaration(_: *const c_void, thread: *mut Thread) {
    // SAFETY: the pointer it gets back is not used.
    unsafe {
        let t = &mut *thread;
        let _ = t.shared(usize::MAX - 3, line!());
    }
}

struct Buffers {
    stream: Stream,
    x: ferrotron_device::DeviceMemory,
    out: ferrotron_device::DeviceMemory,
}

fn buffers(x: &[f32], out_len: usize) -> Buffers {
    let stream = Stream::new(Device::Emulated).unwrap();
    let xs = stream.alloc(4 * x.len().max(1)).unwrap();
    let out = stream.alloc(4 * out_len.max(1)).unwrap();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    // SAFETY: the allocation holds the bytes.
    unsafe { stream.upload(xs.ptr(), &bytes).unwrap() };
    Buffers { stream, x: xs, out }
}

impl Buffers {
    /// Runs `kernel` over `grid` with `n`; the stream's outcome once it has run.
    fn run(
        &self,
        name: &'static str,
        kernel: ferrotron_device::BlockKernel,
        grid: Grid,
        n: u64,
    ) -> ferrotron_device::Result<()> {
        let args = Args {
            out: self.out.ptr(),
            x: self.x.ptr(),
            n,
        };
        let accesses = [
            Access::read(self.x.ptr(), self.x.bytes()),
            Access::write(self.out.ptr(), self.out.bytes()),
        ];
        let function = Function::host_blocks(name, kernel);
        // SAFETY: the kernels stay within the buffers for the grids the tests give.
        unsafe {
            (self.stream).launch_blocks(&function, grid, &[&args], &accesses)?;
        }
        self.stream.synchronize()
    }

    fn out(&self, len: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; 4 * len];
        // SAFETY: the allocation holds `len` f32s.
        unsafe { self.stream.download(&mut bytes, self.out.ptr()).unwrap() };
        bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

fn fault(result: ferrotron_device::Result<()>) -> String {
    result
        .expect_err("the kernel's fault is reported")
        .to_string()
}

/// The fault `kernel` reports in one block of `threads` threads, with `n` as its argument.
fn fault_in(
    name: &'static str,
    kernel: ferrotron_device::BlockKernel,
    threads: u32,
    n: u64,
) -> String {
    let grid = Grid { blocks: 1, threads };
    fault(buffers(&[], 1).run(name, kernel, grid, n))
}

#[test]
fn blocks_reduce_through_shuffles_and_shared_memory() {
    for threads in [32, 64, 256, 1024] {
        let blocks = 3;
        let x: Vec<f32> = (0..blocks * threads).map(|i| (i % 97) as f32).collect();
        let run = buffers(&x, blocks as usize);
        let grid = Grid { blocks, threads };
        run.run("block_sum", block_sum, grid, 0).unwrap();
        let expected: Vec<f32> = (x.chunks(threads as usize))
            .map(|block| block.iter().sum())
            .collect();
        assert_eq!(run.out(blocks as usize), expected, "{threads} threads");
    }
}

#[test]
fn a_reduction_in_one_meeting_equals_five_shuffles_bit_for_bit() {
    let n = 128;
    // Values of very different sizes, so another order of additions would round apart.
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 10f32.powi(i as i32 % 7 - 3))
        .collect();
    let run = buffers(&x, 2 * n);
    let grid = Grid {
        blocks: 2,
        threads: 64,
    };
    run.run("sum_both_ways", sum_both_ways, grid, n as u64)
        .unwrap();
    let out = run.out(2 * n);
    let (reduced, shuffled) = out.split_at(n);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(reduced), bits(shuffled));
    let warp: f64 = x[..32].iter().map(|&v| f64::from(v)).sum();
    assert!((f64::from(reduced[0]) - warp).abs() <= 1e-3 * warp.abs().max(1.0));
}

#[test]
fn a_shuffle_gets_the_named_lane() {
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let run = buffers(&x, 64);
    let grid = Grid {
        blocks: 1,
        threads: 64,
    };
    run.run("rotate", rotate, grid, 0).unwrap();
    let expected: Vec<f32> = (0..64)
        .map(|i| (i / 32 * 32 + (i + 1) % 32) as f32)
        .collect();
    assert_eq!(run.out(64), expected);
}

#[test]
fn a_write_read_by_another_thread_after_a_barrier_passes() {
    let run = buffers(&[], 1);
    let grid = Grid {
        blocks: 2,
        threads: 64,
    };
    run.run("handoff", handoff, grid, 1).unwrap();
    assert_eq!(run.out(1), [7.0]);
}

#[test]
fn a_read_of_another_threads_write_with_no_barrier_between_is_reported() {
    let run = buffers(&[], 1);
    let grid = Grid {
        blocks: 1,
        threads: 64,
    };
    let message = fault(run.run("handoff", handoff, grid, 0));
    // In thread order the read comes after the write; in a jittered order it may come
    // first, and then reads what no thread wrote yet.
    let after_write =
        message.contains("which thread 0 wrote") && message.contains("with no barrier between");
    let before_write = message.contains("which no thread of the block wrote");
    assert!(
        message.contains("handoff, block 0: thread 1 reads shared offset 0")
            && (after_write || before_write),
        "{message}"
    );
    // The stream stays broken: what the kernel wrote cannot be trusted.
    assert!(run.stream.synchronize().is_err());
}

#[test]
fn a_write_over_other_threads_reads_with_no_barrier_between_is_reported() {
    let message = fault_in("overwrite", overwrite_after_reads, 64, 0);
    // In thread order the write comes after every read; in a jittered order a read may
    // come after it instead, and is then the access reported.
    let after_reads = message.contains("thread 63 writes shared offset 0")
        && message.contains("which several threads read");
    let read_after = message.contains("which thread 63 wrote");
    assert!(
        (after_reads || read_after) && message.contains("with no barrier between"),
        "{message}"
    );
}

#[test]
fn shared_memory_no_thread_wrote_is_reported() {
    let message = fault_in("uninitialized", uninitialized, 32, 0);
    assert!(
        message.contains("which no thread of the block wrote"),
        "{message}"
    );
}

#[test]
fn a_barrier_not_every_thread_reaches_is_reported() {
    let message = fault_in("divergent", divergent_barrier, 96, 0);
    assert!(
        message.contains("is reached by 32 of 96 threads (64 exited")
            && message.contains("must be reached by every thread of the block"),
        "{message}"
    );
}

#[test]
fn a_shuffle_not_every_lane_reaches_is_reported() {
    let message = fault_in("half_warp", half_warp_shuffle, 32, 0);
    assert!(
        message.contains("warp 0 waits at a warp operation that not all its lanes reach"),
        "{message}"
    );
}

#[test]
fn grids_a_gpu_refuses_are_errors() {
    let run = buffers(&[], 1);
    for (blocks, threads) in [(0, 32), (1, 0), (1, 48), (1, 2048)] {
        let grid = Grid { blocks, threads };
        let message = run
            .run("block_sum", block_sum, grid, 0)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("threads") && message.contains("block_sum"),
            "{message}"
        );
    }
    // A kernel over independent indices is not launched as blocks, nor the reverse.
    let grid = Grid {
        blocks: 1,
        threads: 32,
    };
    let function = Function::host_blocks("block_sum", block_sum);
    // SAFETY: refused before anything runs.
    let refused = unsafe { run.stream.launch(&function, 1, &[&0u64], &[]) };
    assert!(refused.unwrap_err().to_string().contains("launch_blocks"));
    unsafe extern "C" fn nothing(_: *const c_void) {}
    let function = Function::host("nothing", nothing);
    // SAFETY: as above.
    let refused = unsafe { run.stream.launch_blocks(&function, grid, &[&0u64], &[]) };
    assert!(refused.unwrap_err().to_string().contains("Stream::launch"));
}

/// A request whose arithmetic overflows inside the emulator's call is the launch's
/// fault, not a panic unwinding out of an `extern "C"` call (which aborts the process).
#[test]
fn a_shared_memory_request_that_overflows_is_a_fault() {
    let message = fault_in("absurd", absurd_declaration, 32, 0);
    assert!(
        message.contains("absurd") && message.contains("declares") && message.contains("past"),
        "{message}"
    );
}
