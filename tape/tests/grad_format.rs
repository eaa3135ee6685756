//! The format backward keeps gradients in: a 16-bit activation's gradient in its format
//! (each contribution rounded, and each sum of two rounded again, in the order backward
//! meets them, as PyTorch accumulates a bf16 gradient), a
//! parameter's (and a view's of it) in f32, a stand-in activation's like the activation
//! it replaces; the same bits on the CPU and every device, and on a device written
//! 16-bit by the kernels that make them, with no conversion launched.

#[path = "support/device.rs"]
mod device;

use device::devices;
use ferrotron_tape::profile;
use ferrotron_tape::{DType, Device, Gelu, Generator, Parameter, Result, Tape, Tensor};
use half::bf16;

fn round(values: &[f32]) -> Vec<f32> {
    values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

fn uniform(shape: &[usize], seed: u64) -> Tensor {
    Tensor::uniform(shape, -2.0, 2.0, &mut Generator::new(seed))
}

/// A bf16 parameter of `values` on `device`.
fn param(name: &str, values: &Tensor, device: Device) -> Result<Parameter> {
    Ok(Parameter::new(
        name,
        values.to_device(device)?.to_dtype(DType::BF16)?,
    ))
}

/// `h = x · 1` (a bf16 activation with x's values) used twice, `Σ h·w1 + Σ h·w2` with f32
/// weights: h's gradient is `round(round(w1) + round(w2))`, which x's gradient (f32, a
/// parameter's) equals exactly. Summing the unrounded weights first would round once.
#[test]
fn contributions_are_rounded_then_summed_once() -> Result<()> {
    let shape = [64];
    let (w1, w2) = (uniform(&shape, 1), uniform(&shape, 2));
    let expected: Vec<f32> = {
        let (a, b) = (round(&w1.to_vec()?), round(&w2.to_vec()?));
        round(&a.iter().zip(&b).map(|(x, y)| x + y).collect::<Vec<_>>())
    };
    let once = round(&w1.add(&w2)?.to_vec()?);
    assert_ne!(
        expected, once,
        "the weights must tell the two roundings apart"
    );
    for device in [Device::Cpu].into_iter().chain(devices()) {
        let x = param("x", &uniform(&shape, 3), device)?;
        let tape = Tape::new();
        let h = tape.watch(&x)?.scale(1.0)?;
        assert_eq!(h.grad_format(), DType::BF16);
        let (w1, w2) = (w1.to_device(device)?, w2.to_device(device)?);
        let loss = h.mul(&w1)?.sum()?.add(&h.mul(&w2)?.sum()?)?;
        loss.backward()?;
        let grad = x.grad().expect("x has a gradient");
        assert_eq!(grad.dtype(), DType::F32, "a parameter's gradient is f32");
        assert_eq!(grad.to_vec()?, expected, "on {device}");
    }
    Ok(())
}

/// Three contributions, 1, 2⁻⁸ and 2⁻⁸ (each exact in bf16), in the order backward
/// meets them (the reverse of the forward's): each sum of two is rounded, as PyTorch's
/// autograd adds a bf16 gradient in bf16. Meeting 1 first, 1 + 2⁻⁸ rounds (to even) to
/// 1 twice over, where summing all three and rounding once would give 1 + 2⁻⁷.
#[test]
fn three_contributions_are_summed_pairwise_in_backwards_order() -> Result<()> {
    let small = 2f32.powi(-8);
    for weights in [[small, small, 1.0], [1.0, small, small]] {
        let mut expected = 0.0f32;
        for (i, &w) in weights.iter().rev().enumerate() {
            expected = if i == 0 { w } else { round(&[expected + w])[0] };
        }
        let once = round(&[weights.iter().sum::<f32>()])[0];
        let distinguishes = expected != once;
        for device in [Device::Cpu].into_iter().chain(devices()) {
            let x = param("x", &Tensor::ones(&[4]), device)?;
            let tape = Tape::new();
            let h = tape.watch(&x)?.scale(1.0)?;
            let mut loss = None;
            for w in weights {
                let term = h.scale(f64::from(w))?.sum()?;
                loss = Some(match loss {
                    None => term,
                    Some(sum) => term.add(&sum)?,
                });
            }
            loss.expect("three terms").backward()?;
            let grad = x.grad().expect("x has a gradient").to_vec()?;
            assert_eq!(grad, [expected; 4], "weights {weights:?} on {device}");
        }
        if weights[2] == 1.0 {
            assert!(distinguishes, "meeting 1 first tells the rules apart");
        }
    }
    Ok(())
}

/// A weight read through a transpose (the CPU's `matmul_transposed`) gets the f32
/// gradient a device's product reading it transposed in place gives: a view of a
/// parameter keeps the parameter's gradient format.
#[test]
fn a_view_of_a_parameter_keeps_f32_gradients() -> Result<()> {
    let mut grads = Vec::new();
    for device in [Device::Cpu].into_iter().chain(devices()) {
        let x = param("x", &uniform(&[2, 5, 16], 4), device)?;
        let w = param("w", &uniform(&[3, 16], 5), device)?;
        let tape = Tape::new();
        let watched = tape.watch(&w)?;
        assert_eq!(watched.transpose(0, 1)?.grad_format(), DType::F32);
        let y = tape.watch(&x)?.scale(1.0)?.matmul_transposed(&watched)?;
        let weights = uniform(y.shape(), 6).to_device(device)?;
        y.mul(&weights)?.sum()?.backward()?;
        let grad = w.grad().expect("w has a gradient");
        assert_eq!(grad.dtype(), DType::F32, "on {device}");
        grads.push(grad.to_vec()?);
    }
    assert!(grads.windows(2).all(|pair| pair[0] == pair[1]), "{grads:?}");
    Ok(())
}

/// A stand-in for an activation (as recomputation and pipeline stages make them) gets
/// the gradient the activation gets in the whole graph, in its format; a parameter in
/// its place would get the unrounded f32 one.
#[test]
fn a_stand_in_gets_the_activations_bits() -> Result<()> {
    for device in [Device::Cpu].into_iter().chain(devices()) {
        let weights = uniform(&[4, 32], 7).to_device(device)?;
        let head = |h: &Tensor| -> Result<Tensor> {
            h.gelu(Gelu::Tanh)?.scale(0.37)?.mul(&weights)?.sum()
        };
        let x = param("x", &uniform(&[4, 32], 8), device)?;
        let tape = Tape::new();
        let h = tape.watch(&x)?.scale(1.0)?;
        head(&h)?.backward()?;
        let whole = x.grad().expect("x has a gradient").to_vec()?;

        let stand_in = Parameter::activation("h", h.detach());
        let replay = Tape::new();
        head(&replay.watch(&stand_in)?)?.backward()?;
        let grad = stand_in.grad().expect("the stand-in has a gradient");
        assert_eq!(grad.dtype(), DType::BF16, "on {device}");
        assert_eq!(grad.to_vec()?, whole, "on {device}");

        let parameter = Parameter::new("h", h.detach());
        let replay = Tape::new();
        head(&replay.watch(&parameter)?)?.backward()?;
        let unrounded = parameter.grad().expect("a gradient").to_vec()?;
        assert_ne!(
            unrounded, whole,
            "on {device}: a parameter's is not rounded"
        );
    }
    Ok(())
}

/// A transformer block's backward in bf16 on a device: every activation gradient is
/// written 16-bit by the kernel that computes it (no `convert_half`), and the block's
/// input gradient matches the CPU's exactly (the parameters' f32 sums, ordered
/// differently, to 1e-5).
#[test]
fn a_blocks_backward_writes_16_bit_gradients_directly() -> Result<()> {
    let (s, b, heads, d) = (8, 2, 2, 4);
    let hidden = heads * d;
    let block = |device: Device, profiled: bool| -> Result<Vec<Vec<f32>>> {
        let shapes: [(&str, Vec<usize>); 8] = [
            ("x", vec![s, b, hidden]),
            ("ln_w", vec![hidden]),
            ("ln_b", vec![hidden]),
            ("qkv", vec![3 * hidden, hidden]),
            ("fc1", vec![4 * hidden, hidden]),
            ("fc1_b", vec![4 * hidden]),
            ("fc2", vec![hidden, 4 * hidden]),
            ("fc2_b", vec![hidden]),
        ];
        let params: Vec<Parameter> = (shapes.iter().enumerate())
            .map(|(i, (name, shape))| param(name, &uniform(shape, 10 + i as u64), device))
            .collect::<Result<_>>()?;
        let tape = Tape::new();
        let w: Vec<Tensor> = params
            .iter()
            .map(|p| tape.watch(p))
            .collect::<std::result::Result<_, _>>()?;
        let x = w[0].scale(1.0)?;
        let normed = x.layer_norm(Some(&w[1]), Some(&w[2]), 1e-5)?;
        let qkv = normed
            .matmul_transposed(&w[3])?
            .reshape(&[s, b, heads, 3, d])?;
        let context = qkv.packed_causal_attention(0.5, Some((0.1, &mut Generator::new(1))))?;
        let residual = context.add(&x)?;
        let inner = residual
            .matmul_transposed(&w[4])?
            .bias_gelu(&w[5], Gelu::Tanh)?;
        let branch = inner.matmul_transposed(&w[6])?;
        let mut generator = Generator::new(2);
        let out = branch.bias_dropout_add(Some(&w[7]), &residual, Some((0.1, &mut generator)))?;
        let weights = uniform(out.shape(), 3).to_device(device)?;
        let loss = out.to_dtype(DType::F32)?.mul(&weights)?.sum()?;
        if profiled {
            profile::start(device);
        }
        loss.backward()?;
        if profiled {
            let kernels = profile::finish().expect("a profile").kernels;
            assert!(
                kernels.iter().all(|k| !k.name.starts_with("convert_half")),
                "{kernels:#?}"
            );
        }
        params
            .iter()
            .map(|p| p.grad().expect("every parameter has a gradient").to_vec())
            .collect()
    };
    let expected = block(Device::Cpu, false)?;
    for device in devices() {
        let got = block(device, device == Device::Emulated)?;
        assert_eq!(got[0], expected[0], "the input's gradient on {device}");
        for (got, expected) in got.iter().zip(&expected).skip(1) {
            let scale = expected.iter().fold(1f32, |m, v| m.max(v.abs()));
            let worst = (got.iter().zip(expected)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1e-5 * scale, "{worst} of {scale} on {device}");
        }
    }
    Ok(())
}
