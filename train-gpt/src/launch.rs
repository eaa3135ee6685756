//! Starting the ranks: as threads of this process (the local backend, over NCCL on GPUs
//! when asked) or as MPI processes, each with its world communicator and device; and
//! gathering what each rank measured into the one report the run prints.

use crate::args::Args;
#[cfg(feature = "mpi")]
use crate::config::{list, query_groups, valid_tp};
use crate::config::{training_config, validate};
use crate::data::Corpus;
use crate::placement;
use crate::report::Progress;
use crate::summary::{
    announce, busiest_model_state, busiest_rank, finish, set_model_state, set_stage_memory,
    set_step_costs, stage_memory, step_costs,
};
use crate::train::{train_rank, TrainConfig};
use anyhow::{bail, ensure, Result};
use ferrotron_comm_core::{Communicator, DualCommunicator, LocalLauncher};
use std::sync::Arc;

/// The CUDA devices `--backend nccl` gives its ranks in turn: `--device cuda:N` and the
/// ones after it. Fails before any rank starts when NCCL or the devices are missing.
#[cfg(feature = "cuda")]
pub(crate) fn nccl_devices(args: &Args) -> Result<std::ops::Range<usize>> {
    use ferrotron_comm_core::cuda::{self, Library};
    let ferrotron_tape::Device::Cuda(first) = args.device else {
        bail!(
            "--backend nccl moves CUDA memory, but --device is {}; pass --device cuda:N",
            args.device
        );
    };
    cuda::require(Library::Nccl, "--backend nccl")?;
    let count = cuda::device_count()?;
    ensure!(
        first < count,
        "--device cuda:{first}, but this machine has {count} CUDA device(s)"
    );
    Ok(first..count)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn nccl_devices(_: &Args) -> Result<std::ops::Range<usize>> {
    bail!(
        "--backend nccl: this binary was built without CUDA (libcuda, libnccl); build it \
         with `cargo build --release -p ferrotron-train-gpt --features cuda`"
    )
}

/// This rank's world communicator and the device it computes on: `comm` itself on the
/// CPU; on a device a dual communicator over `comm` for host memory whose groups open a
/// device communicator when first used (with `devices`, NCCL on the rank's device, the
/// node's in turn by local rank), returned twice so the launcher can say what it opened.
pub(crate) fn connect(
    comm: Arc<dyn Communicator>,
    device: ferrotron_tape::Device,
    devices: Option<std::ops::Range<usize>>,
    placement: placement::Placement,
) -> Result<Connected> {
    let (world, device) = match devices {
        None if device == ferrotron_tape::Device::Cpu => return Ok((comm, None, device)),
        // Each group's device calls on a split of its own, opened when first used: what
        // the emulated device runs where NCCL would open a communicator.
        None => (
            DualCommunicator::opening(comm.clone(), comm, DualCommunicator::split_opener())?,
            device,
        ),
        Some(devices) => {
            let ordinal = placement.device_of(&devices);
            (
                nccl_world(comm, ordinal)?,
                ferrotron_tape::Device::Cuda(ordinal),
            )
        }
    };
    let world = Arc::new(world);
    Ok((world.clone(), Some(world), device))
}

/// The world over NCCL on device `ordinal`, each group's NCCL communicator opened when
/// first used (none for a group of one rank).
#[cfg(feature = "cuda")]
pub(crate) fn nccl_world(comm: Arc<dyn Communicator>, ordinal: usize) -> Result<DualCommunicator> {
    let nccl = ferrotron_comm_core::NcclCommunicator::new(comm.clone(), ordinal)?;
    let opener = nccl.opener();
    Ok(DualCommunicator::opening(comm, Arc::new(nccl), opener)?)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn nccl_world(_: Arc<dyn Communicator>, _: usize) -> Result<DualCommunicator> {
    unreachable!("nccl_devices refuses --backend nccl without the cuda feature")
}

/// TP × DP rank threads in this process, over NCCL on `devices` when given.
pub(crate) fn run_local_backend(
    args: &Args,
    corpus: &Corpus,
    devices: Option<std::ops::Range<usize>>,
) -> Result<()> {
    let dp = args.dp.unwrap_or(2);
    validate(args, dp, &corpus.vocabulary)?;
    let config = training_config(args, &corpus.vocabulary);
    let world = args.tp * args.pp * args.cp * dp;
    if let Some(devices) = &devices {
        let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
        ensure!(
            world <= devices.len() || shared,
            "--backend nccl: {world} ranks on {} CUDA device(s) put several ranks on one GPU, \
             which NCCL allows only from 2.30 and with NCCL_MULTI_RANK_GPU_ENABLE=1; set it, \
             or use fewer ranks",
            devices.len()
        );
    }
    let fail_collective = crate::faults::FailCollective::from_env(world)?;
    ensure!(
        fail_collective.is_none() || devices.is_none(),
        "{} injects failures into the local backend's calls, not NCCL's; unset it, or run \
         without --backend nccl",
        crate::faults::FAIL_COLLECTIVE
    );
    let mut launcher = LocalLauncher::new(world)?;
    if let Some(fail) = &fail_collective {
        launcher = launcher.fault_injector(fail.injector().clone());
    }
    let config = TrainConfig {
        fail_collective,
        ..config
    };
    announce(args, corpus, dp);
    let progress = Progress::of_run("train", args, &config.model, dp, world);
    let mut results = launcher.run(|comm| {
        // Unset, tape already divides the cores among this world's rank threads.
        if let Some(threads) = args.threads {
            ferrotron_tape::set_num_threads(threads)?;
        }
        let rank = comm.rank();
        // Every rank thread is on this node.
        let placement = placement::Placement {
            local_rank: rank,
            local_size: comm.size(),
        };
        let (world, dual, device) =
            connect(Arc::new(comm), config.device, devices.clone(), placement)?;
        let config = TrainConfig {
            device,
            ..config.clone()
        };
        let progress = (rank == 0).then_some(&progress);
        let mut result = train_rank(world, &config, corpus, progress)?;
        result.device_groups = dual.map(|dual| dual.opened());
        Ok::<_, anyhow::Error>(result)
    })?;
    if let Some(path) = &args.trace {
        // The first tensor- and data-parallel replica's stages, in pipeline order.
        let mut stages: Vec<_> = results
            .iter()
            .filter(|r| r.coordinates.1 == 0 && r.coordinates.2 == 0 && r.coordinates.3 == 0)
            .map(|r| (r.coordinates.0, r.timeline.clone(), r.streams.clone()))
            .collect();
        stages.sort_by_key(|s| s.0);
        let (timelines, streams): (Vec<_>, Vec<_>) =
            stages.into_iter().map(|(_, t, s)| (t, s)).unzip();
        let trace = ferrotron_pipeline::chrome_trace_with_streams(&timelines, &streams);
        std::fs::write(path, trace)?;
        println!("pipeline timeline of the last step: {}", path.display());
    }
    let busiest = busiest_rank(results.iter().map(step_costs));
    let peak = busiest[5] as usize;
    let state = (results.iter().map(|r| busiest_model_state(r, peak)))
        .reduce(|most, s| most.into_iter().zip(s).map(|(m, s)| m.max(s)).collect())
        .unwrap_or_default();
    let stages = (results.iter().map(|r| stage_memory(r, args.pp)))
        .fold(vec![0.0f64; 2 * args.pp], |most, s| {
            most.into_iter().zip(s).map(|(m, s)| m.max(s)).collect()
        });
    let mut result = results.swap_remove(0);
    set_step_costs(&mut result, busiest);
    set_model_state(&mut result, &state);
    set_stage_memory(&mut result, &stages);
    finish(args, corpus, dp, result)
}

#[cfg(feature = "mpi")]
pub(crate) fn run_mpi_backend(
    args: &Args,
    corpus: &Corpus,
    devices: Option<std::ops::Range<usize>>,
) -> Result<()> {
    ensure!(
        std::env::var_os(crate::faults::FAIL_COLLECTIVE).is_none(),
        "{} injects failures into the local backend's calls; unset it, or run without \
         --backend mpi",
        crate::faults::FAIL_COLLECTIVE
    );
    let mpi = ferrotron_comm_core::mpi::MpiWorld::init()?;
    let world: Arc<dyn Communicator> = Arc::new(mpi.world()?);
    let size = world.size();
    let dp = mpi_data_parallel(args, size)?;
    validate(args, dp, &corpus.vocabulary)?;
    // This node's processes as the launcher reports them (else assume all are here):
    // they share its cores and take its devices in turn.
    let placement = placement::from_environment().unwrap_or(placement::Placement {
        local_rank: world.rank(),
        local_size: size,
    });
    ferrotron_tape::set_num_threads(
        args.threads
            .unwrap_or_else(|| (ferrotron_tape::num_threads() / placement.local_size).max(1)),
    )?;
    let rank0 = world.rank() == 0;
    if rank0 {
        announce(args, corpus, dp);
    }
    let (world, dual, device) = connect(world, args.device, devices, placement)?;
    let config = TrainConfig {
        device,
        ..training_config(args, &corpus.vocabulary)
    };
    let progress = rank0.then(|| Progress::of_run("train", args, &config.model, dp, size));
    let mut result = train_rank(world.clone(), &config, corpus, progress.as_ref())?;
    result.device_groups = dual.map(|dual| dual.opened());
    gather_busiest(&*world, args, &mut result)?;
    if rank0 {
        finish(args, corpus, dp, result)?;
    }
    Ok(())
}

/// The data-parallel size of `size` MPI processes: `--dp`, or what the model-parallel
/// sizes leave; an error naming the fix when the process count does not fit.
#[cfg(feature = "mpi")]
fn mpi_data_parallel(args: &Args, size: usize) -> Result<usize> {
    // Ranks of one model replica: tensor- times pipeline- times context-parallel.
    let mp = args.tp * args.pp * args.cp;
    if size == 1 && mp * args.dp.unwrap_or(1) > 1 {
        let ranks = mp * args.dp.unwrap_or(2);
        bail!(
            "--backend mpi found 1 process, but --tp {} × --pp {} needs {ranks}; start one \
             process per rank with `mpirun -n {ranks} {} --backend mpi ...`{}",
            args.tp,
            args.pp,
            std::env::args()
                .next()
                .unwrap_or_else(|| "train-gpt".into()),
            if under_mpirun() {
                ""
            } else {
                " (this process was not started by mpirun)"
            }
        );
    }
    let dp = match args.dp {
        Some(dp) => dp,
        None if size.is_multiple_of(mp) => size / mp,
        None => bail!(
            "mpirun started {size} processes, which --tp {} × --pp {} × --cp {} does not \
             divide; valid --tp at --pp 1 and --cp 1: {}",
            args.tp,
            args.pp,
            args.cp,
            list(&valid_tp(size, query_groups(args)))
        ),
    };
    if mp * dp != size {
        let fix = if size.is_multiple_of(mp) {
            format!("pass --dp {}", size / mp)
        } else {
            format!(
                "pass a --tp among {}",
                list(&valid_tp(size, query_groups(args)))
            )
        };
        bail!(
            "--tp {} × --pp {} × --cp {} × --dp {dp} = {} ranks, but mpirun started {size}; \
             {fix}, or run mpirun -n {}",
            args.tp,
            args.pp,
            args.cp,
            mp * dp,
            mp * dp
        );
    }
    Ok(dp)
}

/// Makes `result` the busiest rank's figures over `world` (each the largest of any
/// rank's), as the threads backend reports them.
#[cfg(feature = "mpi")]
fn gather_busiest(
    world: &dyn Communicator,
    args: &Args,
    result: &mut crate::train::RankResult,
) -> Result<()> {
    use ferrotron_comm_core::{CommunicatorExt, ReduceOp};
    let mut costs = step_costs(result);
    world.all_reduce_slice(&mut costs, ReduceOp::Max)?;
    let mut state = busiest_model_state(result, costs[5] as usize);
    world.all_reduce_slice(&mut state, ReduceOp::Max)?;
    let mut stages = stage_memory(result, args.pp);
    world.all_reduce_slice(&mut stages, ReduceOp::Max)?;
    set_step_costs(result, costs);
    set_model_state(result, &state);
    set_stage_memory(result, &stages);
    Ok(())
}

/// Whether a launcher (OpenMPI, MPICH/PMI, Slurm's PMIx) started this process.
pub(crate) fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn run_mpi_backend(
    _: &Args,
    _: &Corpus,
    _: Option<std::ops::Range<usize>>,
) -> Result<()> {
    bail!(
        "--backend mpi: this binary was built without MPI; build it with `cargo build \
         --release -p ferrotron-train-gpt --features mpi` and run it under `mpirun -n 4 \
         target/release/train-gpt --backend mpi`"
    )
}

/// A rank's world, the same world as a dual communicator when it is one, and its device.
type Connected = (
    Arc<dyn Communicator>,
    Option<Arc<DualCommunicator>>,
    ferrotron_tape::Device,
);
