//! A dual communicator sends host-memory calls (emulated device memory included) to its
//! host communicator, splits both halves together, and refuses pairs of different ranks.
//! Routing device memory to the other half needs CUDA memory: `gpu_nccl.rs`.

use std::sync::Arc;

use ferrotron_comm_core::{
    run_local, BufMut, BufRef, Communicator, CommunicatorExt, DualCommunicator, Error, P2p,
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
