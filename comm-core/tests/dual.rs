//! A dual communicator sends host-memory calls to its host communicator and device
//! memory (the emulated device's too) to its device communicator, splits both halves
//! together or opens each group's device half when first used, and refuses pairs of
//! different ranks. Over NCCL: `gpu_nccl.rs`.

use std::sync::Arc;

use ferrotron_comm_core::{
    run_local, BufMut, BufRef, Communicator, CommunicatorExt, DType, DualCommunicator, Error, P2p,
    ReduceOp,
};

/// Calls this rank has made on `comm`, as its flight record shows them.
fn calls(comm: &dyn Communicator) -> usize {
    let record = comm.flight_record();
    record.ranks[comm.rank()].calls.len()
}

#[test]
fn host_memory_goes_to_the_host_half_and_splits_keep_the_pair() -> anyhow::Result<()> {
    run_local(4, |comm| -> anyhow::Result<()> {
        let host: Arc<dyn Communicator> = Arc::new(comm);
        let device = host
            .split(Some(0), host.rank() as u32, "device")?
            .expect("every rank joins");
        let dual = DualCommunicator::new(host.clone(), device.clone())?;
        assert_eq!(
            (dual.rank(), dual.size(), dual.name()),
            (host.rank(), 4, "device")
        );
        let (host_before, device_before) = (calls(host.as_ref()), calls(device.as_ref()));

        let mut x = [1.0f32, 2.0];
        dual.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        assert_eq!(x, [4.0, 8.0]);
        let gathered = dual.all_gather_vec(&[dual.rank() as i32])?;
        assert_eq!(gathered, [0, 1, 2, 3]);
        let work = dual.all_reduce_async(vec![1.0f64], ReduceOp::Sum)?;
        assert_eq!(work.wait()?.into_vec::<f64>()?, [4.0]);
        dual.barrier()?;
        assert_eq!(calls(host.as_ref()) - host_before, 4);
        assert_eq!(
            calls(device.as_ref()),
            device_before,
            "no host call on the device half"
        );

        // Halves split together: pairs of ranks, still host-routed.
        let pair = dual
            .split(Some(dual.rank() as u32 / 2), 0, "pair")?
            .expect("every rank joins");
        assert_eq!((pair.size(), pair.name()), (2, "pair"));
        let mut y = [dual.rank() as f32];
        pair.all_reduce_slice(&mut y, ReduceOp::Max)?;
        assert_eq!(y[0], (dual.rank() | 1) as f32);
        Ok(())
    })?;
    Ok(())
}

#[test]
fn pairs_of_other_ranks_are_refused_and_exchanges_run_on_the_host_half() -> anyhow::Result<()> {
    run_local(2, |comm| -> anyhow::Result<()> {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let alone = world
            .split(Some(world.rank() as u32), 0, "alone")?
            .expect("every rank joins");
        let refused = DualCommunicator::new(world.clone(), alone).unwrap_err();
        assert!(matches!(refused, Error::Config(_)), "{refused}");

        let dual = DualCommunicator::new(world.clone(), world.clone())?;
        let peer = 1 - dual.rank();
        let send = [1.0f32];
        let mut recv = [0.0f32];
        let mut ops = [
            P2p::Send {
                buf: BufRef::from(&send[..]),
                peer,
            },
            P2p::Recv {
                buf: BufMut::from(&mut recv[..]),
                peer,
            },
        ];
        dual.exchange(&mut ops)?;
        assert_eq!(recv, [1.0]);
        Ok(())
    })?;
    Ok(())
}

/// `values` in emulated device memory on `stream`.
fn on_device(
    stream: &ferrotron_device::Stream,
    values: &[f32],
) -> ferrotron_device::Result<ferrotron_device::DeviceMemory> {
    let memory = stream.alloc(4 * values.len())?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    // SAFETY: the allocation holds the bytes.
    unsafe { stream.upload(memory.ptr(), &bytes)? };
    Ok(memory)
}

