//! Memory per rank, measured: the demo's allocator is mimalloc with a small header on
//! every allocation naming the rank whose thread made it, so a rank's live and peak
//! bytes stay exact when another thread frees its memory (a message taken by its
//! receiver, say). Threads that are no rank's (the main thread, communicators' progress
//! threads, the checkpoint writer) count as slot 0. The header also names the [`Phase`]
//! the rank was in when it allocated, so that its peak splits by what it was doing.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Ranks counted apart (more share the last slot).
const SLOTS: usize = 64;

/// What a rank was doing when it allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Anything not below.
    Other,
    /// Building the model, its DDP buckets and its optimizer, and loading weights.
    Model,
    /// Reading a batch.
    Data,
    /// Forward and backward passes: activations, their working memory, the messages and
    /// collectives they send.
    Passes,
    /// Unscaling, clipping and the optimizer's step (its moments appear at the first).
    Optimizer,
    /// Taking a checkpoint's copy.
    Checkpoint,
}

/// The phases, in the order of [`peak_by_phase`]'s figures.
pub const PHASES: [Phase; 6] = [
    Phase::Model,
    Phase::Data,
    Phase::Passes,
    Phase::Optimizer,
    Phase::Checkpoint,
    Phase::Other,
];

impl Phase {
    fn index(self) -> usize {
        PHASES
            .iter()
            .position(|&p| p == self)
            .unwrap_or(PHASES.len() - 1)
    }

    /// As the demo's report names it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Model => "building the model",
            Phase::Data => "reading data",
            Phase::Passes => "forward and backward passes",
            Phase::Optimizer => "the optimizer step",
            Phase::Checkpoint => "saving",
            Phase::Other => "other",
        }
    }
}

/// A cache line each, so that ranks counting at once do not contend for one.
#[repr(align(64))]
struct Slot {
    live: AtomicIsize,
    peak: AtomicIsize,
    /// Live bytes by the phase that allocated them, and their values at the peak.
    phases: [AtomicIsize; PHASES.len()],
    at_peak: [AtomicIsize; PHASES.len()],
}

static COUNTS: [Slot; SLOTS] = [const {
    Slot {
        live: AtomicIsize::new(0),
        peak: AtomicIsize::new(0),
        phases: [const { AtomicIsize::new(0) }; PHASES.len()],
        at_peak: [const { AtomicIsize::new(0) }; PHASES.len()],
    }
}; SLOTS];

thread_local! {
    /// This thread's slot: its rank + 1, or 0.
    static SLOT: Cell<usize> = const { Cell::new(0) };
    /// The phase this thread's allocations are counted in.
    static PHASE: Cell<usize> = const { Cell::new(PHASES.len() - 1) };
}

/// Counts this thread's allocations as made in `phase` until the guard is dropped.
pub fn enter(phase: Phase) -> PhaseGuard {
    PhaseGuard(PHASE.with(|p| p.replace(phase.index())))
}

/// Restores the phase before [`enter`] when dropped.
pub struct PhaseGuard(usize);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        let _ = PHASE.try_with(|p| p.set(self.0));
    }
}

/// What rank `rank` held at its peak, by the phase that allocated it, in [`PHASES`]'
/// order (taken by the thread that reached the peak; a free by another thread at that
/// instant can make the figures miss the peak by its size).
pub fn peak_by_phase(rank: usize) -> [usize; PHASES.len()] {
    let slot = (rank + 1).min(SLOTS - 1);
    std::array::from_fn(|p| COUNTS[slot].at_peak[p].load(Ordering::Relaxed).max(0) as usize)
}

/// Counts this thread's allocations as rank `rank`'s from now on, starting its peak
/// from what it holds now.
pub fn attribute_to_rank(rank: usize) {
    let slot = (rank + 1).min(SLOTS - 1);
    SLOT.with(|s| s.set(slot));
    let counts = &COUNTS[slot];
    counts
        .peak
        .store(counts.live.load(Ordering::Relaxed), Ordering::Relaxed);
    snapshot(counts);
}

