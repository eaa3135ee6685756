//! The `nccl` backend. Setup failures are tested everywhere (without libnccl or a GPU, as
//! in CI, every rank must fail promptly); the collectives need a GPU and NCCL and print
//! `skipped: <reason>` without them. Two-rank tests need two devices, or one device with
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` and NCCL ≥ 2.30.
#![cfg(feature = "cuda")]

mod support;

use anyhow::{bail, ensure, Context};
use ferrotron_comm_core::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
};
use ferrotron_comm_core::cuda::{self, Library};
use ferrotron_comm_core::{
    run_local, AsyncOp, BufMut, BufRef, Buffer, CallSignature, Communicator, DType, Element, Error,
    LocalLauncher, NcclCommunicator, OpKind, ReduceOp,
};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Far below any timeout: proves a failure was shared, not waited out.
const PROMPT: Duration = Duration::from_secs(5);

/// Long enough for a cold NCCL, short enough that a hang fails the test run.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the GPU tests cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    cuda::require(Library::Nccl, "this test")
        .err()
        .map(|e| e.to_string())
        .or_else(cuda::unavailable_reason)
}

/// Runs `body` on one rank with an NCCL communicator on GPU 0 and a new stream of it;
/// without a GPU or NCCL, says why and passes.
fn on_one_gpu(
    body: impl Fn(&NcclCommunicator, &Arc<CudaStream>) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    run_local(1, |comm| -> anyhow::Result<()> {
        let stream = cuda::context(0)?.new_stream()?;
        let nccl = NcclCommunicator::new(Arc::new(comm), 0)?.with_timeout(TEST_TIMEOUT);
        body(&nccl, &stream)
    })?;
    Ok(())
}

/// The device count when two ranks can share the GPUs: two devices, or NCCL's multi-rank
/// switch on a single one.
fn two_rank_devices() -> anyhow::Result<Option<usize>> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(None);
    }
    let count = cuda::device_count()?;
    if count < 2 && !ferrotron_comm_core::nccl::ranks_may_share_a_gpu() {
        let (a, b, c) = ferrotron_comm_core::nccl::version()?;
        println!(
            "skipped: two ranks need two GPUs (found {count}), or NCCL >= 2.30 with \
             NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL here is {a}.{b}.{c})"
        );
        return Ok(None);
    }
    Ok(Some(count))
}

#[test]
fn setup_failure_is_an_error_on_every_rank_promptly() -> anyhow::Result<()> {
    // Where NCCL and a GPU are usable, asking for a device past the last one fails instead.
    let device = match (
        cuda::require(Library::Nccl, "this test"),
        cuda::device_count(),
    ) {
        (Ok(()), Ok(count)) => count,
        _ => 0,
    };
    let started = Instant::now();
    // A hang would end as the launcher's timeout error, failing the test.
    let errors = LocalLauncher::new(2)?
        .timeout(Duration::from_secs(20))
        .run(|comm| Ok::<_, Error>(NcclCommunicator::new(Arc::new(comm), device).err()))?;
    ensure!(
        started.elapsed() < PROMPT,
        "setup took {:?}",
        started.elapsed()
    );
    for (rank, error) in errors.iter().enumerate() {
        let error = error
            .as_ref()
            .with_context(|| format!("rank {rank}: setup succeeded on device {device}"))?;
        let text = error.to_string();
        match error {
            Error::LibraryMissing { library, .. } => {
                ensure!(
                    ["libnccl.so", "libcuda.so"].contains(library),
                    "rank {rank}: {text}"
                );
                ensure!(
                    text.contains(library) && text.contains("LD_LIBRARY_PATH"),
                    "rank {rank}: {text}"
                );
            }
            Error::NoDevice { requested, .. } => {
                ensure!(*requested == device, "rank {rank}: {text}")
            }
            other => bail!("rank {rank}: unexpected error {other}"),
        }
    }
    Ok(())
}

#[test]
fn a_rank_without_its_device_fails_every_rank() -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    let missing = cuda::device_count()?;
    let errors = run_local(2, |comm| {
        let device = if comm.rank() == 1 { missing } else { 0 };
        Ok::<_, Error>(NcclCommunicator::new(Arc::new(comm), device).err())
    })?;
    match &errors[..] {
        [Some(Error::Broken { cause, .. }), Some(Error::NoDevice { requested, .. })] => {
            ensure!(*requested == missing);
            ensure!(
                cause.contains("rank 1") && cause.contains("no CUDA device"),
                "{cause}"
            );
        }
        other => bail!("expected Broken on rank 0 and NoDevice on rank 1, got {other:?}"),
    }
    Ok(())
}

#[test]
fn one_rank_collectives_match_the_reference() -> anyhow::Result<()> {
    on_one_gpu(|nccl, stream| {
        ensure!(nccl.backend() == "nccl" && nccl.size() == 1 && nccl.rank() == 0);
        check_every_dtype(nccl, stream)
    })
}

/// A blocking collective is one host wait in the device layer's count (the demo's "host
/// waits per step" includes NCCL's), and a queued one is none until it is waited for.
#[test]
fn nccl_waits_are_counted_as_host_waits() -> anyhow::Result<()> {
    let waits = || ferrotron_device::host_waits(ferrotron_device::Device::Cuda(0));
    on_one_gpu(|nccl, stream| {
        let mut x = Dev::new(stream, &[1.0f32; 256])?;
        let before = waits();
        nccl.all_reduce(BufMut::cuda(&mut x.view_mut(), stream)?, ReduceOp::Sum)?;
        ensure!(
            waits() - before == 1,
            "a blocking all-reduce: {}",
            waits() - before
        );
        let mut view = x.view_mut();
        let work = nccl.all_reduce_async(BufMut::cuda(&mut view, stream)?, ReduceOp::Sum)?;
        ensure!(
            waits() - before == 1,
            "queueing one: {}",
            waits() - before - 1
        );
        work.wait()?;
        ensure!(
            waits() - before == 2,
            "waiting for it: {}",
            waits() - before - 1
        );
        Ok(())
    })
}

/// With the signature check on, every collective (zero-element calls included) still
/// matches the reference, and a group made by `split` runs with it too.
#[test]
fn one_rank_collectives_pass_the_signature_check() -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    run_local(1, |comm| -> anyhow::Result<()> {
        let stream = cuda::context(0)?.new_stream()?;
        let nccl =
            NcclCommunicator::new_with_check(Arc::new(comm), 0, true)?.with_timeout(TEST_TIMEOUT);
        ensure!(nccl.checks_signatures());
        check_every_dtype(&nccl, &stream)?;
        let single = nccl.split(Some(0), 0, "single")?.context("member")?;
        check_collectives::<f32>(&*single, &stream)
    })?;
    Ok(())
}

/// With the signature check on, each kind of disagreement (count, op, dtype, root) is
/// `Mismatch` on every rank, naming each rank's call, and the communicator stays usable.
#[test]
fn two_ranks_with_the_check_report_each_mismatch_on_every_rank() -> anyhow::Result<()> {
    let Some(count) = two_rank_devices()? else {
        return Ok(());
    };
    run_local(2, |comm| -> anyhow::Result<()> {
        let r = comm.rank();
        let device = r % count;
        let stream = cuda::context(device)?.new_stream()?;
        let nccl = NcclCommunicator::new_with_check(Arc::new(comm), device, true)?
            .with_timeout(TEST_TIMEOUT);
        let mut floats = Dev::new(&stream, &[1.0f32; 5])?;
        let mut doubles = Dev::new(&stream, &[1.0f64; 4])?;
        let sum = ReduceOp::Sum;

        // Count: rank 1 passes five elements, rank 0 four.
        let mut view = floats.slice.slice_mut(..4 + r);
        let outcome = nccl.all_reduce(BufMut::cuda(&mut view, &stream)?, sum);
        expect_mismatch("count", outcome, |c| {
            c.op == OpKind::AllReduce && c.count == 4 + c.rank
        })?;
        // Op: rank 1 calls a barrier, rank 0 an all-reduce.
        let outcome = if r == 1 {
            nccl.barrier()
        } else {
            nccl.all_reduce(BufMut::cuda(&mut floats.view_mut(), &stream)?, sum)
        };
        expect_mismatch("op", outcome, |c| {
            c.op == [OpKind::AllReduce, OpKind::Barrier][c.rank]
        })?;
        // Dtype: rank 1 all-reduces f64, rank 0 f32, four elements each.
        let outcome = if r == 1 {
            nccl.all_reduce(BufMut::cuda(&mut doubles.view_mut(), &stream)?, sum)
        } else {
            let mut view = floats.slice.slice_mut(..4);
            nccl.all_reduce(BufMut::cuda(&mut view, &stream)?, sum)
        };
        expect_mismatch("dtype", outcome, |c| {
            c.dtype == Some([DType::F32, DType::F64][c.rank]) && c.count == 4
        })?;
        // Root: each rank names itself.
        let outcome = nccl.broadcast(BufMut::cuda(&mut floats.view_mut(), &stream)?, r);
        expect_mismatch("root", outcome, |c| c.root == Some(c.rank))?;

        // Still usable, and nothing above moved data.
        nccl.all_reduce(BufMut::cuda(&mut floats.view_mut(), &stream)?, sum)?;
        ensure_close("after the mismatches", &floats.read(&stream)?, &[2.0f32; 5])
    })?;
    Ok(())
}

/// `Mismatch` at the same call on both ranks, with `expect` true of each rank's call.
fn expect_mismatch(
    what: &str,
    outcome: ferrotron_comm_core::Result<()>,
    expect: impl Fn(&CallSignature) -> bool,
) -> anyhow::Result<()> {
    match outcome {
        Err(Error::Mismatch { calls, .. }) => {
            ensure!(calls.len() == 2, "{what}: {calls:?}");
            for (rank, call) in calls.iter().enumerate() {
                ensure!(
                    call.rank == rank && expect(call),
                    "{what}: rank {rank}'s {call}"
                );
            }
            Ok(())
        }
        other => bail!("{what}: expected Mismatch, got {other:?}"),
    }
}

/// A rank that checks signatures cannot join one that does not: creation fails on both.
#[test]
fn ranks_with_different_check_settings_fail_to_create() -> anyhow::Result<()> {
    let Some(count) = two_rank_devices()? else {
        return Ok(());
    };
    let errors = run_local(2, |comm| {
        let device = comm.rank() % count;
        let check = comm.rank() == 0;
        Ok::<_, Error>(NcclCommunicator::new_with_check(Arc::new(comm), device, check).err())
    })?;
    for (rank, error) in errors.iter().enumerate() {
        match error {
            Some(Error::Config(message)) => ensure!(
                message.contains("FERROTRON_NCCL_CHECK") && message.contains("ranks [0]"),
                "rank {rank}: {message}"
            ),
            other => bail!("rank {rank}: expected Config, got {other:?}"),
        }
    }
    Ok(())
}

/// The non-blocking calls: a compute stream ordered after the collective by `wait_on`
/// sees its result without the host waiting first; `wait` then completes it.
#[test]
fn async_collectives_order_a_compute_stream_by_event() -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    run_local(1, |comm| -> anyhow::Result<()> {
        let ctx = cuda::context(0)?;
        let (data_stream, compute) = (ctx.new_stream()?, ctx.new_stream()?);
        let nccl = NcclCommunicator::new(Arc::new(comm), 0)?.with_timeout(TEST_TIMEOUT);
        let mut x = data_stream.clone_htod(&[1.0f32, 2.0, 3.0])?;
        let mut gathered = data_stream.alloc_zeros::<f32>(3)?;
        {
            let reduce =
                nccl.all_reduce_async(BufMut::cuda(&mut x, &data_stream)?, ReduceOp::Sum)?;
            reduce.wait_on(&compute)?;
            reduce.wait()?;
        }
        let input = data_stream.clone_htod(&[4.0f32, 5.0, 6.0])?;
        let gather = nccl.all_gather_async(
            BufRef::cuda(&input, &data_stream)?,
            BufMut::cuda(&mut gathered, &data_stream)?,
        )?;
        gather.wait_on(&compute)?;
        drop(gather); // waits on the host
        ensure!(compute.clone_dtoh(&x)? == vec![1.0, 2.0, 3.0]);
        ensure!(compute.clone_dtoh(&gathered)? == vec![4.0, 5.0, 6.0]);
        Ok(())
    })?;
    Ok(())
}

/// A non-blocking call whose handle is leaked instead of waited for: freeing its buffer
/// and allocating again on the buffer's stream follows the collective on the device, so
/// the new allocation (often the same memory) keeps what was written to it.
#[test]
fn a_leaked_collective_cannot_write_into_a_later_allocation() -> anyhow::Result<()> {
    on_one_gpu(|nccl, stream| {
        // Large enough that the collective is still running when the host goes on.
        let n = 1 << 24;
        for _ in 0..3 {
            let mut x = stream.clone_htod(&vec![1.0f32; n])?;
            let work = nccl.all_reduce_async(BufMut::cuda(&mut x, stream)?, ReduceOp::Sum)?;
            std::mem::forget(work);
            drop(x);
            let y = stream.clone_htod(&vec![2.0f32; n])?;
            ensure!(stream.clone_dtoh(&y)?.iter().all(|&v| v == 2.0));
        }
        Ok(())
    })
}

#[test]
fn bad_calls_are_rejected_before_communicating() -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    let devices = cuda::device_count()?;
    run_local(1, |comm| -> anyhow::Result<()> {
        let stream = cuda::context(0)?.new_stream()?;
        let nccl = NcclCommunicator::new(Arc::new(comm), 0)?.with_timeout(TEST_TIMEOUT);
        let mut host = vec![1.0f32; 4];
        let mut x = Dev::new(&stream, &[1.0f32, 2.0, 3.0, 4.0])?;
        let mut ints = Dev::new(&stream, &[1i32, 2])?;

        let err = nccl.all_reduce(BufMut::from(&mut host), ReduceOp::Sum);
        expect_err("host buffer", err, |e| {
            matches!(e, Error::InvalidBuffer { detail, .. }
                if detail.contains("host memory") && detail.contains("BufMut::cuda"))
        })?;
        let err = nccl.all_gather(
            BufRef::from(&host),
            BufMut::cuda(&mut x.view_mut(), &stream)?,
        );
        expect_err("host input, device output", err, |e| {
            matches!(e, Error::InvalidBuffer { .. })
        })?;
        let err = nccl.all_reduce(BufMut::cuda(&mut ints.view_mut(), &stream)?, ReduceOp::Avg);
        expect_err("Avg on i32", err, |e| {
            matches!(e, Error::Unsupported { .. })
        })?;
        let err = nccl.broadcast(BufMut::cuda(&mut x.view_mut(), &stream)?, 3);
        expect_err("root 3 of 1", err, |e| {
            matches!(e, Error::InvalidArgument { .. })
        })?;
        let mut short = Dev::new(&stream, &[0.0f32; 3])?;
        let input = Dev::new(&stream, &[1.0f32; 4])?;
        let err = nccl.all_gather(
            BufRef::cuda(&input.view(), &stream)?,
            BufMut::cuda(&mut short.view_mut(), &stream)?,
        );
        expect_err("short all_gather output", err, |e| {
            matches!(e, Error::InvalidBuffer { .. })
        })?;
        let err = nccl.send(BufRef::cuda(&input.view(), &stream)?, 0);
        expect_err("send to self", err, |e| {
            matches!(e, Error::InvalidArgument { .. })
        })?;
        let op = AsyncOp::AllReduce {
            buf: Buffer::from_vec(vec![1.0f32]),
            op: ReduceOp::Sum,
        };
        let err = nccl.start(op).map(drop);
        expect_err(
            "start",
            err,
            |e| matches!(e, Error::InvalidBuffer { detail, .. } if detail.contains("host buffers")),
        )?;
        if devices >= 2 {
            let other = cuda::context(1)?.new_stream()?;
            let mut elsewhere = Dev::new(&other, &[1.0f32])?;
            let err = nccl.all_reduce(
                BufMut::cuda(&mut elsewhere.view_mut(), &other)?,
                ReduceOp::Sum,
            );
            expect_err(
                "buffer on device 1",
                err,
                |e| matches!(e, Error::InvalidBuffer { detail, .. } if detail.contains("device 1")),
            )?;
        }

        // Rejected calls leave the communicator usable.
        nccl.all_reduce(BufMut::cuda(&mut x.view_mut(), &stream)?, ReduceOp::Sum)?;
        ensure_close(
            "all_reduce after errors",
            &x.read(&stream)?,
            &[1.0, 2.0, 3.0, 4.0],
        )?;
        nccl.barrier()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn two_ranks_match_the_reference_and_split() -> anyhow::Result<()> {
    let Some(count) = two_rank_devices()? else {
        return Ok(());
    };
    run_local(2, |comm| -> anyhow::Result<()> {
        let device = comm.rank() % count;
        let stream = cuda::context(device)?.new_stream()?;
        let nccl = NcclCommunicator::new(Arc::new(comm), device)?.with_timeout(TEST_TIMEOUT);
        ensure!(nccl.size() == 2 && nccl.world_ranks() == [0, 1]);
        check_every_dtype(&nccl, &stream)?;
        check_split(&nccl, &stream)
    })?;
    Ok(())
}

/// Ranks on one GPU whose buffers are ordered on one shared stream (as tape's stream per
/// device is for rank threads) complete blocking collectives: no rank makes the shared
/// stream wait for its collective before the peer has queued the matching one. Before
/// the blocking calls waited on the host first, the demo hung so on an H200.
#[test]
fn ranks_sharing_a_gpu_and_a_stream_complete_blocking_collectives() -> anyhow::Result<()> {
    let Some(count) = two_rank_devices()? else {
        return Ok(());
    };
    if count >= 2 {
        println!("skipped: the ranks have a GPU each here, so they share no stream");
        return Ok(());
    }
    let stream = cuda::context(0)?.new_stream()?;
    run_local(2, |comm| -> anyhow::Result<()> {
        let nccl = NcclCommunicator::new(Arc::new(comm), 0)?.with_timeout(PROMPT * 4);
        let r = nccl.rank() as f32;
        let mut x = Dev::new(&stream, &[r + 1.0; 1024])?;
        let mut half = Dev::<f32>::zeros(&stream, 512)?;
        for _ in 0..50 {
            nccl.all_reduce(BufMut::cuda(&mut x.view_mut(), &stream)?, ReduceOp::Sum)?;
            nccl.reduce_scatter(
                BufRef::cuda(&x.view(), &stream)?,
                BufMut::cuda(&mut half.view_mut(), &stream)?,
                ReduceOp::Avg,
            )?;
            nccl.all_gather(
                BufRef::cuda(&half.view(), &stream)?,
                BufMut::cuda(&mut x.view_mut(), &stream)?,
            )?;
        }
        // Each round doubles the sum of 1 and 2; the average and the gather keep it.
        ensure_close(
            "after 50 rounds",
            &x.read(&stream)?,
            &[3.0 * 2f32.powi(49); 1024],
        )
    })?;
    Ok(())
}

fn check_split(comm: &NcclCommunicator, stream: &Arc<CudaStream>) -> anyhow::Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Two groups of one rank each.
    let single = comm
        .split(Some(r as u32), 0, "single")?
        .context("every rank passed a colour")?;
    ensure!(single.backend() == "nccl" && single.name() == "single");
    ensure!(single.size() == 1 && single.world_ranks() == [comm.world_ranks()[r]]);
    let mut x = Dev::new(stream, &[r as f32 + 1.0])?;
    single.all_reduce(BufMut::cuda(&mut x.view_mut(), stream)?, ReduceOp::Sum)?;
    ensure_close("single-rank group", &x.read(stream)?, &[r as f32 + 1.0])?;

    // Every rank in one group, in reverse order.
    let reversed = comm
        .split(Some(0), (n - r) as u32, "reversed")?
        .context("every rank passed a colour")?;
    ensure!(reversed.rank() == n - 1 - r);
    let mut x = Dev::new(stream, &[r as f32 + 1.0])?;
    reversed.all_reduce(BufMut::cuda(&mut x.view_mut(), stream)?, ReduceOp::Sum)?;
    let total = (n * (n + 1) / 2) as f32;
    ensure_close("reversed group", &x.read(stream)?, &[total])?;
    check_collectives::<f32>(&*reversed, stream)?;

    // Rank 0 alone; the others opt out.
    let first = comm.split((r == 0).then_some(0), 0, "first")?;
    ensure!(first.is_some() == (r == 0));
    Ok(())
}

fn check_every_dtype(comm: &dyn Communicator, stream: &Arc<CudaStream>) -> anyhow::Result<()> {
    check_collectives::<f32>(comm, stream)?;
    check_collectives::<f64>(comm, stream)?;
    check_collectives::<f16>(comm, stream)?;
    check_collectives::<bf16>(comm, stream)?;
    check_collectives::<i32>(comm, stream)?;
    check_collectives::<i64>(comm, stream)?;
    check_collectives::<u8>(comm, stream)?;
    comm.barrier()?;
    Ok(())
}

/// Every collective with `T`, against the host reference computed from every rank's
/// (deterministic) inputs.
fn check_collectives<T: Element + DeviceRepr>(
    comm: &dyn Communicator,
    stream: &Arc<CudaStream>,
) -> anyhow::Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let ops: Vec<ReduceOp> = ReduceOp::ALL
        .into_iter()
        .filter(|op| op.supports(T::DTYPE))
        .collect();
    let what = |call: &str| format!("{} {call} on rank {r} of {n}", T::DTYPE);

    for len in [0usize, 1, 7, 1000] {
        let inputs: Vec<Vec<T>> = (0..n).map(|p| support::data(p, len, len)).collect();
        for &op in &ops {
            let mut buf = Dev::new(stream, &inputs[r])?;
            comm.all_reduce(BufMut::cuda(&mut buf.view_mut(), stream)?, op)?;
            let want = support::reduced(op, &inputs);
            ensure_close(
                &what(&format!("all_reduce {op} of {len}")),
                &buf.read(stream)?,
                &want,
            )?;
        }
        for root in 0..n {
            let mut buf = Dev::new(stream, &inputs[r])?;
            comm.broadcast(BufMut::cuda(&mut buf.view_mut(), stream)?, root)?;
            let call = what(&format!("broadcast of {len} from {root}"));
            ensure_close(&call, &buf.read(stream)?, &inputs[root])?;
        }

        let input = Dev::new(stream, &inputs[r])?;
        let mut out = Dev::<T>::zeros(stream, n * len)?;
        comm.all_gather(
            BufRef::cuda(&input.view(), stream)?,
            BufMut::cuda(&mut out.view_mut(), stream)?,
        )?;
        let call = what(&format!("all_gather of {len}"));
        ensure_close(&call, &out.read(stream)?, &inputs.concat())?;

        let full: Vec<Vec<T>> = (0..n).map(|p| support::data(p, n * len, len + 1)).collect();
        for &op in &ops {
            let input = Dev::new(stream, &full[r])?;
            let mut out = Dev::<T>::zeros(stream, len)?;
            comm.reduce_scatter(
                BufRef::cuda(&input.view(), stream)?,
                BufMut::cuda(&mut out.view_mut(), stream)?,
                op,
            )?;
            let want = support::reduced(op, &full)[r * len..(r + 1) * len].to_vec();
            let call = what(&format!("reduce_scatter {op} of {len}"));
            ensure_close(&call, &out.read(stream)?, &want)?;
        }
    }

    // Uneven per-rank counts, zeros included.
    let count_sets: [Vec<usize>; 3] = [
        vec![0; n],
        (0..n).map(|p| (p * 5 + 3) % 7).collect(),
        (0..n).map(|p| if p == 0 { 0 } else { p + 2 }).collect(),
    ];
    for counts in &count_sets {
        let total: usize = counts.iter().sum();
        let offsets = support::offsets(counts);
        let parts: Vec<Vec<T>> = (0..n).map(|p| support::data(p, counts[p], 3)).collect();
        let input = Dev::new(stream, &parts[r])?;
        let mut out = Dev::<T>::zeros(stream, total)?;
        comm.all_gather_v(
            BufRef::cuda(&input.view(), stream)?,
            BufMut::cuda(&mut out.view_mut(), stream)?,
            counts,
        )?;
        let call = what(&format!("all_gather_v of {counts:?}"));
        ensure_close(&call, &out.read(stream)?, &parts.concat())?;

        let full: Vec<Vec<T>> = (0..n).map(|p| support::data(p, total, 4)).collect();
        for &op in &ops {
            let input = Dev::new(stream, &full[r])?;
            let mut out = Dev::<T>::zeros(stream, counts[r])?;
            comm.reduce_scatter_v(
                BufRef::cuda(&input.view(), stream)?,
                BufMut::cuda(&mut out.view_mut(), stream)?,
                counts,
                op,
            )?;
            let block = offsets[r]..offsets[r] + counts[r];
            let want = support::reduced(op, &full)[block].to_vec();
            let call = what(&format!("reduce_scatter_v {op} of {counts:?}"));
            ensure_close(&call, &out.read(stream)?, &want)?;
        }
    }

    // Rank p sends `sends(p, q)` elements to rank q (one to itself on a single rank).
    let sends = |p: usize, q: usize| (p + 2 * q + 1) % 3;
    let send_counts: Vec<usize> = (0..n).map(|q| sends(r, q)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|p| sends(p, r)).collect();
    let all_inputs: Vec<Vec<T>> = (0..n)
        .map(|p| support::data(p, (0..n).map(|q| sends(p, q)).sum(), 5))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|p| {
            let start: usize = (0..r).map(|q| sends(p, q)).sum();
            all_inputs[p][start..start + sends(p, r)].to_vec()
        })
        .collect();
    let input = Dev::new(stream, &all_inputs[r])?;
    let mut out = Dev::<T>::zeros(stream, want.len())?;
    comm.all_to_all_v(
        BufRef::cuda(&input.view(), stream)?,
        &send_counts,
        BufMut::cuda(&mut out.view_mut(), stream)?,
        &recv_counts,
    )?;
    ensure_close(&what("all_to_all_v"), &out.read(stream)?, &want)?;

    // Ranks 0 and 1 swap a message; the lower rank sends first.
    if n >= 2 && r < 2 {
        let peer = 1 - r;
        let mine = Dev::new(stream, &support::data::<T>(r, 5, 9))?;
        let mut got = Dev::<T>::zeros(stream, 5)?;
        let send = || comm.send(BufRef::cuda(&mine.view(), stream)?, peer);
        if r == 0 {
            send()?;
            comm.recv(BufMut::cuda(&mut got.view_mut(), stream)?, peer)?;
        } else {
            comm.recv(BufMut::cuda(&mut got.view_mut(), stream)?, peer)?;
            send()?;
        }
        let want = support::data::<T>(peer, 5, 9);
        ensure_close(&what("send/recv"), &got.read(stream)?, &want)?;
    }
    Ok(())
}

/// Device memory holding `len` elements. CUDA cannot allocate zero bytes, so an empty
/// buffer is one padding element that the views leave out.
struct Dev<T> {
    slice: CudaSlice<T>,
    len: usize,
}

impl<T: Element + DeviceRepr> Dev<T> {
    fn new(stream: &Arc<CudaStream>, data: &[T]) -> anyhow::Result<Dev<T>> {
        let padded = if data.is_empty() {
            vec![T::default()]
        } else {
            data.to_vec()
        };
        Ok(Dev {
            slice: stream.clone_htod(padded.as_slice())?,
            len: data.len(),
        })
    }

    fn zeros(stream: &Arc<CudaStream>, len: usize) -> anyhow::Result<Dev<T>> {
        Dev::new(stream, &vec![T::default(); len])
    }

    fn view(&self) -> CudaView<'_, T> {
        self.slice.slice(..self.len)
    }

    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(..self.len)
    }

    fn read(&self, stream: &Arc<CudaStream>) -> anyhow::Result<Vec<T>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        Ok(stream.clone_dtoh(&self.view())?)
    }
}

/// Exact for integers; a relative tolerance for floats (the inputs are small integers, so
/// results are exact in every dtype, but NCCL's Avg may scale before summing).
fn ensure_close<T: Element>(what: &str, got: &[T], want: &[T]) -> anyhow::Result<()> {
    let tolerance = match T::DTYPE {
        DType::F16 | DType::BF16 => 1e-2,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        DType::I32 | DType::I64 | DType::U8 => 0.0,
    };
    ensure!(
        got.len() == want.len(),
        "{what}: {} elements, expected {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), w.to_f64());
        ensure!(
            (g - w).abs() <= tolerance * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
    Ok(())
}

fn expect_err(
    what: &str,
    result: ferrotron_comm_core::Result<()>,
    expected: impl Fn(&Error) -> bool,
) -> anyhow::Result<()> {
    match result {
        Err(e) if expected(&e) => Ok(()),
        Err(e) => bail!("{what}: unexpected error {e}"),
        Ok(()) => bail!("{what}: succeeded, expected an error"),
    }
}

/// Device memory lent to an owned buffer, as tape's flat storage lends a bucket.
#[derive(Debug)]
struct LentSlice {
    slice: CudaSlice<f32>,
    stream: Arc<CudaStream>,
}

impl ferrotron_comm_core::LentMemory for LentSlice {
    fn view(&self) -> BufRef<'_> {
        BufRef::cuda(&self.slice, &self.stream).expect("the slice lives on its stream's device")
    }
    fn view_mut(&mut self) -> BufMut<'_> {
        BufMut::cuda(&mut self.slice, &self.stream).expect("the slice lives on its stream's device")
    }
}

/// Calls recorded for this rank on `comm`.
fn recorded(comm: &dyn Communicator) -> usize {
    let record = comm.flight_record();
    record
        .ranks
        .iter()
        .filter(|history| history.rank == comm.rank())
        .map(|history| history.calls.len())
        .sum()
}

/// A dual communicator over (local, NCCL) sends host memory to the local half and device
/// memory to NCCL, blocking and non-blocking (lent device memory, as DDP's buckets and the
/// distributed optimizer's shards).
#[test]
fn a_dual_communicator_routes_device_memory_to_nccl() -> anyhow::Result<()> {
    if let Some(reason) = skip_reason() {
        println!("skipped: {reason}");
        return Ok(());
    }
    run_local(1, |comm| -> anyhow::Result<()> {
        let stream = cuda::context(0)?.new_stream()?;
        let host: Arc<dyn Communicator> = Arc::new(comm);
        let nccl: Arc<dyn Communicator> =
            Arc::new(NcclCommunicator::new(host.clone(), 0)?.with_timeout(TEST_TIMEOUT));
        let dual = ferrotron_comm_core::DualCommunicator::new(host.clone(), nccl.clone())?;
        let (host_calls, nccl_calls) = (recorded(host.as_ref()), recorded(nccl.as_ref()));

        let mut on_host = [1.0f32];
        dual.all_reduce(BufMut::from(&mut on_host[..]), ReduceOp::Sum)?;
        let mut x = stream.clone_htod(&[1.0f32, 2.0])?;
        dual.all_reduce(BufMut::cuda(&mut x, &stream)?, ReduceOp::Sum)?;
        let lent = Buffer::lent(Box::new(LentSlice {
            slice: stream.clone_htod(&[3.0f32])?,
            stream: stream.clone(),
        }));
        let back = dual
            .start(AsyncOp::AllReduce {
                buf: lent,
                op: ReduceOp::Sum,
            })?
            .wait()?;
        ensure!(back.memory() == ferrotron_comm_core::Device::Cuda(0));
        // From one lent buffer into another, as the distributed optimizer's shards.
        let lend = |values: &[f32]| -> anyhow::Result<Buffer> {
            Ok(Buffer::lent(Box::new(LentSlice {
                slice: stream.clone_htod(values)?,
                stream: stream.clone(),
            })))
        };
        let read = |buffer: Buffer| -> anyhow::Result<Vec<f32>> {
            let memory: Box<dyn std::any::Any> = buffer
                .into_lent()
                .map_err(|_| anyhow::anyhow!("a host buffer came back"))?;
            let lent = memory
                .downcast::<LentSlice>()
                .map_err(|_| anyhow::anyhow!("other memory came back"))?;
            Ok(stream.clone_dtoh(&lent.slice)?)
        };
        let scattered = dual.start(AsyncOp::ReduceScatterInto {
            input: lend(&[4.0, 5.0])?,
            output: lend(&[0.0, 0.0])?,
            op: ReduceOp::Sum,
        })?;
        let gathered = dual.start(AsyncOp::AllGatherInto {
            input: lend(&[6.0])?,
            output: lend(&[0.0])?,
        })?;
        ensure!(read(scattered.wait()?)? == vec![4.0, 5.0]);
        ensure!(read(gathered.wait()?)? == vec![6.0]);
        let calls = |comm: &Arc<dyn Communicator>, before| {
            let record = comm.flight_record();
            (recorded(comm.as_ref()) - before, format!("{record:?}"))
        };
        let (on_host, record) = calls(&host, host_calls);
        ensure!(on_host == 1, "one host call, not {on_host}: {record}");
        let (on_device, record) = calls(&nccl, nccl_calls);
        ensure!(
            on_device == 4,
            "four device calls, not {on_device}: {record}"
        );
        ensure!(stream.clone_dtoh(&x)? == vec![1.0, 2.0]);
        Ok(())
    })?;
    Ok(())
}
