//! A tensor-parallel transformer block with its parameters and activations on a device
//! equals the same block on the CPU: output, input gradient and every parameter gradient,
//! for TP 1 and 2 with sequence parallelism off and on. Runs on the emulator everywhere
//! and on `cuda:0` when a GPU is present (otherwise prints `skipped: …`). The
//! sequence-parallel gradient reduction leaves gradients on their parameters' device and
//! copies nothing through the host, and a step copies nothing between host and device
//! and (on the emulated device) never makes the host wait.

mod common;

use common::{assert_close, part, tp_context, AnyResult};
use ferrotron_comm_core::run_local;
use ferrotron_layers::{
    all_reduce_sequence_parallel_grads, BlockConfig, LayerNorm, MasterInit, Module, RngTracker,
    TransformerBlock,
};
use ferrotron_tape::{
    host_waits, transfers, Device, Generator, Parameter, Tape, Tensor, Transfers,
};

const SEQ: usize = 4;
const BATCH: usize = 2;
const HIDDEN: usize = 16;
const HEADS: usize = 4;

/// Per rank: output, input gradient, and every parameter's gradient (on the host).
type RankResult = (Tensor, Tensor, Vec<(String, Tensor)>);

fn run_block(tp: usize, sequence_parallel: bool, device: Device) -> AnyResult<Vec<RankResult>> {
    let mut rng = Generator::new(3);
    let input = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    Ok(run_local(tp, |comm| -> AnyResult<RankResult> {
        let tp = tp_context(comm, sequence_parallel);
        let config = BlockConfig {
            ffn_hidden: 40,
            ..BlockConfig::new(HIDDEN, HEADS)
        };
        let block = TransformerBlock::new(&tp, "block", &config, &MasterInit::new(7, 0.2))?;
        for p in block.parameters() {
            p.param.set_value(p.param.value()?.to_device(device)?)?;
        }
        let (x, w) = if sequence_parallel {
            let (rank, size) = (tp.rank(), tp.size());
            (part(&input, 0, rank, size), part(&weights, 0, rank, size))
        } else {
            (input.clone(), weights.clone())
        };
        let x = Parameter::new("input", x.to_device(device)?);
        let w = w.to_device(device)?;
        let tape = Tape::new();
        let mut rng = RngTracker::new(99, tp.rank());
        let (before, waits) = (transfers(device), host_waits(device));
        let output = block.forward(&tape, &tape.watch(&x)?, &mut rng)?;
        assert_eq!(output.device(), device, "activations stay on the device");
        output.mul(&w)?.sum()?.backward()?;
        // Tensor-parallel collectives run on device memory and attention masks inside
        // its softmax: nothing crosses between host and device, and on the emulated device
        // the host never waits (on a GPU the threads backend's collectives synchronize
        // their streams: not checked there).
        if !matches!(device, Device::Cuda(_)) {
            let moved = transfers(device) - before;
            assert_eq!(moved, Transfers::default(), "{device}, TP {}", tp.size());
            assert_eq!(host_waits(device), waits, "{device}, TP {}", tp.size());
        }
        let host = |t: Tensor| t.to_device(Device::Cpu);
        let grads = block
            .parameters()
            .into_iter()
            .map(|p| {
                let grad = p.param.grad().expect("every parameter gets a gradient");
                Ok((p.param.name().to_string(), host(grad)?))
            })
            .collect::<ferrotron_tape::Result<_>>()?;
        Ok((
            host(output)?,
            host(x.grad().expect("input gradient"))?,
            grads,
        ))
    })?)
}

fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Emulated];
    match Tensor::<f32>::zeros(&[1]).to_device(Device::Cuda(0)) {
        Ok(_) => devices.push(Device::Cuda(0)),
        Err(reason) => println!("skipped on cuda:0: {reason}"),
    }
    devices
}

#[test]
fn transformer_block_on_a_device_equals_the_cpu() -> AnyResult<()> {
    for (tp, sequence_parallel) in [(1, false), (2, false), (2, true)] {
        let cpu = run_block(tp, sequence_parallel, Device::Cpu)?;
        for device in devices() {
            let got = run_block(tp, sequence_parallel, device)?;
            for (rank, (want, have)) in cpu.iter().zip(&got).enumerate() {
                let what = format!("{device} tp={tp} sp={sequence_parallel} rank {rank}");
                assert_close(&format!("{what} output"), &have.0, &want.0);
                assert_close(&format!("{what} input grad"), &have.1, &want.1);
                for ((name, g), (_, w)) in have.2.iter().zip(&want.2) {
                    assert_close(&format!("{what} grad of {name}"), g, w);
                }
            }
        }
    }
    Ok(())
}

/// Per rank, the layer norm's gradients after the sequence-parallel reduction (on the host).
fn reduced_norm_grads(device: Device) -> AnyResult<Vec<Vec<Tensor>>> {
    let mut rng = Generator::new(5);
    let input = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let weights = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    Ok(run_local(2, |comm| -> AnyResult<Vec<Tensor>> {
        let tp = tp_context(comm, true);
        let norm = LayerNorm::new(&tp, "norm", HIDDEN, 1e-5, &MasterInit::new(7, 0.2))?;
        for p in norm.parameters() {
            p.param.set_value(p.param.value()?.to_device(device)?)?;
        }
        let (rank, size) = (tp.rank(), tp.size());
        let x = part(&input, 0, rank, size).to_device(device)?;
        let w = part(&weights, 0, rank, size).to_device(device)?;
        norm.forward(&Tape::new(), &x)?.mul(&w)?.sum()?.backward()?;
        let before = transfers(device);
        all_reduce_sequence_parallel_grads(&norm, tp.group())?;
        // The sum runs on the gradients' own memory (CUDA tensors lend host copies to
        // the local backend: not checked there).
        if !matches!(device, Device::Cuda(_)) {
            let moved = transfers(device) - before;
            assert_eq!(moved, Transfers::default(), "{device}");
        }
        norm.parameters()
            .into_iter()
            .map(|p| {
                let grad = p.param.grad().expect("every parameter gets a gradient");
                assert_eq!(
                    grad.device(),
                    device,
                    "{} grad stays on the device",
                    p.param.name()
                );
                Ok(grad.to_device(Device::Cpu)?)
            })
            .collect()
    })?)
}

#[test]
fn sequence_parallel_grad_reduction_keeps_gradients_on_the_device() -> AnyResult<()> {
    let cpu = reduced_norm_grads(Device::Cpu)?;
    // Reduced: both ranks hold the gradient of the whole sequence.
    for (a, b) in cpu[0].iter().zip(&cpu[1]) {
        assert_close("cpu rank 1 vs rank 0", b, a);
    }
    for device in devices() {
        let got = reduced_norm_grads(device)?;
        for (rank, (have, want)) in got.iter().zip(&cpu).enumerate() {
            for (index, (g, w)) in have.iter().zip(want).enumerate() {
                assert_close(&format!("{device} rank {rank} grad {index}"), g, w);
            }
        }
    }
    Ok(())
}
