//! Faults injected into the local backend's calls (`FaultInjector`): the armed rank's
//! call fails with `Injected` naming rank, group and call, its peers fail with a lost
//! peer naming that rank, nothing hangs, and a call over device memory that fails after
//! queuing its moves hands its buffers back with their streams ordered after those
//! moves (freeing them is then no unordered access).

use std::time::Duration;

use ferrotron_comm_core::{
    BufMut, BufRef, Communicator, CommunicatorExt, DType, Device, Error, FaultInjector,
    LocalLauncher, OpKind, ReduceOp,
};
use ferrotron_device::{DeviceMemory, Stream};

/// What each rank's failure was, by its root cause.
fn root_causes<T>(outcomes: Vec<Result<T, (u64, Error)>>) -> Vec<String> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, outcome)| match outcome {
            Ok(_) => panic!("rank {rank} succeeded"),
            Err((_, error)) => error.root_cause().to_string(),
        })
        .collect()
}

fn launcher(faults: &FaultInjector) -> LocalLauncher {
    (LocalLauncher::new(2).unwrap())
        .timeout(Duration::from_secs(20))
        .fault_injector(faults.clone())
}

#[test]
fn an_armed_collective_fails_its_rank_and_its_peers_lose_it() {
    let faults = FaultInjector::new();
    faults.arm(1, Some("world"), Some(OpKind::AllReduce));
    let outcomes = launcher(&faults).run_each(|comm| {
        let mut x = vec![1.0f32; 1 << 15];
        comm.all_gather_vec(&[1.0f32])?;
        comm.all_reduce_slice(&mut x, ReduceOp::Sum)
    });
    let causes = root_causes(outcomes);
    assert!(
        causes[1].contains("injected failure in group 'world': all_reduce (call #1) of rank 1"),
        "{}",
        causes[1]
    );
    assert!(
        causes[0].contains("peer lost") && causes[0].contains("rank 1"),
        "{}",
        causes[0]
    );
    assert_eq!(faults.armed(), 0, "the failure was spent");
}

#[test]
fn an_armed_send_fails_and_its_receiver_loses_the_sender() {
    let faults = FaultInjector::new();
    faults.arm(0, None, Some(OpKind::Send));
    let outcomes = launcher(&faults).run_each(|comm| {
        let mut x = [0i64; 3];
        match comm.rank() {
            0 => comm.send(BufRef::from(&x[..]), 1),
            _ => comm.recv(BufMut::from(&mut x[..]), 0),
        }
    });
    let causes = root_causes(outcomes);
    assert!(
        causes[0].contains("injected failure") && causes[0].contains("send"),
        "{}",
        causes[0]
    );
    assert!(causes[1].contains("peer lost"), "{}", causes[1]);
}

/// `len` f32s of `value` on `stream`.
fn filled(stream: &Stream, len: usize, value: f32) -> ferrotron_device::Result<DeviceMemory> {
    let memory = stream.alloc(4 * len)?;
    let bytes: Vec<u8> = (0..len).flat_map(|_| value.to_ne_bytes()).collect();
    // SAFETY: the allocation holds `4 * len` bytes.
    unsafe { stream.upload(memory.ptr(), &bytes)? };
    Ok(memory)
}

/// An all-reduce of emulated device memory queued on the communication stream fails on
/// one rank after its moves are queued; both ranks then free their buffers on the
/// buffers' own stream, which must be ordered after every move into or out of them: the
/// ordering checker would report the free as unordered otherwise (the stream's next
/// call fails with it).
#[test]
fn a_streamed_collective_that_fails_orders_the_frees_after_its_moves() {
    const LEN: usize = 1 << 14;
    let faults = FaultInjector::new();
    faults.arm(0, Some("world"), Some(OpKind::AllReduce));
    let outcomes = launcher(&faults).run_each(|comm| -> anyhow::Result<()> {
        let stream = Stream::new(Device::Emulated)?;
        let mut x = filled(&stream, LEN, comm.rank() as f32)?;
        let failed = comm.all_reduce(BufMut::device(&mut x, 0, LEN, DType::F32)?, ReduceOp::Sum);
        drop(x);
        let ordered = stream.synchronize();
        assert!(ordered.is_ok(), "rank {}: {ordered:?}", comm.rank());
        Ok(failed?)
    });
    let causes = root_causes(outcomes);
    assert!(causes[0].contains("injected failure"), "{}", causes[0]);
    assert!(causes[1].contains("peer lost"), "{}", causes[1]);
}
