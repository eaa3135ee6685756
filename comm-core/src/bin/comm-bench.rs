//! Collective benchmark in the style of nccl-tests, over the local or MPI backend.
//!
//! ```text
//! cargo run --release -p ferrotron-comm-core --features cli --bin comm-bench -- \
//!     --backend local --ranks 2 --op all_reduce --sizes 1K,64K,1M,16M,64M --baseline memcpy
//! mpirun -n 2 target/release/comm-bench --backend mpi --op all_reduce --baseline raw
//! # with `--features cuda`: device buffers, local ranks on one GPU, and NCCL
//! comm-bench --backend local --memory cuda --ranks 4 --baseline device-copy
//! comm-bench --backend nccl --ranks 1
//! ```
//!
//! `bytes` follows nccl-tests: the buffer size for all_reduce and broadcast, the gathered
//! (output) size for all_gather, the input size for reduce_scatter, and each rank's send
//! size for all_to_all. `time_us` is the slowest rank's mean time per call; algbw is
//! bytes / time and busbw scales it by the nccl-tests factor for the operation (e.g.
//! 2(n−1)/n for all_reduce). Every size is checked for correctness before it is timed.

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use ferrotron_comm_core::{
    run_local, BufMut, Communicator, CommunicatorExt, DType, Element, ReduceOp,
};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Local,
    Mpi,
    /// NCCL bootstrapped over local rank threads (rank r on device r mod #devices).
    Nccl,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Memory {
    Host,
    /// Device memory on device (rank mod #devices); needs `--features cuda`.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
        }
    }

    /// nccl-tests' bus-bandwidth factor: the fraction of the data each link must carry.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Baseline {
    /// A single-thread copy of the same byte count.
    Memcpy,
    /// The same operation through rsmpi directly (MPI backend only).
    Raw,
    /// A device-to-device copy of the same byte count (device memory only).
    DeviceCopy,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmark ferrotron collectives (nccl-tests style)")]
struct Args {
    /// Backend to measure.
    #[arg(long, value_enum, default_value = "local")]
    backend: Backend,
    /// Number of ranks (local backend; under mpirun the world size is used).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Collective to measure.
    #[arg(long, value_enum, default_value = "all_reduce")]
    op: Op,
    /// Comma-separated sizes in bytes, with K/M/G suffixes (powers of 1024).
    #[arg(long, default_value = "1K,64K,1M,16M,64M", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Where the buffers live (the nccl backend always uses device memory).
    #[arg(long, value_enum, default_value = "host")]
    memory: Memory,
    /// Element type.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Timed calls per size (default: enough for about 256 MiB of traffic, 5 to 20000).
    #[arg(long)]
    iters: Option<usize>,
    /// Baselines measured in the same run.
    #[arg(long, value_enum, value_delimiter = ',')]
    baseline: Vec<Baseline>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

/// One measured row.
struct Row {
    backend: &'static str,
    bytes: usize,
    iters: usize,
    time_us: f64,
}

fn parse_size(text: &str) -> Result<usize> {
    let text = text.trim();
    let (digits, scale) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&text[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    let value: usize = digits
        .parse()
        .with_context(|| format!("size {text:?} is not a number with an optional K/M/G suffix"))?;
    Ok(value * scale)
}

fn default_iters(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 20_000)
}

/// Elements per rank-side buffer for a size, following nccl-tests' conventions.
struct Shape {
    /// Elements this rank sends (all_gather: its share; others: the whole buffer).
    input: usize,
    /// Elements this rank receives.
    output: usize,
}

fn shape(op: Op, count: usize, n: usize) -> Shape {
    match op {
        Op::AllReduce | Op::Broadcast | Op::AllToAll => Shape {
            input: count,
            output: count,
        },
        Op::AllGather => Shape {
            input: count / n,
            output: count,
        },
        Op::ReduceScatter => Shape {
            input: count,
            output: count / n,
        },
    }
}

/// Runs one call of `op`: in place on `input` for all_reduce and broadcast, otherwise
/// from `input` into `output`.
fn run_op(
    comm: &dyn Communicator,
    op: Op,
    mut input: BufMut<'_>,
    output: BufMut<'_>,
) -> ferrotron_comm_core::Result<()> {
    let n = comm.size();
    match op {
        Op::AllReduce => comm.all_reduce(input, ReduceOp::Sum),
        Op::Broadcast => comm.broadcast(input, 0),
        Op::AllGather => comm.all_gather(input.as_ref(), output),
        Op::ReduceScatter => comm.reduce_scatter(input.as_ref(), output, ReduceOp::Sum),
        Op::AllToAll => {
            let counts = vec![input.len() / n; n];
            comm.all_to_all_v(input.reborrow().as_ref(), &counts, output, &counts)
        }
    }
}

/// An element type the bench can put in host or device memory.
#[cfg(feature = "cuda")]
trait BenchElement:
    Element
    + ferrotron_comm_core::cuda::cudarc::driver::DeviceRepr
    + ferrotron_comm_core::cuda::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(feature = "cuda")]
