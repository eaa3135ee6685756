//! Cooperative kernels on the emulated device: a grid of blocks of threads that meet at
//! block barriers and warp operations and share memory within a block, run on the host
//! with a GPU's semantics.
//!
//! Each thread of a block runs the kernel's host build on a stack of its own (a
//! coroutine) until it meets the others: a barrier suspends it until every thread of
//! the block has arrived, a warp shuffle or sync until every lane of its warp has. The
//! threads between two meeting points run one after another, in thread order (in a
//! random order under `FERROTRON_EMULATED_JITTER`), so a run is deterministic, and a
//! kernel whose result depends on that order is one the checker reports anyway:
//! - a shared-memory read of a word another thread wrote, or a write of a word another
//!   thread read or wrote, with no barrier (or, within a warp, no warp operation) between;
//! - a read of shared memory no thread of the block wrote;
//! - a barrier that not every thread of the block reaches (some exited, or wait at
//!   another barrier), and warp lanes that do not all meet at the same warp operation;
//! - shared memory beyond a block's 48 KiB.
//!
//! A fault fails the launch: the stream breaks with the first fault's description (the
//! threads are let past the meeting point so that the kernel runs to its end).

use std::cell::{RefCell, UnsafeCell};
use std::ffi::c_void;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};

use crate::tensor_cores::{self, Fragments, MatrixFormat};

/// Threads of a warp.
pub const WARP_SIZE: u32 = 32;
/// Most threads in a block (CUDA's limit).
pub const MAX_BLOCK_THREADS: u32 = 1024;
/// Shared memory a block may declare (CUDA's static limit).
pub const SHARED_MEMORY_BYTES: usize = 48 * 1024;
/// The most a thread that declares more than [`SHARED_MEMORY_BYTES`] is given to run on
/// (the launch fails with that fault either way).
const SPARE_BYTES: usize = 64 << 20;

/// The host build of a cooperative kernel: it reads its argument through the first
/// pointer and is run once per thread of every block with that thread's [`Thread`].
pub type BlockKernel = unsafe extern "C" fn(*const c_void, *mut Thread);

/// How a cooperative kernel is launched: `blocks` blocks of `threads` threads (a multiple
/// of the warp size, at most 1024), as CUDA's one-dimensional grid and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Blocks in the grid (`gridDim.x`).
    pub blocks: u32,
    /// Threads in a block (`blockDim.x`).
    pub threads: u32,
}

impl Grid {
    /// Why the emulated device (and a GPU) would refuse this grid, if it would.
    pub(crate) fn check(&self) -> Option<String> {
        let Grid { blocks, threads } = *self;
        if blocks == 0 || threads == 0 || threads > MAX_BLOCK_THREADS {
            return Some(format!(
                "a grid of {blocks} blocks of {threads} threads: give at least one block \
                 and 1 to {MAX_BLOCK_THREADS} threads"
            ));
        }
        if threads % WARP_SIZE != 0 {
            return Some(format!(
                "blocks of {threads} threads: give whole warps (a multiple of {WARP_SIZE})"
            ));
        }
        None
    }
}

/// The calls of a thread, as `ferrotron_blocks.h` declares them.
#[repr(C)]
struct Ops {
    barrier: extern "C" fn(*mut Thread, i32),
    sync_warp: extern "C" fn(*mut Thread, i32),
    shuffle: extern "C" fn(*mut Thread, u64, i32, i32) -> u64,
    shared: extern "C" fn(*mut Thread, u64, i32) -> *mut c_void,
    access: extern "C" fn(*mut Thread, *const c_void, u64, i32, i32),
    reduce: extern "C" fn(*mut Thread, u64, i32, i32) -> u64,
    mma: extern "C" fn(*mut Thread, i32, *const u32, *const u32, *const f32, *mut f32, i32),
    ldmatrix: extern "C" fn(*mut Thread, i32, i32, *const c_void, *mut u32, i32),
}

static OPS: Ops = Ops {
    barrier,
    sync_warp,
    shuffle,
    shared,
    access,
    reduce,
    mma,
    ldmatrix,
};

/// One thread of an emulated block, as a cooperative kernel's host build receives it
/// (`FerrotronThread` in `include/ferrotron_blocks.h`, whose directory build scripts read
/// from `DEP_FERROTRON_DEVICE_INCLUDE`). Kernels written in Rust for the emulated device
/// use its methods.
#[repr(C)]
pub struct Thread {
    ops: &'static Ops,
    thread: u32,
    block: u32,
    threads: u32,
    blocks: u32,
    runner: *mut c_void,
}

impl Thread {
    /// `threadIdx.x`.
    pub fn index(&self) -> u32 {
        self.thread
    }

    /// `blockIdx.x`.
    pub fn block(&self) -> u32 {
        self.block
    }

    /// `blockDim.x`.
    pub fn threads(&self) -> u32 {
        self.threads
    }

    /// `gridDim.x`.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// `__syncthreads()`; `line` names the call in fault reports.
    pub fn barrier(&mut self, line: u32) {
        (self.ops.barrier)(self, line as i32)
    }

    /// `__syncwarp()`.
    pub fn sync_warp(&mut self, line: u32) {
        (self.ops.sync_warp)(self, line as i32)
    }

