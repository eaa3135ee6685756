//! The TP × DP equivalence of `tp_dp_equivalence.rs` with the parallel run's parameters,
//! activations, gradients and optimizer state on a device: TP = 2 × DP = 2 training with
//! DDP for 3 steps equals the serial CPU model. The emulator runs everywhere; `cuda:0`
//! runs where a GPU is present (otherwise the test prints `skipped: …`).

mod support;

use ferrotron_tape::{Device, Tensor};
use support::{assert_matches_serial, train_parallel, train_serial, Arch, Opt, Setup};

fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Emulated];
    match Tensor::<f32>::zeros(&[1]).to_device(Device::Cuda(0)) {
        Ok(_) => devices.push(Device::Cuda(0)),
        Err(reason) => println!("skipped on cuda:0: {reason}"),
    }
    devices
}

#[test]
fn tp_dp_training_on_a_device_equals_the_serial_cpu_model() -> anyhow::Result<()> {
    for device in devices() {
        for (arch, sequence_parallel, opt) in [
            (Arch::Mlp, false, Opt::Sgd),
            (Arch::Blocks(1), true, Opt::AdamW),
        ] {
            let setup = Setup {
                sequence_parallel,
                device,
                ..Setup::new(arch, 2, 2, opt, 3)
            };
            let ranks = train_parallel(&setup)?;
            for rank in &ranks {
                for (name, _, value) in &rank.params {
                    assert_eq!(value.device(), device, "{name} left the device");
                }
            }
            let serial = train_serial(&setup)?;
            assert_matches_serial(&format!("{device} {arch:?}"), &setup, &ranks, &serial);
        }
    }
    Ok(())
}
