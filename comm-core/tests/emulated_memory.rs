//! Views of an emulated device's memory (`Device::Emulated`, what `tape` lends for
//! `Device::Emulated` tensors): the local backend moves them exactly as host memory, and
//! a call that mixes them with host memory fails as a host/device mix does on a GPU.

use ferrotron_comm_core::{
    run_local, BufMut, BufRef, Communicator, DType, Device, Error, LocalLauncher, ReduceOp,
};

/// An emulated view of `data` (the emulator's memory is host memory).
fn emulated(data: &[f32]) -> BufRef<'_> {
    // SAFETY: `data` is valid, aligned and unshared for writes while the view lives.
    unsafe { BufRef::emulated(data.as_ptr().cast(), data.len(), DType::F32) }
}

fn emulated_mut(data: &mut [f32]) -> BufMut<'_> {
    // SAFETY: `data` is valid, aligned and exclusively borrowed while the view lives.
    unsafe { BufMut::emulated(data.as_mut_ptr().cast(), data.len(), DType::F32) }
}

#[test]
fn collectives_on_emulated_memory_equal_host_memory() {
    // 5 and 40,000 elements per rank: staged and direct paths of the local backend.
    for len in [5usize, 40_000] {
        let results = run_local(3, move |comm| -> ferrotron_comm_core::Result<_> {
            let r = comm.rank();
            let mine: Vec<f32> = (0..len).map(|i| (r * 7 + i % 13) as f32).collect();
            let (mut host_sum, mut emulated_sum) = (mine.clone(), mine.clone());
            comm.all_reduce(BufMut::from(&mut host_sum), ReduceOp::Sum)?;
            let view = emulated_mut(&mut emulated_sum);
            assert_eq!(view.memory(), Device::Emulated);
            comm.all_reduce(view, ReduceOp::Sum)?;
            let (mut host_all, mut emulated_all) = (vec![0f32; 3 * len], vec![0f32; 3 * len]);
            comm.all_gather(BufRef::from(&mine), BufMut::from(&mut host_all))?;
            comm.all_gather(emulated(&mine), emulated_mut(&mut emulated_all))?;
            // Each rank keeps one third of the elementwise maximum.
            let part = len / 3;
            let whole = &mine[..3 * part];
            let (mut host_part, mut emulated_part) = (vec![0f32; part], vec![0f32; part]);
            comm.reduce_scatter(
                BufRef::from(whole),
                BufMut::from(&mut host_part),
                ReduceOp::Max,
            )?;
            comm.reduce_scatter(
                emulated(whole),
                emulated_mut(&mut emulated_part),
                ReduceOp::Max,
            )?;
            Ok([
                (host_sum, emulated_sum),
                (host_all, emulated_all),
                (host_part, emulated_part),
            ])
        })
        .unwrap();
        for (rank, pairs) in results.into_iter().enumerate() {
            for (host, emulated) in pairs {
                assert_eq!(host, emulated, "rank {rank}, {len} elements");
            }
        }
    }
}

#[test]
fn emulated_and_host_memory_cannot_meet_in_one_call() {
    // Input emulated, output host: rejected on the calling rank before communicating.
    run_local(2, |comm| -> ferrotron_comm_core::Result<()> {
        let input = vec![1f32; 4];
        let mut output = vec![0f32; 8];
        let err = comm
            .all_gather(emulated(&input), BufMut::from(&mut output))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidBuffer { .. }), "{err}");
        assert!(err.to_string().contains("emulated"), "{err}");
        comm.barrier()
    })
    .unwrap();
    // One rank's buffer emulated, the other's host: every rank gets `Mismatch`.
    let results = LocalLauncher::new(2).unwrap().run_each(|comm| {
        let mut x = vec![1f32; 4];
        let view = if comm.rank() == 0 {
            emulated_mut(&mut x)
        } else {
            BufMut::from(&mut x)
        };
        comm.all_reduce(view, ReduceOp::Sum)
    });
    for result in results {
        let (_, err) = result.expect_err("mixed memory must fail");
        assert!(matches!(err.root_cause(), Error::Mismatch { .. }), "{err}");
    }
}

/// The device layer's allocations (what tensors hold) are viewed in place, range-checked,
/// and move exactly as host memory does.
#[test]
fn views_of_device_memory_are_checked_and_reduce_in_place() {
    use ferrotron_device::Stream;
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    let sums = run_local(2, move |comm| -> ferrotron_comm_core::Result<Vec<u8>> {
        let stream = Stream::new(Device::Emulated)?;
        let mut memory = stream.alloc(6 * 4)?;
        let mine: Vec<f32> = (0..6).map(|i| (comm.rank() * 10 + i) as f32).collect();
        // SAFETY: the allocation holds six f32s.
        unsafe { stream.upload(memory.ptr(), &bytes(&mine))? };
        // Elements 2..6 only: a window, as flat storage lends one bucket of many.
        let view = BufMut::device(&mut memory, 8, 4, DType::F32)?;
        assert_eq!(view.memory(), Device::Emulated);
        comm.all_reduce(view, ReduceOp::Sum)?;
        let mut back = vec![0u8; 6 * 4];
        // SAFETY: as above.
        unsafe { stream.download(&mut back, memory.ptr())? };
        // Past the end, or misaligned for the dtype: refused before communicating.
        for (offset, len) in [(8, 5), (2, 1), (usize::MAX - 3, 1)] {
            let Err(err) = BufRef::device(&memory, offset, len, DType::F32) else {
                panic!("{len} elements at byte {offset} were accepted");
            };
            assert!(err.to_string().contains("24-byte allocation"), "{err}");
        }
        Ok(back)
    })
    .unwrap();
    let expected = [0.0f32, 1.0, 14.0, 16.0, 18.0, 20.0];
    assert_eq!(sums[0], bytes(&expected));
    assert_eq!(sums[1], bytes(&[10.0, 11.0, 14.0, 16.0, 18.0, 20.0]));
}
