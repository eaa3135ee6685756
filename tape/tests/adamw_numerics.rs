//! AdamW in f32 follows PyTorch's f32 `torch.optim.AdamW` to 1e-6 relative over 100
//! updates, on every path that steps it: the optimizer on the CPU and on the devices, and
//! the update on views of flat storage that a sharded optimizer runs. Forming `1 − β2` in
//! f32 (a second moment 1.3e-5 too small) puts these parameters 4e-6 off.

#[path = "support/device.rs"]
mod device;

use ferrotron_tape::{
    AdamW, AdamWConfig, AdamWUpdate, Device, FlatStorage, FlatView, Optimizer, ParamOptions,
    Parameter, Tensor,
};

const N: usize = 8;
const STEPS: u32 = 100;

// Printed by `tests/fixtures/torch_adamw_f32.py`, torch 2.15.0.
const DEFAULT_BETAS: [f32; 8] = [
    1.2913785, -1.4123168, 1.5080044, -1.624945, 1.7385186, -1.861048, 1.9730217, -2.0820796,
];
const SMALL_BETA1: [f32; 8] = [
    1.3330867, -1.4639852, 1.5581086, -1.6764207, 1.7987863, -1.9302751, 2.060382, -2.1587927,
];

fn config(run: &str) -> AdamWConfig {
    match run {
        "default betas" => AdamWConfig {
            lr: 1e-2,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.1,
        },
        _ => AdamWConfig {
            lr: 1e-2,
            betas: (0.3, 0.95),
            eps: 1e-6,
            weight_decay: 0.05,
        },
    }
}

fn runs() -> [(&'static str, [f32; N]); 2] {
    [
        ("default betas", DEFAULT_BETAS),
        ("β1 below one half", SMALL_BETA1),
    ]
}

fn initial() -> Vec<f32> {
    (0..N)
        .map(|i| match i % 2 {
            0 => 0.5 + 0.125 * i as f32,
            _ => -0.5 - 0.125 * i as f32,
        })
        .collect()
}

/// The k-th update's gradient, exactly representable and of the opposite sign of its
/// parameter (so that the parameters move away from zero by about lr per update):
/// ∓((7k + 13i) mod 17 + 1) / 8.
fn gradient(k: u32) -> Vec<f32> {
    (0..N as u32)
        .map(|i| {
            let magnitude = ((7 * k + 13 * i) % 17 + 1) as f32 / 8.0;
            if i % 2 == 0 {
                -magnitude
            } else {
                magnitude
            }
        })
        .collect()
}

fn assert_close(got: &[f32], torch: &[f32; N], what: &str) {
    for (i, (g, t)) in got.iter().zip(torch).enumerate() {
        let relative = ((g - t) / t).abs();
        assert!(
            relative <= 1e-6,
            "{what}: parameter {i} is {g}, torch's {t} ({relative:.2e} relative)"
        );
    }
}

#[test]
fn adamw_follows_torch_f32_for_100_updates_on_every_device() {
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    for device in devices {
        for (run, torch) in runs() {
            let value = Tensor::from_vec(initial(), &[N]).unwrap();
            let param = Parameter::new("w", value.to_device(device).unwrap());
            let mut adamw = AdamW::new(vec![param.clone()], config(run)).unwrap();
            for k in 1..=STEPS {
                let grad = Tensor::from_vec(gradient(k), &[N]).unwrap();
                param
                    .set_grad(Some(grad.to_device(device).unwrap()))
                    .unwrap();
                adamw.step().unwrap();
            }
            let got = param.value().unwrap().to_vec().unwrap();
            assert_close(&got, &torch, &format!("{run} on {device}"));
        }
    }
}

#[test]
fn adamw_updates_on_flat_views_follow_torch_f32() {
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    let view = |device, values: Vec<f32>| {
        let storage = FlatStorage::zeros(device, N).unwrap();
        let view = FlatView::new(&storage, 0, &[N]).unwrap();
        let tensor = Tensor::from_vec(values, &[N]).unwrap();
        view.copy_from(&tensor.to_device(device).unwrap()).unwrap();
        view
    };
    for device in devices {
        for (run, torch) in runs() {
            let (values, m, v) = (
                view(device, initial()),
                view(device, vec![0.0; N]),
                view(device, vec![0.0; N]),
            );
            for k in 1..=STEPS {
                let grads = view(device, gradient(k));
                let update = AdamWUpdate::new(&config(run), ParamOptions::default(), k);
                update.apply_views(&values, &grads, &m, &v).unwrap();
            }
            let got = values.to_tensor().unwrap().to_vec().unwrap();
            assert_close(&got, &torch, &format!("{run}, flat views on {device}"));
        }
    }
}