    /// `__shfl_sync(0xffffffff, bits, lane)`: every lane of the warp offers its `bits`
    /// and gets those of `lane` (modulo the warp size).
    pub fn shuffle(&mut self, bits: u64, lane: u32, line: u32) -> u64 {
        (self.ops.shuffle)(self, bits, lane as i32, line as i32)
    }

    /// The warp's butterfly reduction of every lane's `bits` (see [`Reduction`]), in
    /// every lane.
    pub fn reduce(&mut self, bits: u64, reduction: Reduction, line: u32) -> u64 {
        (self.ops.reduce)(self, bits, reduction as i32, line as i32)
    }

    /// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` over the warp
    /// ([`tensor_cores`] has the layouts): this lane's four registers of A, two of B
    /// and four values of C; returns its four of D.
    pub fn mma(
        &mut self,
        format: MatrixFormat,
        a: [u32; 4],
        b: [u32; 2],
        c: [f32; 4],
        line: u32,
    ) -> [f32; 4] {
        let mut d = [0f32; 4];
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_ptr());
        (self.ops.mma)(self, format as i32, a, b, c, d.as_mut_ptr(), line as i32);
        d
    }

    /// `ldmatrix.sync.aligned.m8n8.x{count}{.trans}.shared.b16` over the warp: this
    /// lane's row `address` (lanes `8j .. 8j + 7` name matrix `j`'s rows); returns its
    /// register of each of the `count` (1, 2 or 4) matrices.
    pub fn ldmatrix(
        &mut self,
        count: u32,
        transposed: bool,
        address: *const u8,
        line: u32,
    ) -> [u32; 4] {
        let mut out = [0u32; 4];
        let (count, trans) = (count as i32, i32::from(transposed));
        (self.ops.ldmatrix)(
            self,
            count,
            trans,
            address.cast(),
            out.as_mut_ptr(),
            line as i32,
        );
        out
    }

    /// The next `bytes` of the block's shared memory (16-byte aligned).
    pub fn shared(&mut self, bytes: usize, line: u32) -> *mut u8 {
        (self.ops.shared)(self, bytes as u64, line as i32).cast()
    }

    /// Reads `*address`, a value in the block's shared memory, checked.
    ///
    /// # Safety
    /// `address` must be valid for reads (memory from [`shared`](Self::shared)).
    pub unsafe fn load<T: Copy>(&mut self, address: *const T, line: u32) -> T {
        (self.ops.access)(self, address.cast(), size_of::<T>() as u64, 0, line as i32);
        // SAFETY: as the caller guarantees.
        unsafe { address.read() }
    }

    /// Writes `value` to `*address` in the block's shared memory, checked.
    ///
    /// # Safety
    /// `address` must be valid for writes (memory from [`shared`](Self::shared)).
    pub unsafe fn store<T: Copy>(&mut self, address: *mut T, value: T, line: u32) {
        (self.ops.access)(self, address.cast(), size_of::<T>() as u64, 1, line as i32);
        // SAFETY: as the caller guarantees.
        unsafe { address.write(value) }
    }
}

/// Runs `kernel` over `grid` with `arg`; `Err` describes the first fault. `order` seeds
/// a random order of blocks and of threads between meeting points (`None`: in order).
///
/// # Safety
/// `arg` must be what the kernel reads, and every address in it valid for the kernel's
/// accesses.
pub(crate) unsafe fn run(
    kernel: BlockKernel,
    arg: *const c_void,
    grid: Grid,
    name: &str,
    order: &mut Option<u64>,
) -> Result<(), String> {
    if let Some(reason) = grid.check() {
        return Err(format!("{name}: {reason}"));
    }
    // The runner this thread keeps, so a launch in the steady state allocates nothing.
    let mut runner = RUNNER.with(|r| r.borrow_mut().take()).unwrap_or_default();
    runner.order.clear();
    runner.order.extend(0..grid.blocks);
    if let Some(state) = order {
        shuffle_in_place(&mut runner.order, state);
    }
    // SAFETY: no coroutine of this runner exists between launches.
    unsafe { Block::reset(runner.block, grid, runner.order[0]) };
    // SAFETY: as the caller guarantees.
    let outcome = unsafe { runner.start(kernel, arg) }
        .map_err(|e| format!("{name}: {e}"))
        .and_then(|()| runner.run_blocks(name, order));
    runner.stop();
    RUNNER.with(|r| *r.borrow_mut() = Some(runner));
    outcome
}

/// Where a thread stands between two resumptions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stand {
    /// Runs on when resumed.
    Ready,
    /// Waits at the block barrier of `line`.
    Barrier(i32),
    /// Waits for its warp at the warp operation `op` of `line`.
    Warp { line: i32, op: WarpOp },
    /// Has returned.
    Exited,
}

/// What a warp's lanes meet for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WarpOp {
    /// `__syncwarp`.
    Sync,
    /// A shuffle: each lane gets the value the lane it named offered.
    Shuffle,
    /// A butterfly reduction ([`Reduction`]) of every lane's value, in one meeting.
    Reduce(Reduction),
    /// A tensor-core product of every lane's fragments.
    Mma(MatrixFormat),
    /// `count` 8 × 8 matrices loaded from the rows the lanes name.
    Ldmatrix { count: u8, transposed: bool },
}