fn snapshot(counts: &Slot) {
    for (held, live) in counts.at_peak.iter().zip(&counts.phases) {
        held.store(live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// The most bytes rank `rank` has held at once since [`attribute_to_rank`].
pub fn peak(rank: usize) -> usize {
    let slot = (rank + 1).min(SLOTS - 1);
    COUNTS[slot].peak.load(Ordering::Relaxed).max(0) as usize
}

/// mimalloc, counting each allocation against the rank of the thread that made it.
pub struct Counting;

/// The header before each allocation: at least 16 bytes and the alignment, so the
/// allocation keeps its alignment; the slot is in its last 8 bytes.
fn header(layout: Layout) -> usize {
    layout.align().max(16)
}

fn count(slot: usize, phase: usize, bytes: isize) {
    let counts = &COUNTS[slot];
    counts.phases[phase].fetch_add(bytes, Ordering::Relaxed);
    let live = counts.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
    if counts.peak.fetch_max(live, Ordering::Relaxed) < live {
        snapshot(counts);
    }
}

/// The header's word: the slot in the low byte, the phase in the next.
fn tag(slot: usize, phase: usize) -> u64 {
    (slot | phase << 8) as u64
}

fn untag(word: u64) -> (usize, usize) {
    let slot = (word & 0xff) as usize;
    let phase = ((word >> 8) & 0xff) as usize;
    (slot.min(SLOTS - 1), phase.min(PHASES.len() - 1))
}

/// Allocates `layout` with its header through `raw` and counts it against this thread's
/// rank.
///
/// # Safety
/// `raw` must allocate its layout as `GlobalAlloc::alloc` does.
unsafe fn allocate(layout: Layout, raw: impl FnOnce(Layout) -> *mut u8) -> *mut u8 {
    let header = header(layout);
    let Ok(inner) = Layout::from_size_align(layout.size() + header, layout.align()) else {
        return std::ptr::null_mut();
    };
    let base = raw(inner);
    if base.is_null() {
        return base;
    }
    let (slot, phase) = (this_slot(), this_phase());
    // SAFETY: the header's last 8 bytes are inside the allocation and aligned to 8.
    unsafe { base.add(header - 8).cast::<u64>().write(tag(slot, phase)) };
    count(slot, phase, layout.size() as isize);
    // SAFETY: inside the allocation.
    unsafe { base.add(header) }
}

/// The start of the mimalloc allocation behind `ptr`, the slot and phase its header
/// names and the layout it was made with.
///
/// # Safety
/// `ptr` must come from [`Counting`] with `layout`.
unsafe fn allocated(ptr: *mut u8, layout: Layout) -> (*mut u8, (usize, usize), Layout) {
    let header = header(layout);
    // SAFETY: the header precedes `ptr` in the same allocation.
    let base = unsafe { ptr.sub(header) };
    // SAFETY: `allocate` wrote the tag in the header's last 8 bytes.
    let word = unsafe { base.add(header - 8).cast::<u64>().read() };
    // Invariant, not input: `allocate` built this very layout from the same size and
    // alignment, so it is valid.
    let inner = Layout::from_size_align(layout.size() + header, layout.align())
        .expect("the layout `allocate` made");
    (base, untag(word), inner)
}

/// This thread's slot, or 0 (no rank's) for the device layer's own bookkeeping, which
/// a GPU's driver would hold.
fn this_slot() -> usize {
    match ferrotron_device::allocating_bookkeeping() {
        true => 0,
        false => SLOT.try_with(Cell::get).unwrap_or(0),
    }
}

fn this_phase() -> usize {
    PHASE.try_with(Cell::get).unwrap_or(PHASES.len() - 1)
}

// SAFETY: forwards to mimalloc with a larger layout of the same alignment and returns the
// address past the header, which keeps the caller's alignment (the header is a multiple
// of it); dealloc and realloc undo exactly that.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's.
        unsafe { allocate(layout, |inner| mimalloc::MiMalloc.alloc(inner)) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's; mimalloc hands out zeroed pages without writing them.
        unsafe { allocate(layout, |inner| mimalloc::MiMalloc.alloc_zeroed(inner)) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        let (base, (slot, phase), inner) = unsafe { allocated(ptr, layout) };
        count(slot, phase, -(layout.size() as isize));
        // SAFETY: allocated by mimalloc with `inner`.
        unsafe { mimalloc::MiMalloc.dealloc(base, inner) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let header = header(layout);
        // SAFETY: `ptr` came from this allocator with `layout`.
        let (base, (slot, phase), inner) = unsafe { allocated(ptr, layout) };
        // The size with the header must stay a valid layout size, as `realloc` requires.
        if Layout::from_size_align(new_size.saturating_add(header), layout.align()).is_err() {
            return std::ptr::null_mut();
        }
        // SAFETY: allocated by mimalloc with `inner`; the header moves with the bytes.
        let moved = unsafe { mimalloc::MiMalloc.realloc(base, inner, new_size + header) };
        if moved.is_null() {
            return moved;
        }
        count(slot, phase, new_size as isize - layout.size() as isize);
        // SAFETY: inside the allocation.
        unsafe { moved.add(header) }
    }
}
