//! The local backend over CUDA buffers: every collective, dtype and reduction on device
//! memory must give exactly what the same call gives on host memory (the host path is
//! itself checked against a sequential reference in `collectives.rs` and
//! `point_to_point.rs`).
//!
//! Needs a GPU; without one each test prints `skipped: <reason>` and passes. Ranks are
//! threads on device `rank % device_count`, so one GPU runs every group size.
#![cfg(feature = "cuda")]

mod support;

use anyhow::{ensure, Context as _};
use ferrotron_comm_core::cuda::{self, cudarc::driver::CudaStream};
use ferrotron_comm_core::{
    run_local, with_dtype, BufMut, BufRef, Communicator, DType, Device, Element, Error, P2p,
    ReduceOp,
};
use std::sync::Arc;

/// Device count, or `None` after printing why GPU tests cannot run here.
fn devices() -> Option<usize> {
    if let Some(reason) = cuda::unavailable_reason() {
        println!("skipped: {reason}");
        return None;
    }
    cuda::device_count().ok()
}

fn stream_for(rank: usize, devices: usize) -> anyhow::Result<Arc<CudaStream>> {
    Ok(cuda::context(rank % devices)?.new_stream()?)
}

#[derive(Clone, Copy, Debug)]
enum Case {
    AllReduce(ReduceOp),
    Broadcast,
    AllGather,
    AllGatherV,
    ReduceScatter(ReduceOp),
    ReduceScatterV(ReduceOp),
    AllToAllV,
    SendRecv,
    /// A ring: each rank sends to its right and receives from its left in one batch.
    Exchange,
}

/// Uneven per-rank counts (one rank may get nothing).
fn uneven(len: usize, n: usize) -> Vec<usize> {
    (0..n).map(|r| (len * (r + 1) / n) % (len + 1)).collect()
}

/// Elements rank `src` sends to rank `dst` in the all-to-all case.
fn a2a(len: usize, src: usize, dst: usize) -> usize {
    (len / 3) * ((src + 2 * dst) % 3)
}

/// Input length, output length and whether the output starts as a copy of the input.
fn shape(case: Case, len: usize, rank: usize, n: usize) -> (usize, usize, bool) {
    match case {
        Case::AllReduce(_) | Case::Broadcast | Case::SendRecv => (len, len, true),
        Case::Exchange => (len, len, false),
        Case::AllGather => (len, len * n, false),
        Case::AllGatherV => {
            let counts = uneven(len, n);
            (counts[rank], counts.iter().sum(), false)
        }
        Case::ReduceScatter(_) => (len * n, len, false),
        Case::ReduceScatterV(_) => {
            let counts = uneven(len, n);
            (counts.iter().sum(), counts[rank], false)
        }
        Case::AllToAllV => (
            (0..n).map(|d| a2a(len, rank, d)).sum(),
            (0..n).map(|s| a2a(len, s, rank)).sum(),
            false,
        ),
    }
}

fn call(
    comm: &dyn Communicator,
    case: Case,
    len: usize,
    input: BufRef<'_>,
    output: BufMut<'_>,
) -> ferrotron_comm_core::Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    match case {
        Case::AllReduce(op) => comm.all_reduce(output, op),
        Case::Broadcast => comm.broadcast(output, n - 1),
        Case::AllGather => comm.all_gather(input, output),
        Case::AllGatherV => comm.all_gather_v(input, output, &uneven(len, n)),
        Case::ReduceScatter(op) => comm.reduce_scatter(input, output, op),
        Case::ReduceScatterV(op) => comm.reduce_scatter_v(input, output, &uneven(len, n), op),
        Case::AllToAllV => {
            let sends: Vec<usize> = (0..n).map(|d| a2a(len, rank, d)).collect();
            let recvs: Vec<usize> = (0..n).map(|s| a2a(len, s, rank)).collect();
            comm.all_to_all_v(input, &sends, output, &recvs)
        }
        // Pairs (0 → 1), (2 → 3): the receiver's output becomes the sender's data.
        Case::SendRecv if n % 2 == 0 && rank % 2 == 0 => comm.send(input, rank + 1),
        Case::SendRecv if n % 2 == 0 => comm.recv(output, rank - 1),
        Case::SendRecv => Ok(()),
        Case::Exchange if n > 1 => comm.exchange(&mut [
            P2p::Send {
                buf: input,
                peer: (rank + 1) % n,
            },
            P2p::Recv {
                buf: output,
                peer: (rank + n - 1) % n,
            },
        ]),
        Case::Exchange => Ok(()),
    }
}

