//! Gradients are views into the buckets, which live on the parameters' device: a DDP step
//! on the emulated device copies no gradient between host and device, allocates no
//! bucket, and still trains (with `no_sync` accumulation) like one rank on the whole
//! batch. The 16-bit comm hook, which sends a rounded copy of each bucket, trains on the
//! device as on the CPU, and its copies stay on the device too.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{CompressedAllReduce, DdpConfig, DistributedDataParallel};
use ferrotron_tape::{host_waits, transfers, Device, Parameter, Tape, Transfers};
use support::{global_batch, loss, max_relative_error, mlp, optimizer, slice, small_buckets, Opt};

const RANKS: usize = 2;
const MICRO_BATCHES: usize = 2;
const ROWS: usize = 3;
const STEPS: usize = 3;

fn on_device(params: Vec<Parameter>, device: Device) -> Result<Vec<Parameter>> {
    params
        .into_iter()
        .map(|p| Ok(Parameter::new(p.name(), p.value()?.to_device(device)?)))
        .collect()
}

/// Trains with `no_sync` accumulation on `device`; returns the final values and, per
/// step after the first, the host↔device copies its backward passes, finish and
/// optimizer step made (inputs are moved before measuring).
fn train(
    comm: Arc<dyn Communicator>,
    device: Device,
    config: DdpConfig,
) -> Result<(Vec<Vec<f32>>, Vec<Transfers>)> {
    let rank = comm.rank();
    let params = on_device(mlp(100 + rank as u64), device)?;
    let ddp = DistributedDataParallel::new(params.clone(), comm, config)?;
    let mut opt = optimizer(Opt::AdamW, params.clone())?;
    let tape = Tape::new();
    let mut moved = Vec::new();
    let waits = host_waits(device);
    for step in 0..STEPS {
        let batch = global_batch(step, RANKS * MICRO_BATCHES * ROWS);
        let micro: Vec<_> = (0..MICRO_BATCHES)
            .map(|m| -> Result<_> {
                let (x, target) = slice(&batch, rank * MICRO_BATCHES + m, ROWS)?;
                Ok((x.to_device(device)?, target.to_device(device)?))
            })
            .collect::<Result<_>>()?;
        let before = transfers(device);
        opt.zero_grad();
        for (m, (x, target)) in micro.iter().enumerate() {
            let micro_loss = loss(&tape, &params, x, target)?.scale(0.5)?;
            if m + 1 < MICRO_BATCHES {
                let _accumulate = ddp.no_sync();
                ddp.backward(&micro_loss)?;
            } else {
                ddp.backward(&micro_loss)?;
            }
        }
        opt.step()?;
        if step > 0 {
            moved.push(transfers(device) - before);
        }
    }
    // Uploads, backward passes, bucket reductions and updates: the host waited for none
    // of them on the emulated device (on a GPU the threads backend's collectives do).
    if device == Device::Emulated {
        anyhow::ensure!(
            host_waits(device) == waits,
            "{} host waits",
            host_waits(device) - waits
        );
    }
    Ok((support::values(&params)?, moved))
}

#[test]
fn a_device_step_moves_no_gradient_through_the_host() -> Result<()> {
    let expected = support::train_single(Opt::AdamW, RANKS * MICRO_BATCHES, ROWS, STEPS)?;
    let ranks = run_local(RANKS, |comm| -> Result<_> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rank = comm.rank();
        let params = on_device(mlp(100 + rank as u64), Device::Emulated)?;
        // Each bucket is one storage that its parameters' gradients are views of.
        let ddp = DistributedDataParallel::new(params.clone(), comm.clone(), small_buckets())?;
        assert!(ddp.buckets().len() > 1);
        assert_eq!(ddp.buffer_bytes(), ddp.gradient_bytes());
        for bucket in ddp.buckets() {
            let views: Vec<_> = bucket
                .params
                .iter()
                .map(|slot| params[slot.index].main_grad().expect("a bucket view"))
                .collect();
            for (view, slot) in views.iter().zip(&bucket.params) {
                assert_eq!(view.offset(), slot.offset);
                assert_eq!(view.device(), Device::Emulated);
                assert!(view.storage().same_storage(views[0].storage()));
            }
        }
        drop(ddp);
        train(comm, Device::Emulated, small_buckets())
    })?;
    for (values, moved) in ranks {
        let error = max_relative_error(&values, &expected);
        assert!(error <= 1e-5, "relative error {error}");
        for step in moved {
            assert_eq!(step, Transfers::default(), "a step copied through the host");
        }
    }
    Ok(())
}

#[test]
fn the_16_bit_hook_trains_on_the_device_as_on_the_cpu_without_the_host() -> Result<()> {
    let config = || DdpConfig {
        comm_hook: Arc::new(CompressedAllReduce::bf16()),
        ..small_buckets()
    };
    let runs = run_local(RANKS, |comm| -> Result<_> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (cpu, _) = train(comm.clone(), Device::Cpu, config())?;
        let (emulated, moved) = train(comm, Device::Emulated, config())?;
        Ok((cpu, emulated, moved))
    })?;
    for (cpu, emulated, moved) in runs {
        let error = max_relative_error(&emulated, &cpu);
        assert!(error <= 1e-6, "relative error {error}");
        for step in moved {
            assert_eq!(step, Transfers::default(), "a step copied through the host");
        }
    }
    Ok(())
}