impl<T> BenchElement for T where
    T: Element
        + ferrotron_comm_core::cuda::cudarc::driver::DeviceRepr
        + ferrotron_comm_core::cuda::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(not(feature = "cuda"))]
trait BenchElement: Element {}
#[cfg(not(feature = "cuda"))]
impl<T: Element> BenchElement for T {}

/// One rank's input and output buffers, in host or device memory.
enum Buffers<T: BenchElement> {
    Host {
        input: Vec<T>,
        output: Vec<T>,
    },
    #[cfg(feature = "cuda")]
    Device {
        input: ferrotron_comm_core::cuda::cudarc::driver::CudaSlice<T>,
        output: ferrotron_comm_core::cuda::cudarc::driver::CudaSlice<T>,
        stream: std::sync::Arc<ferrotron_comm_core::cuda::cudarc::driver::CudaStream>,
    },
}

impl<T: BenchElement> Buffers<T> {
    fn new(memory: Memory, rank: usize, input: Vec<T>, output_len: usize) -> Result<Self> {
        match memory {
            Memory::Host => Ok(Buffers::Host {
                input,
                output: vec![T::default(); output_len],
            }),
            #[cfg(feature = "cuda")]
            Memory::Cuda => {
                let device = rank % ferrotron_comm_core::cuda::device_count()?.max(1);
                let stream = ferrotron_comm_core::cuda::context(device)?.new_stream()?;
                Ok(Buffers::Device {
                    input: stream.clone_htod(&input)?,
                    output: stream.alloc_zeros(output_len)?,
                    stream,
                })
            }
            #[cfg(not(feature = "cuda"))]
            Memory::Cuda => {
                let _ = rank;
                bail!("this comm-bench was built without CUDA; rebuild with `--features cuda`")
            }
        }
    }

    fn run(&mut self, comm: &dyn Communicator, op: Op) -> Result<()> {
        match self {
            Buffers::Host { input, output } => {
                run_op(comm, op, BufMut::from(input), BufMut::from(output))?
            }
            #[cfg(feature = "cuda")]
            Buffers::Device {
                input,
                output,
                stream,
            } => run_op(
                comm,
                op,
                BufMut::cuda(input, stream)?,
                BufMut::cuda(output, stream)?,
            )?,
        }
        Ok(())
    }

    /// Host copies of the input (which in-place operations overwrite) and the output.
    fn read(&self) -> Result<(Vec<T>, Vec<T>)> {
        match self {
            Buffers::Host { input, output } => Ok((input.clone(), output.clone())),
            #[cfg(feature = "cuda")]
            Buffers::Device {
                input,
                output,
                stream,
            } => Ok((stream.clone_dtoh(input)?, stream.clone_dtoh(output)?)),
        }
    }
}

/// Small integers, exact in every dtype after summing over up to 8 ranks.
fn pattern<T: Element>(rank: usize, i: usize) -> T {
    T::from_f64(((rank + 1) * (i % 7)) as f64)
}