/// Runs `case` on host memory and on device memory and returns both outputs.
fn host_and_device<T>(
    comm: &dyn Communicator,
    stream: &Arc<CudaStream>,
    case: Case,
    len: usize,
) -> anyhow::Result<(Vec<T>, Vec<T>)>
where
    T: Element + cuda::cudarc::driver::DeviceRepr + cuda::cudarc::driver::ValidAsZeroBits,
{
    let (rank, n) = (comm.rank(), comm.size());
    let (in_len, out_len, inout) = shape(case, len, rank, n);
    let input: Vec<T> = support::data(rank, in_len, len);
    let initial = if inout {
        input.clone()
    } else {
        vec![T::default(); out_len]
    };

    let mut host = initial.clone();
    call(
        comm,
        case,
        len,
        BufRef::from(&input),
        BufMut::from(&mut host),
    )?;

    let device_input = stream.clone_htod(&input)?;
    let mut device_output = stream.clone_htod(&initial)?;
    let input_view = BufRef::cuda(&device_input, stream)?;
    let output_view = BufMut::cuda(&mut device_output, stream)?;
    ensure!(output_view.memory() == Device::Cuda(stream.context().ordinal()));
    call(comm, case, len, input_view, output_view)?;
    let device = stream.clone_dtoh(&device_output)?;
    Ok((host, device))
}

fn cases(dtype: DType) -> Vec<Case> {
    let mut cases = vec![
        Case::Broadcast,
        Case::AllGather,
        Case::AllGatherV,
        Case::AllToAllV,
        Case::SendRecv,
        Case::Exchange,
    ];
    for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
        cases.extend([
            Case::AllReduce(op),
            Case::ReduceScatter(op),
            Case::ReduceScatterV(op),
        ]);
    }
    cases
}

#[test]
fn every_collective_on_device_memory_equals_host_memory() -> anyhow::Result<()> {
    let Some(devices) = devices() else {
        return Ok(());
    };
    for n in [1, 2, 4] {
        run_local(n, move |comm| -> anyhow::Result<()> {
            let stream = stream_for(comm.rank(), devices)?;
            // 70,000 elements crosses the host path's 64 KiB staging threshold.
            for len in [0, 1, 1_001, 70_000] {
                for dtype in DType::ALL {
                    for case in cases(dtype) {
                        let what = format!("{case:?} {dtype} len={len} ranks={n}");
                        let same = with_dtype!(dtype, T => {
                            let (host, device) =
                                host_and_device::<T>(&comm, &stream, case, len).context(what.clone())?;
                            host == device
                        });
                        ensure!(same, "device result differs from host: {what}");
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn large_all_reduce_on_device_equals_host() -> anyhow::Result<()> {
    let Some(devices) = devices() else {
        return Ok(());
    };
    run_local(4, move |comm| -> anyhow::Result<()> {
        let stream = stream_for(comm.rank(), devices)?;
        let len = (1 << 22) + 3;
        let (host, device) =
            host_and_device::<f32>(&comm, &stream, Case::AllReduce(ReduceOp::Sum), len)?;
        ensure!(host == device, "16 MiB all-reduce differs");
        Ok(())
    })?;
    Ok(())
}

#[test]
fn host_and_device_buffers_cannot_meet_in_one_call() -> anyhow::Result<()> {
    let Some(devices) = devices() else {
        return Ok(());
    };
    // One rank on the host, one on the device: every rank learns of the mismatch.
    // The closure returns comm-core's error so that the launcher's `RankFailed` keeps it
    // (an anyhow error could not be downcast back).
    let results = ferrotron_comm_core::LocalLauncher::new(2)?.run_each(
        move |comm| -> ferrotron_comm_core::Result<()> {
            let stream = cuda::context(comm.rank() % devices)?
                .new_stream()
                .map_err(cuda::driver_error("cuStreamCreate"))?;
            let mut host = vec![1.0f32; 8];
            let mut device = stream
                .clone_htod(&host)
                .map_err(cuda::driver_error("clone_htod"))?;
            let view = if comm.rank() == 0 {
                BufMut::from(&mut host)
            } else {
                BufMut::cuda(&mut device, &stream)?
            };
            comm.all_reduce(view, ReduceOp::Sum)
        },
    );
    for result in results {
        let (_, err) = result.err().context("mixed memory must fail")?;
        ensure!(matches!(err.root_cause(), Error::Mismatch { .. }), "{err}");
    }
    // Input on the device, output on the host: rejected before communicating.
    run_local(1, move |comm| -> anyhow::Result<()> {
        let stream = stream_for(0, devices)?;
        let input = stream.clone_htod(&[1.0f32, 2.0])?;
        let mut output = vec![0.0f32; 2];
        let err = comm
            .all_gather(BufRef::cuda(&input, &stream)?, BufMut::from(&mut output))
            .expect_err("mixed input and output");
        ensure!(matches!(err, Error::InvalidBuffer { .. }), "{err}");
        ensure!(err.to_string().contains("same device"), "{err}");
        Ok(())
    })?;
    Ok(())
}

/// Runs everywhere: without a driver the error names the library and what to do.
#[test]
fn opening_a_device_is_a_typed_error_without_one() {
    match cuda::context(0) {
        Ok(ctx) => println!("device 0 available: {}", ctx.name().unwrap_or_default()),
        Err(err @ Error::LibraryMissing { .. }) => {
            let text = err.to_string();
            assert!(
                text.contains("libcuda.so") && text.contains("LD_LIBRARY_PATH"),
                "{text}"
            );
        }
        Err(err @ Error::NoDevice { .. }) => assert!(err.to_string().contains("nvidia-smi")),
        Err(other) => panic!("unexpected error opening device 0: {other}"),
    }
}