/// Where a lane's operands of a matrix instruction are (on its own stack, which stays
/// put while it waits): its fragments and result for `mma`, its row address and
/// registers for `ldmatrix`.
#[derive(Clone, Copy)]
struct Operands {
    a: *const u32,
    b: *const u32,
    c: *const f32,
    d: *mut f32,
    address: *const c_void,
    out: *mut u32,
}

impl Default for Operands {
    fn default() -> Operands {
        Operands {
            a: std::ptr::null(),
            b: std::ptr::null(),
            c: std::ptr::null(),
            d: std::ptr::null_mut(),
            address: std::ptr::null(),
            out: std::ptr::null_mut(),
        }
    }
}

/// A warp reduction as five xor shuffles compute it on a GPU (masks 16, 8, 4, 2, 1, each
/// lane combining its value with its partner's), which the emulator does in one meeting
/// with the same operations in the same order, so the results are the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// `v += partner` in f32.
    SumF32 = 0,
    /// `v = partner > v ? partner : v` in f32.
    MaxF32 = 1,
    /// `v += partner` in f64.
    SumF64 = 2,
    /// `v = partner > v ? partner : v` in f64.
    MaxF64 = 3,
}

impl Reduction {
    fn of(kind: i32) -> Option<Reduction> {
        [Self::SumF32, Self::MaxF32, Self::SumF64, Self::MaxF64]
            .into_iter()
            .find(|r| *r as i32 == kind)
    }

    /// One butterfly step: this lane's value combined with its partner's.
    fn combine(self, mine: u64, partner: u64) -> u64 {
        let (a, b) = (f32::from_bits(mine as u32), f32::from_bits(partner as u32));
        let (x, y) = (f64::from_bits(mine), f64::from_bits(partner));
        match self {
            Reduction::SumF32 => u64::from((a + b).to_bits()),
            Reduction::MaxF32 => u64::from(if b > a { b } else { a }.to_bits()),
            Reduction::SumF64 => (x + y).to_bits(),
            Reduction::MaxF64 => if y > x { y } else { x }.to_bits(),
        }
    }
}

/// The shadow of one 4-byte word of shared memory: who last wrote it and who read it
/// since, with the meeting counts that order them.
#[derive(Clone, Copy, Default)]
struct Word {
    /// Thread + 1 of the last write (0: never written in this block).
    writer: u32,
    write_line: i32,
    write_epoch: u32,
    write_warp_epoch: u32,
    /// Thread + 1 of the reader since the write or barrier, `u32::MAX` for several.
    reader: u32,
    read_line: i32,
    read_epoch: u32,
    /// Warps whose lanes read it (bit per warp) and the latest read's warp count.
    read_warps: u32,
    read_warp_epoch: u32,
}

/// The state of the block being run, reached by the scheduler and by its threads' calls.
#[derive(Default)]
struct State {
    stands: Vec<Stand>,
    offered: Vec<(u64, i32)>,
    received: Vec<u64>,
    operands: Vec<Operands>,
    /// Block barriers passed, and each warp's warp operations (and barriers) passed.
    epoch: u32,
    warp_epochs: Vec<u32>,
    arena: Vec<u128>,
    /// Each thread's next shared offset, and the most any declared.
    cursors: Vec<usize>,
    used: usize,
    shadow: Vec<Word>,
    /// Memory handed out past the arena, so a faulty kernel writes somewhere valid.
    overflow: Vec<Box<[u128]>>,
    yielders: Vec<*const Yielder<(), ()>>,
    fault: Option<String>,
    /// Set while the launch's coroutines are let return.
    stopping: bool,
}

/// One block's threads and their shared state. The runner allocates it once and
/// reaches it, as the coroutines do, only through a raw pointer: the threads' contexts
/// and the state are written by whichever side runs (the scheduler between resumptions,
/// a thread's call while the scheduler waits in `resume`), so no `&mut Block` may live
/// while a coroutine holds pointers into it.
#[derive(Default)]
struct Block {
    /// Each thread's context, handed to the kernel as a `*mut Thread`.
    threads: Vec<UnsafeCell<Thread>>,
    state: UnsafeCell<State>,
}

/// What a thread keeps between launches: the block (reset for each), the stacks of
/// finished coroutines, and the vectors a run fills, so that nothing is allocated in the
/// steady state (memory counts would see it).
struct Runner {
    /// Owned (from `Box::into_raw`, freed on drop); see [`Block`].
    block: *mut Block,
    stacks: Vec<DefaultStack>,
    coroutines: Vec<Coroutine<(), (), (), DefaultStack>>,
    /// The order of the blocks, and of the threads between meetings.
    order: Vec<u32>,
    sequence: Vec<usize>,
}