/// One checked call with known data; errors say which element differs.
fn check<T: BenchElement>(
    comm: &dyn Communicator,
    memory: Memory,
    op: Op,
    count: usize,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let shape = shape(op, count, n);
    let input: Vec<T> = (0..shape.input).map(|i| pattern(r, i)).collect();
    let mut buffers = Buffers::new(memory, r, input, shape.output)?;
    buffers.run(comm, op)?;
    let (input, output) = buffers.read()?;
    let rank_sum = (n * (n + 1) / 2) as f64;
    let (got, expect): (&[T], Box<dyn Fn(usize) -> f64>) = match op {
        Op::AllReduce => (&input, Box::new(move |i| rank_sum * (i % 7) as f64)),
        Op::Broadcast => (&input, Box::new(|i| (i % 7) as f64)),
        Op::AllGather => {
            let per = shape.input;
            (
                &output,
                Box::new(move |i| ((i / per + 1) * ((i % per) % 7)) as f64),
            )
        }
        Op::ReduceScatter => {
            let base = r * shape.output;
            (
                &output,
                Box::new(move |i| rank_sum * ((base + i) % 7) as f64),
            )
        }
        Op::AllToAll => {
            let per = shape.input / n;
            (
                &output,
                Box::new(move |i| ((i / per + 1) * ((r * per + i % per) % 7)) as f64),
            )
        }
    };
    for (i, v) in got.iter().enumerate() {
        ensure!(
            v.to_f64() == expect(i),
            "{} result wrong at element {i}: got {}, expected {}",
            op.name(),
            v.to_f64(),
            expect(i)
        );
    }
    Ok(())
}

/// Times `iters` calls; returns the slowest rank's mean microseconds per call, agreed on
/// over `control` (a host-memory communicator of the same ranks: NCCL moves device memory
/// only).
fn time_op<T: BenchElement>(
    comm: &dyn Communicator,
    control: &dyn Communicator,
    memory: Memory,
    op: Op,
    count: usize,
    iters: usize,
) -> Result<f64> {
    let shape = shape(op, count, comm.size());
    let input: Vec<T> = (0..shape.input).map(|i| pattern(comm.rank(), i)).collect();
    let mut buffers = Buffers::new(memory, comm.rank(), input, shape.output)?;
    for _ in 0..(iters / 10).max(2) {
        buffers.run(comm, op)?;
    }
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        buffers.run(comm, op)?;
    }
    let mut elapsed = [start.elapsed().as_secs_f64() * 1e6 / iters as f64];
    control.all_reduce_slice(&mut elapsed, ReduceOp::Max)?;
    Ok(elapsed[0])
}

fn time_memcpy(bytes: usize, iters: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    start.elapsed().as_secs_f64() * 1e6 / iters as f64
}

/// Checks and times every size on one rank; rank 0's rows are the result. `control` is
/// `comm` itself, or for NCCL the host communicator it was bootstrapped from.
fn bench_rank<T: BenchElement>(
    comm: &dyn Communicator,
    control: &dyn Communicator,
    args: &Args,
    sizes: &[usize],
) -> Result<Vec<Row>> {
    let esize = T::DTYPE.size_in_bytes();
    let n = comm.size();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let count = bytes / esize;
        let divisor = if args.op == Op::AllReduce || args.op == Op::Broadcast {
            1
        } else {
            n
        };
        if count == 0 || count % divisor != 0 {
            bail!(
                "size {bytes} B is {count} {} elements, which {} ranks cannot share evenly for \
                 {}; pick a multiple of {} bytes",
                T::DTYPE,
                n,
                args.op.name(),
                esize * divisor
            );
        }
        check::<T>(comm, args.memory, args.op, count)?;
        let iters = args.iters.unwrap_or_else(|| default_iters(bytes));
        let time_us = time_op::<T>(comm, control, args.memory, args.op, count, iters)?;
        rows.push(Row {
            backend: comm.backend(),
            bytes,
            iters,
            time_us,
        });
        if args.baseline.contains(&Baseline::Memcpy) && comm.rank() == 0 {
            rows.push(Row {
                backend: "memcpy",
                bytes,
                iters,
                time_us: time_memcpy(bytes, iters),
            });
        }
        #[cfg(feature = "cuda")]
        if args.baseline.contains(&Baseline::DeviceCopy) && comm.rank() == 0 {
            rows.push(Row {
                backend: "device-copy",
                bytes,
                iters,
                time_us: device_copy::time(bytes, iters)?,
            });
        }
        #[cfg(feature = "mpi")]
        if args.baseline.contains(&Baseline::Raw) {
            rows.push(raw_mpi::time::<T>(args.op, count, iters)?);
        }
    }
    Ok(rows)
}

