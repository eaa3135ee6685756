//! Flat storage gives its host memory back when the last handle goes, views and leases
//! included (a counting allocator: this test binary has one test, so nothing else
//! allocates meanwhile).

#[path = "support/counting.rs"]
mod counting;

use ferrotron_tape::{Device, FlatStorage, FlatView};

#[test]
fn host_storage_is_freed_with_its_last_handle() -> ferrotron_tape::Result<()> {
    const LEN: usize = 1 << 20;
    let before = counting::live();
    let storage = FlatStorage::<f32>::zeros(Device::Cpu, LEN)?;
    let view = FlatView::new(&storage, 0, &[LEN])?;
    let lease = storage.lease()?;
    assert!(counting::live() - before >= (LEN * 4) as isize);
    drop(storage);
    drop(lease);
    assert!(
        counting::live() - before >= (LEN * 4) as isize,
        "the view holds it"
    );
    drop(view);
    assert!(
        counting::live() - before < 4096,
        "{} bytes still live",
        counting::live() - before
    );
    Ok(())
}