impl Default for Runner {
    fn default() -> Runner {
        Runner {
            block: Box::into_raw(Box::default()),
            stacks: Vec::new(),
            coroutines: Vec::new(),
            order: Vec::new(),
            sequence: Vec::new(),
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // Every coroutine has returned (`stop`); none points at the block any more.
        self.coroutines.clear();
        // SAFETY: allocated by `Box::into_raw` in `default`, and freed only here.
        drop(unsafe { Box::from_raw(self.block) });
    }
}

thread_local! {
    static RUNNER: RefCell<Option<Box<Runner>>> = const { RefCell::new(None) };
}

/// A coroutine's stack: the kernels' frames are small, the calls' formatting too.
const STACK_BYTES: usize = 128 * 1024;

/// The state of the block at `block`, for the scheduler between resumptions or for a
/// thread's call while the scheduler waits: one side at a time, and no reference to it
/// outlives that side's turn.
///
/// # Safety
/// `block` must be a runner's block, and no other reference to its state alive.
#[allow(clippy::mut_from_ref)]
unsafe fn state<'a>(block: *const Block) -> &'a mut State {
    // SAFETY: as the caller guarantees; the state is an `UnsafeCell`.
    unsafe { &mut *(*block).state.get() }
}

impl Block {
    /// Makes the block at `block` block `index` of `grid`, its threads at their start.
    ///
    /// # Safety
    /// `block` must be a runner's block with no coroutine running over it.
    unsafe fn reset(block: *mut Block, grid: Grid, index: u32) {
        let n = grid.threads as usize;
        // SAFETY: as the caller guarantees: nothing else reaches the block now.
        let this = unsafe { &mut *block };
        this.threads.clear();
        this.threads.extend((0..grid.threads).map(|thread| {
            UnsafeCell::new(Thread {
                ops: &OPS,
                thread,
                block: index,
                threads: grid.threads,
                blocks: grid.blocks,
                runner: block.cast(),
            })
        }));
        let state = this.state.get_mut();
        state.stands.clear();
        state.stands.resize(n, Stand::Ready);
        state.offered.clear();
        state.offered.resize(n, (0, 0));
        state.received.clear();
        state.received.resize(n, 0);
        state.operands.clear();
        state.operands.resize(n, Operands::default());
        state.epoch = 0;
        state.warp_epochs.clear();
        state.warp_epochs.resize(n / WARP_SIZE as usize, 0);
        state.cursors.clear();
        state.cursors.resize(n, 0);
        state.used = 0;
        state.shadow.clear();
        state.overflow.clear();
        state.yielders.clear();
        state.yielders.resize(n, std::ptr::null());
        state.fault = None;
    }

    /// Makes the block at `block` block `index` of the same grid: its threads (whose
    /// contexts keep their addresses) at their start again, its meetings and shared
    /// memory fresh. The coroutines are suspended between blocks, none inside a kernel.
    ///
    /// # Safety
    /// `block` must be a runner's block whose coroutines are all suspended.
    unsafe fn next(block: *const Block, index: u32) {
        // SAFETY: as the caller guarantees: no thread runs, and its contexts are written
        // through their cells, as the kernels' pointers were made.
        unsafe {
            for thread in &(*block).threads {
                (*thread.get()).block = index;
            }
            let state = state(block);
            state.stands.fill(Stand::Ready);
            state.epoch = 0;
            state.warp_epochs.fill(0);
            state.cursors.fill(0);
            state.used = 0;
            state.shadow.clear();
            state.overflow.clear();
            state.fault = None;
        }
    }
}

impl Runner {
    /// Makes a coroutine for each thread of the block, which runs the kernel for every
    /// block it is resumed into (so a launch makes its threads once, not per block) and
    /// returns once told to stop.
    ///
    /// # Safety
    /// As [`run`].
    unsafe fn start(&mut self, kernel: BlockKernel, arg: *const c_void) -> Result<(), String> {
        let block = self.block;
        self.coroutines.clear();
        // SAFETY: the runner's block; nothing writes the vector of contexts until `stop`.
        let count = unsafe { (*block).threads.len() };
        for t in 0..count {
            let stack = match self.stacks.pop() {
                Some(stack) => stack,
                None => DefaultStack::new(STACK_BYTES)
                    .map_err(|e| format!("mapping a stack for an emulated thread: {e}"))?,
            };
            // SAFETY: as above; the context's cell gives a pointer the kernel may write.
            let thread = unsafe { (&(*block).threads)[t].get() };
            self.coroutines.push(Coroutine::with_stack(
                stack,
                move |yielder: &Yielder<(), ()>, ()| {
                    // SAFETY: the block (threads and state) outlives its coroutines, and the
                    // scheduler holds no reference to the state while a thread runs; the
                    // kernel's contract is the caller's.
                    unsafe {
                        state(block).yielders[t] = yielder;
                        while !state(block).stopping {
                            kernel(arg, thread);
                            state(block).stands[t] = Stand::Exited;
                            yielder.suspend(());
                        }
                    }
                },
            ));
        }
        Ok(())
    }

    /// Runs the blocks in `self.order`, each to its end; the first fault ends the launch.
    fn run_blocks(&mut self, name: &str, order: &mut Option<u64>) -> Result<(), String> {
        for b in 0..self.order.len() {
            let index = self.order[b];
            // SAFETY: between blocks every coroutine is suspended.
            unsafe { Block::next(self.block, index) };
            self.run_block(order);
            // SAFETY: no thread runs now.
            if let Some(fault) = unsafe { state(self.block) }.fault.take() {
                return Err(format!("{name}, block {index}: {fault}"));
            }
        }
        Ok(())
    }

