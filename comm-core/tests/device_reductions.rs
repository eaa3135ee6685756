//! The local backend reduces device memory with its CUDA kernel's source (`reduce.cu`),
//! which the emulated device runs as its host build: every dtype and operator gives the
//! host path's bits exactly (16-bit floats reduced in f32 and rounded once, integers
//! wrapping, a NaN kept where a maximum meets it), for rows reduced in place (all-reduce)
//! and into another buffer (reduce-scatter).

use ferrotron_comm_core::half::{bf16, f16};
use ferrotron_comm_core::{
    run_local, BufMut, BufRef, Communicator, CommunicatorExt, DType, Device, Element, ReduceOp,
};
use ferrotron_device::{DeviceMemory, Stream};

const RANKS: usize = 3;
/// Elements per rank: more than one tile of the host path, a multiple of `RANKS`.
const LEN: usize = 3 * 1000;

/// Rank `rank`'s element `i`: ordinary values, values that overflow 16 bits or wrap
/// integers when summed or multiplied, signed zeros, infinities and a NaN.
fn value(rank: usize, i: usize) -> f64 {
    match i % 11 {
        0 => f64::NAN,
        1 => f64::INFINITY,
        2 => -0.0,
        3 => 60_000.0 + rank as f64,
        4 => 1e-6 * (rank as f64 + 1.0),
        5 => 2_000_000_000.0,
        6 => -((i + rank) as f64) / 7.0,
        _ => ((i * 31 + rank * 17) % 255) as f64 + 0.1 * rank as f64,
    }
}

fn bytes<T: Element>(values: &[T]) -> Vec<u8> {
    // SAFETY: plain data of `size_of_val(values)` bytes.
    let raw =
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) };
    raw.to_vec()
}

fn upload(stream: &Stream, raw: &[u8]) -> ferrotron_device::Result<DeviceMemory> {
    let memory = stream.alloc(raw.len())?;
    // SAFETY: the allocation holds the bytes.
    unsafe { stream.upload(memory.ptr(), raw)? };
    Ok(memory)
}

fn download(memory: &DeviceMemory, len: usize) -> ferrotron_device::Result<Vec<u8>> {
    let mut raw = vec![0u8; len];
    // SAFETY: the allocation holds `len` bytes.
    unsafe { memory.stream().download(&mut raw, memory.ptr())? };
    Ok(raw)
}

/// The host path's and the device path's results of an all-reduce and a reduce-scatter
/// of `T` with `op`, as bytes, on rank `comm`.
fn both_ways<T: Element>(
    comm: &dyn Communicator,
    op: ReduceOp,
) -> anyhow::Result<[(Vec<u8>, Vec<u8>); 2]> {
    let rank = comm.rank();
    let mine: Vec<T> = (0..LEN).map(|i| T::from_f64(value(rank, i))).collect();
    let stream = Stream::new(Device::Emulated)?;
    let dtype = T::DTYPE;

    let mut host = mine.clone();
    comm.all_reduce_slice(&mut host, op)?;
    let mut device = upload(&stream, &bytes(&mine))?;
    comm.all_reduce(BufMut::device(&mut device, 0, LEN, dtype)?, op)?;
    let reduced = (bytes(&host), download(&device, bytes(&host).len())?);

    let part = LEN / RANKS;
    let mut host_part = vec![T::default(); part];
    comm.reduce_scatter(
        BufRef::from(&mine[..]),
        BufMut::from(&mut host_part[..]),
        op,
    )?;
    let input = upload(&stream, &bytes(&mine))?;
    let mut output = upload(&stream, &bytes(&host_part))?;
    comm.reduce_scatter(
        BufRef::device(&input, 0, LEN, dtype)?,
        BufMut::device(&mut output, 0, part, dtype)?,
        op,
    )?;
    let scattered = (
        bytes(&host_part),
        download(&output, bytes(&host_part).len())?,
    );
    Ok([reduced, scattered])
}

#[test]
fn every_dtype_and_operator_gives_the_host_paths_bits() {
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            let float = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
            if op == ReduceOp::Avg && !float {
                continue; // refused for integers before anything moves
            }
            let results = run_local(RANKS, |comm| match dtype {
                DType::F32 => both_ways::<f32>(&comm, op),
                DType::F64 => both_ways::<f64>(&comm, op),
                DType::F16 => both_ways::<f16>(&comm, op),
                DType::BF16 => both_ways::<bf16>(&comm, op),
                DType::I32 => both_ways::<i32>(&comm, op),
                DType::I64 => both_ways::<i64>(&comm, op),
                DType::U8 => both_ways::<u8>(&comm, op),
            })
            .unwrap();
            for (rank, calls) in results.into_iter().enumerate() {
                for ((host, device), call) in
                    calls.into_iter().zip(["all_reduce", "reduce_scatter"])
                {
                    assert!(
                        host == device,
                        "{dtype:?} {op:?} {call} differs on rank {rank}"
                    );
                }
            }
        }
    }
}