fn read(memory: &ferrotron_device::DeviceMemory, len: usize) -> ferrotron_device::Result<Vec<f32>> {
    let mut bytes = vec![0u8; 4 * len];
    // SAFETY: the allocation holds `len` f32s.
    unsafe { memory.stream().download(&mut bytes, memory.ptr())? };
    Ok(bytes
        .chunks(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect())
}

/// `ranks` rank threads whose collectives wait at most `seconds`.
fn launcher(ranks: usize, seconds: u64) -> ferrotron_comm_core::LocalLauncher {
    let launcher = ferrotron_comm_core::LocalLauncher::new(ranks).expect("ranks > 0");
    launcher.timeout(std::time::Duration::from_secs(seconds))
}

/// A lazily opening dual world over `comm` (each group's device half a split of its
/// host half, as on the emulated device), and this rank.
fn opening_world(
    comm: ferrotron_comm_core::LocalCommunicator,
) -> ferrotron_comm_core::Result<(DualCommunicator, usize)> {
    let host: Arc<dyn Communicator> = Arc::new(comm);
    let rank = host.rank();
    let world = DualCommunicator::opening(host.clone(), host, DualCommunicator::split_opener())?;
    Ok((world, rank))
}

/// A lazily opening dual world splits only host halves; a group opens its device half at
/// its first call on device memory (once), a group of one rank never does, and a chain
/// of exchanges that mix host headers with device data (a pipeline's first sends and
/// receives, each rank waiting for the one before) opens the device half before the
/// host transfers, so the ranks meet in the opening instead of deadlocking.
#[test]
fn groups_open_their_device_half_when_first_used_and_alone_never() -> anyhow::Result<()> {
    use ferrotron_comm_core::Device;
    let opened = launcher(4, 20).run(|comm| -> anyhow::Result<Vec<String>> {
        let (world, rank) = opening_world(comm)?;
        let split = |color: usize, name| -> anyhow::Result<Arc<dyn Communicator>> {
            let group = world.split(Some(color as u32), rank as u32, name)?;
            Ok(group.expect("every rank joins"))
        };
        let (pair, alone, chain) = (
            split(rank / 2, "pair")?,
            split(rank, "alone")?,
            split(0, "chain")?,
        );
        assert!(world.opened().is_empty(), "splitting opens nothing");

        let mut host_sum = [1.0f32];
        pair.all_reduce_slice(&mut host_sum, ReduceOp::Sum)?;
        assert!(world.opened().is_empty(), "host memory opens nothing");

        let stream = ferrotron_device::Stream::new(Device::Emulated)?;
        let mut x = on_device(&stream, &[rank as f32])?;
        for _ in 0..2 {
            pair.all_reduce(BufMut::device(&mut x, 0, 1, DType::F32)?, ReduceOp::Sum)?;
        }
        let pair_sum = (rank / 2 * 4 + 1) as f32 * 2.0;
        assert_eq!(read(&x, 1)?, [pair_sum]);
        alone.all_reduce(BufMut::device(&mut x, 0, 1, DType::F32)?, ReduceOp::Sum)?;
        assert_eq!(read(&x, 1)?, [pair_sum]);

        // Rank r receives from r − 1, then sends on to r + 1, header and data.
        let mut data = on_device(&stream, &[0.0])?;
        if rank > 0 {
            let mut header = [0i64];
            chain.exchange(&mut [
                P2p::Recv {
                    buf: BufMut::from(&mut header[..]),
                    peer: rank - 1,
                },
                P2p::Recv {
                    buf: BufMut::device(&mut data, 0, 1, DType::F32)?,
                    peer: rank - 1,
                },
            ])?;
            assert_eq!(header, [rank as i64 - 1]);
        } else {
            data = on_device(&stream, &[7.0])?;
        }
        if rank < 3 {
            let header = [rank as i64];
            chain.exchange(&mut [
                P2p::Send {
                    buf: BufRef::from(&header[..]),
                    peer: rank + 1,
                },
                P2p::Send {
                    buf: BufRef::device(&data, 0, 1, DType::F32)?,
                    peer: rank + 1,
                },
            ])?;
        }
        assert_eq!(read(&data, 1)?, [7.0]);
        Ok(world.opened())
    })?;
    for (rank, groups) in opened.into_iter().enumerate() {
        assert_eq!(groups, ["pair", "chain"], "rank {rank}");
    }
    Ok(())
}

/// Opening a group's device half is collective and tried once: when it fails, the call
/// that opened it returns the opener's error and every later call fails at once, naming
/// it, without calling the opener again (ranks that retried at different calls would
/// wait for each other in the opening until the timeout).
#[test]
fn a_failed_opening_is_not_retried_and_every_later_call_names_it() -> anyhow::Result<()> {
    use ferrotron_comm_core::Device;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let attempts = run_local(2, |comm| -> anyhow::Result<usize> {
        let host: Arc<dyn Communicator> = Arc::new(comm);
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let opener = Box::new(move |group: &Arc<dyn Communicator>| {
            // Fails the first time only: a retry would succeed on this rank alone.
            match counted.fetch_add(1, Ordering::SeqCst) {
                0 => Err(Error::Config(format!(
                    "no device link for '{}'",
                    group.name()
                ))),
                _ => DualCommunicator::split_opener()(group),
            }
        });
        let world = DualCommunicator::opening(host.clone(), host, opener)?;
        let pair = world.split(Some(0), 0, "pair")?.expect("every rank joins");
        let stream = ferrotron_device::Stream::new(Device::Emulated)?;
        let mut x = on_device(&stream, &[1.0])?;
        let first = pair.all_reduce(BufMut::device(&mut x, 0, 1, DType::F32)?, ReduceOp::Sum);
        let first = first.expect_err("the opening fails").to_string();
        assert!(first.contains("no device link for 'pair'"), "{first}");
        for _ in 0..2 {
            let again = pair.all_reduce(BufMut::device(&mut x, 0, 1, DType::F32)?, ReduceOp::Sum);
            match again.expect_err("a failed opening stays failed") {
                Error::Broken { group, cause } => {
                    assert_eq!(group, "pair");
                    assert!(cause.contains("no device link for 'pair'"), "{cause}");
                }
                other => panic!("expected Broken, got {other}"),
            }
        }
        assert!(world.opened().is_empty());
        Ok(tries.load(Ordering::SeqCst))
    })?;
    assert_eq!(
        attempts,
        [1, 1],
        "each rank tried to open the device half once"
    );
    Ok(())
}

/// A batch that mixes host and device transfers posts every send of both halves before
/// it waits for anything, as any batch does: rank 0 sends a header and its data and
/// receives the reply in one batch, while rank 1 receives alone and replies in a later
/// batch (GPipe's turn from forwards to backwards). Sending the host half's batch (and
/// waiting for its receives) before the device half's sends went out hung here until
/// the timeout.
#[test]
fn a_mixed_batch_posts_its_device_sends_before_waiting_for_host_receives() -> anyhow::Result<()> {
    use ferrotron_comm_core::Device;
    let replies = launcher(2, 10).run(|comm| -> anyhow::Result<Vec<f32>> {
        let (world, rank) = opening_world(comm)?;
        let pair = world
            .split(Some(0), rank as u32, "pair")?
            .expect("every rank joins");
        let stream = ferrotron_device::Stream::new(Device::Emulated)?;
        let (mut header, mut data) = ([rank as i64], on_device(&stream, &[rank as f32 + 1.0])?);
        if rank == 0 {
            let mut reply_header = [0i64];
            let mut reply = on_device(&stream, &[0.0])?;
            pair.exchange(&mut [
                P2p::Send {
                    buf: BufRef::from(&header[..]),
                    peer: 1,
                },
                P2p::Send {
                    buf: BufRef::device(&data, 0, 1, DType::F32)?,
                    peer: 1,
                },
                P2p::Recv {
                    buf: BufMut::from(&mut reply_header[..]),
                    peer: 1,
                },
                P2p::Recv {
                    buf: BufMut::device(&mut reply, 0, 1, DType::F32)?,
                    peer: 1,
                },
            ])?;
            assert_eq!(reply_header, [1]);
            return Ok(read(&reply, 1)?);
        }
        pair.exchange(&mut [
            P2p::Recv {
                buf: BufMut::from(&mut header[..]),
                peer: 0,
            },
            P2p::Recv {
                buf: BufMut::device(&mut data, 0, 1, DType::F32)?,
                peer: 0,
            },
        ])?;
        assert_eq!((header, read(&data, 1)?), ([0], vec![1.0]));
        let (reply_header, reply) = ([1i64], on_device(&stream, &[2.0])?);
        pair.exchange(&mut [
            P2p::Send {
                buf: BufRef::from(&reply_header[..]),
                peer: 0,
            },
            P2p::Send {
                buf: BufRef::device(&reply, 0, 1, DType::F32)?,
                peer: 0,
            },
        ])?;
        Ok(Vec::new())
    })?;
    assert_eq!(replies[0], [2.0]);
    Ok(())
}
