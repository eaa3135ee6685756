//! The MPI backend's flight recorder as one rank sees it (`cargo test --features mpi` runs
//! it as a single rank; under `mpirun -n N` every rank checks its own record).
#![cfg(feature = "mpi")]

use ferrotron_comm_core::mpi::MpiWorld;
use ferrotron_comm_core::{CallState, Communicator, CommunicatorExt, DType, OpKind, ReduceOp};

#[test]
fn an_mpi_communicator_records_its_own_calls() {
    let mpi = MpiWorld::init().unwrap();
    let world = mpi.world().unwrap();
    let mut x = [1.0f32; 3];
    world.all_reduce_slice(&mut x, ReduceOp::Sum).unwrap();
    world.broadcast_slice(&mut x, 0).unwrap();
    world.barrier().unwrap();
    let record = world.flight_record();
    assert_eq!(record.ranks.len(), 1, "{record:?}");
    let mine = &record.ranks[0];
    assert_eq!((mine.rank, mine.world_rank), (world.rank(), world.rank()));
    let calls: Vec<(OpKind, u64, CallState)> =
        mine.calls.iter().map(|c| (c.op, c.seq, c.state)).collect();
    assert_eq!(
        calls,
        [
            (OpKind::AllReduce, 0, CallState::Completed),
            (OpKind::Broadcast, 1, CallState::Completed),
            (OpKind::Barrier, 2, CallState::Completed),
        ]
    );
    assert_eq!(mine.calls[0].dtype, Some(DType::F32));
    assert_eq!(mine.calls[0].count, 3);
    assert_eq!(mine.calls[1].root, Some(0));
}
