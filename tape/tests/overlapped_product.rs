//! A product whose backward hands its first operand's gradient to a hook before it
//! queues the second operand's (`matmul_transposed_overlapped`, the shape of Megatron's
//! asynchronous tensor-parallel all-reduce): the hook starts after the input gradient's
//! GEMM and finishes after the weight gradient's, and the gradients are bit for bit those
//! of `matmul_transposed` with the hook's work applied, in f32 and bf16, on every device.
//! The CPU refuses it (nothing could overlap there).

#[path = "support/device.rs"]
mod device;

use std::sync::{Arc, Mutex};

use ferrotron_tape::profile::{self, Profile};
use ferrotron_tape::{
    DType, Device, Error, Generator, InputGradHook, Parameter, PendingGrad, Result, Tape, Tensor,
};

/// Triples the gradient when finished, keeping the launches queued before it started and
/// between its start and its finish.
struct Triple {
    device: Device,
    seen: Arc<Mutex<Vec<Profile>>>,
}

impl InputGradHook<f32> for Triple {
    fn start(&self, grad: Tensor) -> Result<PendingGrad<f32>> {
        let profiled = |e| Error::custom("profile", e);
        self.seen
            .lock()
            .unwrap()
            .push(profile::finish().map_err(profiled)?);
        profile::start(self.device);
        let seen = self.seen.clone();
        Ok(Box::new(move || {
            seen.lock()
                .unwrap()
                .push(profile::finish().map_err(profiled)?);
            grad.scale(3.0)
        }))
    }
}

/// `x·wᵀ` over `[6, 5]·[4, 5]ᵀ` in `dtype` on `device`, backward from a fixed gradient;
/// with `hook`, overlapped. Returns x's and w's gradients.
fn gradients(
    device: Device,
    dtype: DType,
    hook: Option<Arc<dyn InputGradHook<f32>>>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut rng = Generator::new(3);
    let mut param = |name: &str, shape: &[usize]| -> Result<Parameter> {
        let value: Tensor = Tensor::randn(shape, 1.0, &mut rng).to_dtype(dtype)?;
        Ok(Parameter::new(name, value.to_device(device)?))
    };
    let (x, w) = (param("x", &[6, 5])?, param("w", &[4, 5])?);
    let upstream: Tensor = Tensor::randn(&[6, 4], 1.0, &mut rng).to_device(device)?;
    let tape = Tape::new();
    let (xs, ws) = (tape.watch(&x)?, tape.watch(&w)?);
    profile::start(device);
    let y = match hook {
        Some(hook) => xs.matmul_transposed_overlapped(&ws, hook)?,
        None => xs.matmul_transposed(&ws)?,
    };
    y.backward_with_grad(&upstream.to_dtype(y.dtype())?)?;
    let grad = |p: &Parameter| p.grad().expect("a gradient").to_dtype(DType::F32)?.to_vec();
    Ok((grad(&x)?, grad(&w)?))
}

#[test]
fn the_hook_runs_between_the_two_gradients_and_gives_the_plain_products_values() {
    for device in device::devices() {
        for dtype in [DType::F32, DType::BF16] {
            let case = format!("{dtype:?} on {device}");
            let (x_plain, w_plain) = gradients(device, dtype, None).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let hook = Arc::new(Triple {
                device,
                seen: seen.clone(),
            });
            let (x_grad, w_grad) = gradients(device, dtype, Some(hook)).unwrap();
            // A parameter's gradient is f32 in either format (the main gradient).
            let tripled: Vec<f32> = Tensor::from_vec(x_plain, &[6, 5])
                .and_then(|g| g.scale(3.0)?.to_vec())
                .unwrap();
            assert_eq!(x_grad, tripled, "{case}: x's gradient");
            assert_eq!(w_grad, w_plain, "{case}: w's gradient");
            // Forward and the input gradient before the hook starts; the weight gradient
            // (one more GEMM) between its start and its finish.
            let seen = seen.lock().unwrap();
            let gemms = |p: &Profile| -> u64 {
                let gemm = |k: &&ferrotron_tape::profile::KernelStats| k.name.contains("gemm");
                p.kernels.iter().filter(gemm).map(|k| k.launches).sum()
            };
            assert_eq!(seen.len(), 2, "{case}");
            assert_eq!(
                (gemms(&seen[0]), gemms(&seen[1])),
                (2, 1),
                "{case}: {seen:#?}"
            );
        }
    }
}

#[test]
fn the_cpu_refuses_it() {
    let x = Tensor::<f32>::zeros(&[2, 3]);
    let w = Tensor::<f32>::zeros(&[4, 3]);
    let hook = Arc::new(Triple {
        device: Device::Cpu,
        seen: Arc::default(),
    });
    let error = x.matmul_transposed_overlapped(&w, hook).unwrap_err();
    assert!(matches!(error, Error::UnsupportedDevice { .. }), "{error}");
}
