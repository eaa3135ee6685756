//! `FERROTRON_EMULATED_JITTER=<seed>`: the emulated streams' workers sleep at random
//! before their calls, and work ordered by events still comes out exact; a value that is
//! not a seed is refused when a stream is made. One test in this binary, as it sets the
//! process's environment.

use ferrotron_device::{Access, Device, Error, Stream};

const ROUNDS: usize = 200;

#[test]
fn jittered_streams_ordered_by_events_give_exact_results() -> ferrotron_device::Result<()> {
    std::env::set_var("FERROTRON_EMULATED_JITTER", "seven");
    let error = Stream::new(Device::Emulated).unwrap_err();
    assert!(
        matches!(&error, Error::Invalid { reason, .. } if reason.contains("FERROTRON_EMULATED_JITTER=\"seven\"")),
        "{error}"
    );

    std::env::set_var("FERROTRON_EMULATED_JITTER", "7");
    let (first, second) = (
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    );
    let (value, slots) = (first.alloc(4)?, first.alloc(4 * ROUNDS)?);
    second.wait(&first.record()?)?;
    for round in 0..ROUNDS {
        // The first stream writes the round's value; the second copies it into its slot
        // after an event; the first overwrites it only after the second's copy.
        let dst = value.ptr() as usize;
        first.queue_host("write", &[Access::write(value.ptr(), 4)], move || {
            let bytes = (round as u32).to_ne_bytes();
            // SAFETY: `value` holds 4 bytes and outlives the streams' work.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, 4) }
        })?;
        second.wait(&first.record()?)?;
        // SAFETY: both ranges lie inside their allocations.
        unsafe { second.copy(slots.ptr() + 4 * round as u64, value.ptr(), 4)? };
        first.wait(&second.record()?)?;
    }
    let mut back = vec![0u8; 4 * ROUNDS];
    // SAFETY: `slots` holds 4 · ROUNDS bytes; the first stream waited for every copy.
    unsafe { first.download(&mut back, slots.ptr())? };
    let got: Vec<u32> = back
        .chunks(4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(got, (0..ROUNDS as u32).collect::<Vec<_>>());
    Ok(())
}