    /// Runs every thread of the block to its end, meeting after meeting. The state is
    /// read between resumptions only, each time anew.
    fn run_block(&mut self, order: &mut Option<u64>) {
        let block = self.block;
        self.sequence.clear();
        // SAFETY (of every `state` below): no thread runs between resumptions.
        self.sequence
            .extend(0..unsafe { state(block) }.stands.len());
        loop {
            if let Some(seed) = order {
                shuffle_in_place(&mut self.sequence, seed);
            }
            for &t in &self.sequence {
                if unsafe { state(block) }.stands[t] != Stand::Ready {
                    continue;
                }
                if let CoroutineResult::Return(()) = self.coroutines[t].resume(()) {
                    unsafe { state(block) }.stands[t] = Stand::Exited;
                }
            }
            if !unsafe { state(block) }.meet() {
                break;
            }
        }
    }

    /// Lets every coroutine return (each waits after its last block, or has not started,
    /// and then returns at once) and keeps their stacks.
    fn stop(&mut self) {
        // SAFETY (of both): no thread runs between resumptions.
        unsafe { state(self.block) }.stopping = true;
        for coroutine in &mut self.coroutines {
            if !coroutine.done() {
                coroutine.resume(());
            }
        }
        unsafe { state(self.block) }.stopping = false;
        (self.stacks).extend(self.coroutines.drain(..).map(|c| c.into_stack()));
    }
}

impl State {
    /// Lets threads past the meeting points they all reached; false once all exited. A
    /// meeting that cannot happen is a fault, and its threads are let past anyway.
    fn meet(&mut self) -> bool {
        if self.stands.iter().all(|s| *s == Stand::Exited) {
            return false;
        }
        let mut moved = false;
        for warp in 0..self.warp_epochs.len() {
            moved |= self.meet_warp(warp);
        }
        if moved {
            return true;
        }
        let lines: Vec<i32> = (self.stands.iter())
            .filter_map(|s| match s {
                Stand::Barrier(line) => Some(*line),
                _ => None,
            })
            .collect();
        let waiting = lines.len();
        let exited = self.stands.iter().filter(|s| **s == Stand::Exited).count();
        let first = lines.first().copied().unwrap_or(0);
        if waiting + exited == self.stands.len() && exited == 0 {
            if lines.iter().any(|l| *l != first) {
                self.report(format!(
                    "threads wait at barriers on different lines ({}): every thread of a \
                     block must reach the same __syncthreads",
                    distinct(&lines)
                ));
            }
            self.release_all();
            return true;
        }
        self.report(self.describe_stall(waiting, exited, first));
        self.release_all();
        true
    }

    /// Completes warp `warp`'s operation if all its lanes wait at one; whether it did.
    fn meet_warp(&mut self, warp: usize) -> bool {
        let lanes = warp * WARP_SIZE as usize..(warp + 1) * WARP_SIZE as usize;
        let stands = &self.stands[lanes.clone()];
        if !stands.iter().all(|s| matches!(s, Stand::Warp { .. })) {
            return false;
        }
        let first = stands[0];
        let agreed = stands.iter().all(|s| *s == first);
        if !agreed {
            let lines: Vec<i32> = (stands.iter())
                .filter_map(|s| match s {
                    Stand::Warp { line, .. } => Some(*line),
                    _ => None,
                })
                .collect();
            self.report(format!(
                "the lanes of warp {warp} meet at different warp operations (lines {}): \
                 every lane must reach the same shuffle or __syncwarp",
                distinct(&lines)
            ));
        }
        match first {
            Stand::Warp {
                op: WarpOp::Reduce(reduction),
                ..
            } => self.reduce_warp(lanes.start, reduction),
            // Lanes at other operations gave no operands: nothing to compute (the
            // launch has failed).
            Stand::Warp {
                op: WarpOp::Mma(format),
                ..
            } if agreed => self.mma_warp(lanes.start, format),
            Stand::Warp {
                op: WarpOp::Ldmatrix { count, transposed },
                line,
            } if agreed => self.ldmatrix_warp(lanes.start, count, transposed, line),
            Stand::Warp {
                op: WarpOp::Mma(_) | WarpOp::Ldmatrix { .. },
                ..
            } => {}
            _ => {
                for lane in lanes.clone() {
                    let (_, source) = self.offered[lane];
                    let from = lanes.start + source.rem_euclid(WARP_SIZE as i32) as usize;
                    self.received[lane] = self.offered[from].0;
                }
            }
        }
        self.stands[lanes].fill(Stand::Ready);
        self.warp_epochs[warp] += 1;
        true
    }

    /// The butterfly of the 32 lanes' offered values from lane `first`, into `received`.
    fn reduce_warp(&mut self, first: usize, reduction: Reduction) {
        let mut values = [0u64; WARP_SIZE as usize];
        for (lane, value) in values.iter_mut().enumerate() {
            *value = self.offered[first + lane].0;
        }
        for mask in [16, 8, 4, 2, 1] {
            let before = values;
            for (lane, value) in values.iter_mut().enumerate() {
                *value = reduction.combine(before[lane], before[lane ^ mask]);
            }
        }
        self.received[first..first + WARP_SIZE as usize].copy_from_slice(&values);
    }

