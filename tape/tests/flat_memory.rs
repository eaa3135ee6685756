//! Flat storage gives its host memory back when the last handle goes, views and leases
//! included (a counting allocator: this test binary has one test, so nothing else
//! allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use tape::{Device, FlatStorage, FlatView};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator and only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
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

#[test]
fn host_storage_is_freed_with_its_last_handle() -> tape::Result<()> {
    const LEN: usize = 1 << 20;
    let before = LIVE.load(Ordering::SeqCst);
    let storage = FlatStorage::<f32>::zeros(Device::Cpu, LEN)?;
    let view = FlatView::new(&storage, 0, &[LEN])?;
    let lease = storage.lease()?;
    assert!(LIVE.load(Ordering::SeqCst) - before >= (LEN * 4) as isize);
    drop(storage);
    drop(lease);
    assert!(
        LIVE.load(Ordering::SeqCst) - before >= (LEN * 4) as isize,
        "the view holds it"
    );
    drop(view);
    assert!(
        LIVE.load(Ordering::SeqCst) - before < 4096,
        "{} bytes still live",
        LIVE.load(Ordering::SeqCst) - before
    );
    Ok(())
}