fn print_rows(args: &Args, ranks: usize, rows: &[Row]) {
    let op = args.op;
    if !args.json {
        println!(
            "# comm-bench: op={} ranks={} dtype={} memory={:?}",
            op.name(),
            ranks,
            args.dtype,
            args.memory
        );
        println!(
            "# {:>12} {:>8} {:>12} {:>12} {:>12}  backend",
            "bytes", "iters", "time_us", "algbw_GB/s", "busbw_GB/s"
        );
    }
    for row in rows {
        let algbw = row.bytes as f64 / (row.time_us * 1e-6) / 1e9;
        let busbw = if row.backend == "memcpy" || row.backend == "device-copy" {
            algbw
        } else {
            algbw * op.bus_factor(ranks)
        };
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "backend": row.backend,
                    "op": op.name(),
                    "ranks": ranks,
                    "dtype": args.dtype,
                    "bytes": row.bytes,
                    "iters": row.iters,
                    "time_us": row.time_us,
                    "algbw_gbs": algbw,
                    "busbw_gbs": busbw,
                    "max_rss_kb": max_rss_kb(),
                })
            );
        } else {
            println!(
                "  {:>12} {:>8} {:>12.2} {:>12.3} {:>12.3}  {}",
                row.bytes, row.iters, row.time_us, algbw, busbw, row.backend
            );
        }
    }
}