    /// The tensor-core product of the 32 lanes' fragments from lane `first`.
    fn mma_warp(&mut self, first: usize, format: MatrixFormat) {
        let lanes = &self.operands[first..first + WARP_SIZE as usize];
        // SAFETY: each lane's pointers are to its arrays, alive while it waits here.
        let fragments = std::array::from_fn(|l| unsafe {
            let o = lanes[l];
            Fragments {
                a: o.a.cast::<[u32; 4]>().read_unaligned(),
                b: o.b.cast::<[u32; 2]>().read_unaligned(),
                c: o.c.cast::<[f32; 4]>().read_unaligned(),
            }
        });
        let d = tensor_cores::mma_m16n8k16(format, &fragments);
        for (o, values) in lanes.iter().zip(d) {
            // SAFETY: as above; every C was read before any D is written.
            unsafe { o.d.cast::<[f32; 4]>().write_unaligned(values) };
        }
    }

    /// `count` matrices from the rows lanes `first ..` name, checked as the lanes'
    /// reads of shared memory, into every lane's registers.
    fn ldmatrix_warp(&mut self, first: usize, count: u8, transposed: bool, line: i32) {
        let mut matrices = [[[0u16; 8]; 8]; 4];
        for lane in 0..8 * usize::from(count) {
            let t = first + lane;
            let address = self.operands[t].address;
            if !(address as usize).is_multiple_of(16) {
                self.report(format!(
                    "lane {lane} of thread {t}'s warp gives ldmatrix the row address \
                     {address:?} at line {line}, not 16-byte aligned"
                ));
                continue;
            }
            if self.offset_of(address, 16).is_none() {
                self.report(format!(
                    "lane {lane} of thread {t}'s warp gives ldmatrix the row address \
                     {address:?} at line {line}, outside the shared memory the block \
                     declared"
                ));
                continue;
            }
            self.check(t, address, 16, false, line);
            // SAFETY: 16 bytes within the arena (checked above).
            matrices[lane / 8][lane % 8] = unsafe { address.cast::<[u16; 8]>().read() };
        }
        for lane in 0..WARP_SIZE as usize {
            let out = self.operands[first + lane].out;
            for (j, matrix) in matrices.iter().take(usize::from(count)).enumerate() {
                let register = tensor_cores::ldmatrix_register(matrix, lane, transposed);
                // SAFETY: the lane's array of four registers, alive while it waits.
                unsafe { out.add(j).write(register) };
            }
        }
    }

    fn release_all(&mut self) {
        self.epoch += 1;
        for stand in &mut self.stands {
            if *stand != Stand::Exited {
                *stand = Stand::Ready;
            }
        }
    }

    /// Why the threads cannot go on: a barrier some did not reach, or a warp operation
    /// some lanes did not.
    fn describe_stall(&self, waiting: usize, exited: usize, line: i32) -> String {
        let n = self.stands.len();
        if waiting > 0 {
            let elsewhere = n - waiting - exited;
            return format!(
                "the barrier at line {line} is reached by {waiting} of {n} threads \
                 ({exited} exited, {elsewhere} wait at a warp operation): a __syncthreads \
                 must be reached by every thread of the block"
            );
        }
        let warp = (self
            .stands
            .iter()
            .position(|s| matches!(s, Stand::Warp { .. })))
        .map_or(0, |t| t / WARP_SIZE as usize);
        format!(
            "warp {warp} waits at a warp operation that not all its lanes reach (some \
             exited or wait at a barrier): every lane must reach the same shuffle or \
             __syncwarp"
        )
    }

    fn report(&mut self, fault: String) {
        self.fault.get_or_insert(fault);
    }

    /// The shared offset of `address`, if it lies in the arena.
    fn offset_of(&self, address: *const c_void, bytes: u64) -> Option<usize> {
        let base = self.arena.as_ptr() as usize;
        let offset = (address as usize).checked_sub(base)?;
        let end = offset.checked_add(usize::try_from(bytes).ok()?)?;
        (end <= self.used).then_some(offset)
    }

