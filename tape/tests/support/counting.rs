//! A global allocator that counts the bytes live in the test binary. Include it only in
//! a binary with one test, so that nothing else allocates while it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator and only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        PEAK.fetch_max(live + layout.size() as isize, Ordering::SeqCst);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated and not yet freed.
pub fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// The most bytes live at once since the last [`reset_peak`].
#[allow(dead_code)] // not every test binary that counts asks for the peak
pub fn peak() -> isize {
    PEAK.load(Ordering::SeqCst)
}

/// Starts a new [`peak`] from what is live now.
#[allow(dead_code)]
pub fn reset_peak() {
    PEAK.store(live(), Ordering::SeqCst);
}