/// Peak resident memory of this process (Linux), so long runs show whether memory stays
/// flat.
fn max_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = DType::from_name(&args.dtype).with_context(|| {
        format!(
            "unknown dtype {:?}; use one of {}",
            args.dtype,
            DType::ALL.map(|d| d.name()).join(", ")
        )
    })?;
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    if args.baseline.contains(&Baseline::Raw) && args.backend != Backend::Mpi {
        bail!("--baseline raw times rsmpi directly and needs --backend mpi under mpirun");
    }
    let mut args = args;
    if args.backend == Backend::Nccl {
        args.memory = Memory::Cuda;
    }
    if args.baseline.contains(&Baseline::DeviceCopy) && args.memory != Memory::Cuda {
        bail!("--baseline device-copy needs device buffers: add --memory cuda");
    }
    let args = args;
    match args.backend {
        Backend::Local => {
            let results = run_local(
                args.ranks,
                |comm| ferrotron_comm_core::with_dtype!(dtype, T => bench_rank::<T>(&comm, &comm, &args, &sizes)),
            )?;
            print_rows(&args, args.ranks, &results[0]);
        }
        Backend::Mpi => run_mpi(&args, dtype, &sizes)?,
        Backend::Nccl => run_nccl(&args, dtype, &sizes)?,
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_nccl(args: &Args, dtype: DType, sizes: &[usize]) -> Result<()> {
    let devices = ferrotron_comm_core::cuda::device_count()?.max(1);
    let results = run_local(args.ranks, |bootstrap| -> Result<Vec<Row>> {
        let device = bootstrap.rank() % devices;
        let bootstrap = std::sync::Arc::new(bootstrap);
        let nccl = ferrotron_comm_core::NcclCommunicator::new(bootstrap.clone(), device)?;
        ferrotron_comm_core::with_dtype!(dtype, T => bench_rank::<T>(&nccl, &*bootstrap, args, sizes))
    })?;
    print_rows(args, args.ranks, &results[0]);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_nccl(_: &Args, _: DType, _: &[usize]) -> Result<()> {
    bail!("this comm-bench was built without CUDA; rebuild with `--features cuda`")
}

/// A device-to-device copy of the same size, the ceiling for device-memory collectives.
#[cfg(feature = "cuda")]
mod device_copy {
    use anyhow::Result;
    use std::time::Instant;

    pub fn time(bytes: usize, iters: usize) -> Result<f64> {
        let stream = ferrotron_comm_core::cuda::context(0)?.new_stream()?;
        let src = stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes)?;
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            stream.memcpy_dtod(&src, &mut dst)?;
        }
        stream.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e6 / iters as f64)
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &Args, dtype: DType, sizes: &[usize]) -> Result<()> {
    let mpi = ferrotron_comm_core::mpi::MpiWorld::init()?;
    let world = mpi.world()?;
    let rows =
        ferrotron_comm_core::with_dtype!(dtype, T => bench_rank::<T>(&world, &world, args, sizes))?;
    if world.rank() == 0 {
        print_rows(args, world.size(), &rows);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args, _: DType, _: &[usize]) -> Result<()> {
    bail!("this comm-bench was built without MPI; rebuild with `--features mpi`")
}

/// The same operations through rsmpi's own API, for the overhead ratio.
#[cfg(feature = "mpi")]
mod raw_mpi {
    use super::{shape, Op, Row};
    use anyhow::{bail, Result};
    use ferrotron_comm_core::{DType, Element};
    use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
    use mpi::datatype::{Partition, PartitionMut};
    use mpi::topology::{Communicator, SimpleCommunicator};
    use mpi::traits::Equivalence;
    use std::time::Instant;

    pub fn time<T: Element>(op: Op, count: usize, iters: usize) -> Result<Row> {
        match T::DTYPE {
            DType::F32 => time_typed::<f32>(op, count, iters),
            DType::F64 => time_typed::<f64>(op, count, iters),
            DType::I32 => time_typed::<i32>(op, count, iters),
            DType::I64 => time_typed::<i64>(op, count, iters),
            DType::U8 => time_typed::<u8>(op, count, iters),
            other => bail!("rsmpi has no {other} type; run the raw baseline with f32"),
        }
    }

    fn time_typed<T: Equivalence + Copy + Default>(
        op: Op,
        count: usize,
        iters: usize,
    ) -> Result<Row> {
        let world = SimpleCommunicator::world();
        let n = world.size() as usize;
        let shape = shape(op, count, n);
        let input = vec![T::default(); shape.input];
        let mut output = vec![T::default(); shape.output];
        let mut inplace = vec![T::default(); shape.input];
        let per = (shape.input / n) as i32;
        let counts = vec![per; n];
        let displs: Vec<i32> = (0..n as i32).map(|i| i * per).collect();
        let mut call = || match op {
            Op::AllReduce => {
                world.all_reduce_into(&input[..], &mut inplace[..], SystemOperation::sum())
            }
            Op::Broadcast => world.process_at_rank(0).broadcast_into(&mut inplace[..]),
            Op::AllGather => world.all_gather_into(&input[..], &mut output[..]),
            Op::ReduceScatter => {
                world.reduce_scatter_block_into(&input[..], &mut output[..], SystemOperation::sum())
            }
            Op::AllToAll => {
                let send = Partition::new(&input[..], &counts[..], &displs[..]);
                let mut recv = PartitionMut::new(&mut output[..], &counts[..], &displs[..]);
                world.all_to_all_varcount_into(&send, &mut recv)
            }
        };
        for _ in 0..(iters / 10).max(2) {
            call();
        }
        world.barrier();
        let start = Instant::now();
        for _ in 0..iters {
            call();
        }
        let mine = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let mut slowest = 0.0f64;
        world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
        Ok(Row {
            backend: "raw-mpi",
            bytes: count * std::mem::size_of::<T>(),
            iters,
            time_us: slowest,
        })
    }
}