    /// Checks thread `t`'s access to shared memory against the other threads'.
    fn check(&mut self, t: usize, address: *const c_void, bytes: u64, write: bool, line: i32) {
        let Some(offset) = self.offset_of(address, bytes) else {
            if self.overflow.is_empty() {
                self.report(format!(
                    "thread {t} accesses {bytes} bytes at {address:?} at line {line} as \
                     shared memory, outside what the block declared"
                ));
            }
            return;
        };
        let warp = t / WARP_SIZE as usize;
        let (epoch, warp_epoch) = (self.epoch, self.warp_epochs[warp]);
        let ordered = |other: u32, at_epoch: u32, at_warp_epoch: u32| {
            let other = other as usize - 1;
            other == t
                || at_epoch < epoch
                || (other / WARP_SIZE as usize == warp && at_warp_epoch < warp_epoch)
        };
        // Within the arena (`offset_of`), so the sum does not overflow.
        for index in offset / 4..(offset + bytes as usize).div_ceil(4) {
            let word = self.shadow[index];
            let at = index * 4;
            if word.writer == 0 && !write {
                self.report(format!(
                    "thread {t} reads shared offset {at} at line {line}, which no thread of \
                     the block wrote"
                ));
            } else if word.writer != 0
                && !ordered(word.writer, word.write_epoch, word.write_warp_epoch)
            {
                self.report(format!(
                    "thread {t} {} shared offset {at} at line {line}, which thread {} wrote \
                     at line {} with no barrier between",
                    if write { "writes" } else { "reads" },
                    word.writer - 1,
                    word.write_line
                ));
            }
            let reads_now = word.reader != 0 && word.read_epoch == epoch;
            if write && reads_now && word.reader != t as u32 + 1 {
                let same_warp_synced =
                    word.read_warps == 1 << warp && word.read_warp_epoch < warp_epoch;
                if !same_warp_synced {
                    let who = match word.reader {
                        u32::MAX => "several threads".to_string(),
                        r => format!("thread {}", r - 1),
                    };
                    self.report(format!(
                        "thread {t} writes shared offset {at} at line {line}, which {who} \
                         read (line {}) with no barrier between",
                        word.read_line
                    ));
                }
            }
            let shadow = &mut self.shadow[index];
            if write {
                *shadow = Word {
                    writer: t as u32 + 1,
                    write_line: line,
                    write_epoch: epoch,
                    write_warp_epoch: warp_epoch,
                    ..Word::default()
                };
            } else {
                if !reads_now {
                    shadow.reader = 0;
                    shadow.read_warps = 0;
                }
                shadow.reader = match shadow.reader {
                    0 => t as u32 + 1,
                    r if r == t as u32 + 1 => r,
                    _ => u32::MAX,
                };
                shadow.read_line = line;
                shadow.read_epoch = epoch;
                shadow.read_warps |= 1 << warp;
                shadow.read_warp_epoch = warp_epoch;
            }
        }
    }

    /// Declares `bytes` more shared memory for thread `t`. Past the block's limit it is
    /// a fault, and the thread gets memory of its own to run on (up to
    /// [`SPARE_BYTES`]; a null pointer beyond, which no GPU would launch either).
    fn declare(&mut self, t: usize, bytes: u64, line: i32) -> *mut c_void {
        let offset = self.cursors[t];
        let end = (usize::try_from(bytes).ok())
            .and_then(|b| b.checked_next_multiple_of(16))
            .and_then(|b| offset.checked_add(b))
            .filter(|&end| end <= SHARED_MEMORY_BYTES);
        let Some(end) = end else {
            self.report(format!(
                "thread {t} declares {bytes} bytes of shared memory at line {line}, past \
                 the block's {SHARED_MEMORY_BYTES}"
            ));
            if bytes > SPARE_BYTES as u64 {
                return std::ptr::null_mut();
            }
            let spare = vec![0u128; (bytes as usize).div_ceil(16)].into_boxed_slice();
            self.overflow.push(spare);
            return self
                .overflow
                .last_mut()
                .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr().cast());
        };
        self.cursors[t] = end;
        if self.arena.is_empty() {
            // Once per runner: it keeps the arena for every later block.
            self.arena = vec![0; SHARED_MEMORY_BYTES / 16];
        }
        if end > self.used {
            self.used = end;
            self.shadow.resize(end / 4, Word::default());
        }
        // SAFETY: `offset` is within the arena (checked above).
        unsafe { self.arena.as_mut_ptr().cast::<u8>().add(offset).cast() }
    }
}

/// Suspends thread `t` of `block` (on its own stack) at `stand` until the scheduler
/// resumes it; no reference to the state is held meanwhile.
///
/// # Safety
/// `block` and `t` must be the calling thread's ([`caller`]).
unsafe fn suspend(block: *const Block, t: usize, stand: Stand) {
    let yielder = {
        // SAFETY: the scheduler waits in `resume` while a thread calls.
        let state = unsafe { state(block) };
        state.stands[t] = stand;
        state.yielders[t]
    };
    // SAFETY: set when the thread's coroutine started, which is running this call.
    unsafe { (*yielder).suspend(()) };
}

/// The block and index of the calling thread.
///
/// # Safety
/// `thread` must be a [`Thread`] of a block being run.
unsafe fn caller(thread: *mut Thread) -> (*const Block, usize) {
    // SAFETY: as the caller guarantees; read, not borrowed: the kernel may hold the
    // context mutably.
    unsafe {
        let (runner, index) = ((*thread).runner, (*thread).thread);
        (runner.cast::<Block>().cast_const(), index as usize)
    }
}

/// Runs a thread's call: a panic in it (an overflow in a faulty kernel's request) is
/// reported as the block's fault and the call returns `fallback`, since unwinding out of
/// an `extern "C"` function would abort the process.
fn guarded<R>(thread: *mut Thread, line: i32, fallback: R, call: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(value) => value,
        Err(panic) => {
            let message = (panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            // SAFETY: only the block's threads make these calls.
            let (block, t) = unsafe { caller(thread) };
            // SAFETY: as in the calls themselves.
            unsafe { state(block) }.report(format!(
                "thread {t}'s call at line {line} failed: {message}"
            ));
            fallback
        }
    }
}

