//! Device-versus-CPU harness: runs one computation on the CPU and on every available
//! device (always the emulator; CUDA when built with `cuda` and a GPU is present) and
//! compares the output and every input gradient.
#![allow(dead_code)] // each test file uses part of it

use ferrotron_tape::{DType, Device, Element, Generator, Parameter, Result, Tape, Tensor};

/// Devices to check: the emulator always; `cuda:0` when it can be opened (otherwise the
/// reason is printed as `skipped: …`).
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Emulated];
    match Tensor::<f32>::zeros(&[1]).to_device(Device::Cuda(0)) {
        Ok(_) => devices.push(Device::Cuda(0)),
        Err(reason) => println!("skipped on cuda:0: {reason}"),
    }
    devices
}

/// Inputs of a case: shapes, and the interval their values are drawn from.
pub struct Inputs {
    pub shapes: Vec<Vec<usize>>,
    pub low: f64,
    pub high: f64,
}

impl Inputs {
    pub fn new(shapes: &[&[usize]]) -> Inputs {
        Inputs {
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
            low: -2.0,
            high: 2.0,
        }
    }

    pub fn range(mut self, low: f64, high: f64) -> Inputs {
        self.low = low;
        self.high = high;
        self
    }
}

/// A computation under test: inputs to output.
type Computation<'a, T> = dyn Fn(&[Tensor<T>]) -> Result<Tensor<T>> + 'a;

/// What one device computed: the output's values and shape, and each input's gradient.
struct Run<T> {
    output: Vec<T>,
    shape: Vec<usize>,
    grads: Vec<Vec<T>>,
}

/// Output and input gradients of `f` on `device`, for `loss = Σ f(inputs) · weights`.
fn run<T: Element>(device: Device, values: &[Tensor<T>], f: &Computation<'_, T>) -> Result<Run<T>> {
    let tape = Tape::<T>::new();
    let params: Vec<Parameter<T>> = values
        .iter()
        .enumerate()
        .map(|(i, v)| Ok(Parameter::new(format!("x{i}"), v.to_device(device)?)))
        .collect::<Result<_>>()?;
    let watched: Vec<Tensor<T>> = params
        .iter()
        .map(|p| tape.watch(p))
        .collect::<std::result::Result<_, _>>()?;
    let out = f(&watched)?;
    assert_eq!(
        out.device(),
        device,
        "the op's output stays on the inputs' device"
    );
    // Weights make every output element's gradient different, so a wrong index shows.
    let mut generator = Generator::new(7);
    let weights = Tensor::<T>::uniform(out.shape(), 0.5, 1.5, &mut generator).to_device(device)?;
    let loss = out.mul(&weights)?.sum()?;
    loss.backward()?;
    let grads = params
        .iter()
        .map(|p| match p.grad() {
            Some(g) => {
                assert_eq!(g.device(), device, "gradients stay on the device");
                g.to_vec()
            }
            None => Ok(vec![T::zero(); p.numel()]),
        })
        .collect::<Result<_>>()?;
    Ok(Run {
        output: out.to_vec()?,
        shape: out.shape().to_vec(),
        grads,
    })
}

fn max_difference<T: Element>(a: &[T], b: &[T]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x.into_f64() - y.into_f64()).abs())
        .fold(0.0, f64::max)
}

/// Checks `f` on every device against the CPU: outputs and gradients within `tolerance`
/// (relative to the largest magnitude involved).
pub fn check<T: Element>(
    name: &str,
    inputs: Inputs,
    tolerance: f64,
    f: impl Fn(&[Tensor<T>]) -> Result<Tensor<T>>,
) {
    let mut generator = Generator::new(name.len() as u64 * 31 + 1);
    let values: Vec<Tensor<T>> = inputs
        .shapes
        .iter()
        .map(|s| Tensor::uniform(s, inputs.low, inputs.high, &mut generator))
        .collect();
    let Run {
        output: cpu_out,
        shape: cpu_shape,
        grads: cpu_grads,
    } = run(Device::Cpu, &values, &f).unwrap_or_else(|e| panic!("{name} on cpu: {e}"));
    for device in devices() {
        let Run {
            output: out,
            shape,
            grads,
        } = run(device, &values, &f).unwrap_or_else(|e| panic!("{name} on {device}: {e}"));
        assert_eq!(shape, cpu_shape, "{name} on {device}: output shape");
        let scale = cpu_out
            .iter()
            .map(|x| x.into_f64().abs())
            .fold(1.0, f64::max);
        let diff = max_difference(&out, &cpu_out);
        assert!(
            diff <= tolerance * scale,
            "{name} on {device}: output differs by {diff}"
        );
        for (i, (g, cpu_g)) in grads.iter().zip(&cpu_grads).enumerate() {
            let scale = cpu_g.iter().map(|x| x.into_f64().abs()).fold(1.0, f64::max);
            let diff = max_difference(g, cpu_g);
            assert!(
                diff <= tolerance * scale,
                "{name} on {device}: gradient of input {i} differs by {diff}"
            );
        }
    }
}

/// The output and the gradient of a `shape` input drawn in [-2, 2] for
/// `loss = Σ attend(input) · weights`, the input stored as `dtype` on `device`.
pub fn output_and_grad(
    device: Device,
    dtype: DType,
    shape: &[usize],
    attend: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    output_and_grad_rounded(device, dtype, dtype, shape, attend)
}

/// [`output_and_grad`] with the input rounded to `round`, then stored as `store`.
pub fn output_and_grad_rounded(
    device: Device,
    round: DType,
    store: DType,
    shape: &[usize],
    attend: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut generator = Generator::new(11);
    let value = Tensor::uniform(shape, -2.0, 2.0, &mut generator)
        .to_dtype(round)?
        .to_dtype(store)?;
    let qkv = Parameter::new("qkv", value.to_device(device)?);
    let tape = Tape::new();
    let out = attend(&tape.watch(&qkv)?)?;
    let weights: Tensor = Tensor::uniform(out.shape(), 0.5, 1.5, &mut generator);
    let loss = out
        .to_dtype(DType::F32)?
        .mul(&weights.to_device(device)?)?
        .sum()?;
    loss.backward()?;
    let grad = qkv.grad().expect("a gradient").to_vec()?;
    Ok((out.to_vec()?, grad))
}