extern "C" fn barrier(thread: *mut Thread, line: i32) {
    guarded(thread, line, (), || {
        // SAFETY: only the block's threads get these calls.
        let (block, t) = unsafe { caller(thread) };
        // SAFETY: the caller's own block and index.
        unsafe { suspend(block, t, Stand::Barrier(line)) };
    })
}

extern "C" fn sync_warp(thread: *mut Thread, line: i32) {
    guarded(thread, line, (), || {
        // SAFETY: as above.
        let (block, t) = unsafe { caller(thread) };
        let stand = Stand::Warp {
            line,
            op: WarpOp::Sync,
        };
        // SAFETY: as above.
        unsafe { suspend(block, t, stand) };
    })
}

extern "C" fn shuffle(thread: *mut Thread, bits: u64, lane: i32, line: i32) -> u64 {
    guarded(thread, line, bits, || {
        // SAFETY (of each): as above; the state is the calling thread's to use now.
        let (block, t) = unsafe { caller(thread) };
        unsafe { state(block) }.offered[t] = (bits, lane);
        let stand = Stand::Warp {
            line,
            op: WarpOp::Shuffle,
        };
        unsafe { suspend(block, t, stand) };
        unsafe { state(block) }.received[t]
    })
}

extern "C" fn reduce(thread: *mut Thread, bits: u64, kind: i32, line: i32) -> u64 {
    guarded(thread, line, bits, || {
        // SAFETY (of each): as above.
        let (block, t) = unsafe { caller(thread) };
        let Some(reduction) = Reduction::of(kind) else {
            unsafe { state(block) }.report(format!(
                "thread {t} asks at line {line} for a warp reduction of kind {kind}, which \
                 there is not (0 to 3)"
            ));
            return bits;
        };
        unsafe { state(block) }.offered[t] = (bits, 0);
        let stand = Stand::Warp {
            line,
            op: WarpOp::Reduce(reduction),
        };
        unsafe { suspend(block, t, stand) };
        unsafe { state(block) }.received[t]
    })
}

extern "C" fn mma(
    thread: *mut Thread,
    kind: i32,
    a: *const u32,
    b: *const u32,
    c: *const f32,
    d: *mut f32,
    line: i32,
) {
    guarded(thread, line, (), || {
        // SAFETY (of each): as above.
        let (block, t) = unsafe { caller(thread) };
        let Some(format) = MatrixFormat::of(kind) else {
            unsafe { state(block) }.report(format!(
                "thread {t} asks at line {line} for a matrix product of format {kind}, \
                 which there is not (1 bf16, 2 f16)"
            ));
            return;
        };
        unsafe { state(block) }.operands[t] = Operands {
            a,
            b,
            c,
            d,
            ..Operands::default()
        };
        let stand = Stand::Warp {
            line,
            op: WarpOp::Mma(format),
        };
        unsafe { suspend(block, t, stand) };
    })
}

extern "C" fn ldmatrix(
    thread: *mut Thread,
    count: i32,
    trans: i32,
    address: *const c_void,
    out: *mut u32,
    line: i32,
) {
    guarded(thread, line, (), || {
        // SAFETY (of each): as above.
        let (block, t) = unsafe { caller(thread) };
        let count = match count {
            1 | 2 | 4 => count as u8,
            _ => {
                unsafe { state(block) }.report(format!(
                    "thread {t} asks at line {line} for ldmatrix of {count} matrices: 1, 2 \
                     or 4"
                ));
                return;
            }
        };
        unsafe { state(block) }.operands[t] = Operands {
            address,
            out,
            ..Operands::default()
        };
        let stand = Stand::Warp {
            line,
            op: WarpOp::Ldmatrix {
                count,
                transposed: trans != 0,
            },
        };
        unsafe { suspend(block, t, stand) };
    })
}

extern "C" fn shared(thread: *mut Thread, bytes: u64, line: i32) -> *mut c_void {
    guarded(thread, line, std::ptr::null_mut(), || {
        // SAFETY (of both): as above.
        let (block, t) = unsafe { caller(thread) };
        unsafe { state(block) }.declare(t, bytes, line)
    })
}

extern "C" fn access(
    thread: *mut Thread,
    address: *const c_void,
    bytes: u64,
    write: i32,
    line: i32,
) {
    guarded(thread, line, (), || {
        // SAFETY (of both): as above.
        let (block, t) = unsafe { caller(thread) };
        unsafe { state(block) }.check(t, address, bytes, write != 0, line);
    })
}

/// The distinct values of `lines`, in order, as text.
fn distinct(lines: &[i32]) -> String {
    let mut seen: Vec<i32> = Vec::new();
    for line in lines {
        if !seen.contains(line) {
            seen.push(*line);
        }
    }
    let text: Vec<String> = seen.iter().map(|l| l.to_string()).collect();
    text.join(", ")
}

/// Fisher–Yates with xorshift on `state` (never zero).
fn shuffle_in_place<T>(items: &mut [T], state: &mut u64) {
    for i in (1..items.len()).rev() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        items.swap(i, (*state % (i as u64 + 1)) as usize);
    }
}
