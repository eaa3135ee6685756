//! What a recorded graph holds for backward: with bf16 or f16 activations and weights,
//! half of what the same graph holds in f32 (and f32 layer norm keeps no copy of
//! its normalized input), on the CPU and the emulated device (a
//! counting allocator: this test binary has one test, so nothing else allocates
//! meanwhile; the emulator's memory comes from the same allocator).

#[path = "support/counting.rs"]
mod counting;

use ferrotron_tape::{DType, Device, Gelu, Generator, Parameter, Tape, Tensor};

const ROWS: usize = 128;
const WIDTH: usize = 256;

/// Bytes the graph of `softmax(gelu(ln(x)·W1)·W2) * x` holds between forward and backward, with the
/// parameters and input stored as `dtype` on `device` (their own bytes not counted).
fn held_for_backward(dtype: DType, device: Device) -> ferrotron_tape::Result<isize> {
    let mut rng = Generator::new(1);
    let make =
        |name: &str, shape: &[usize], rng: &mut Generator| -> ferrotron_tape::Result<Parameter> {
            let value = Tensor::randn(shape, 0.1, rng)
                .to_device(device)?
                .to_dtype(dtype)?;
            Ok(Parameter::new(name, value))
        };
    let x = make("x", &[ROWS, WIDTH], &mut rng)?;
    let w1 = make("w1", &[WIDTH, WIDTH], &mut rng)?;
    let w2 = make("w2", &[WIDTH, WIDTH], &mut rng)?;
    let tape = Tape::new();
    let (x_in, w1_in, w2_in) = (tape.watch(&x)?, tape.watch(&w1)?, tape.watch(&w2)?);
    let before = counting::live();
    let loss = {
        let normed = x_in.layer_norm(None, None, 1e-5)?;
        let hidden = normed.matmul(&w1_in)?.gelu(Gelu::Tanh)?;
        hidden.matmul(&w2_in)?.softmax()?.mul(&x_in)?.sum()?
    };
    let held = counting::live() - before;
    loss.backward()?;
    for p in [&x, &w1, &w2] {
        assert!(
            p.grad().is_some(),
            "{dtype} {device}: {} has a gradient",
            p.name()
        );
    }
    Ok(held)
}

#[test]
fn sixteen_bit_graphs_hold_about_half_of_what_f32_graphs_hold() -> ferrotron_tape::Result<()> {
    for device in [Device::Cpu, Device::Emulated] {
        let f32_bytes = held_for_backward(DType::F32, device)?;
        // The normalized input, the hidden activation before and after GELU and the
        // softmax's output: four [ROWS, WIDTH] arrays of f32 (the input is the caller's).
        let activations = (4 * ROWS * WIDTH * 4) as isize;
        assert!(
            f32_bytes >= activations && f32_bytes < activations + activations / 4,
            "{device}: f32 holds {f32_bytes} bytes"
        );
        for dtype in [DType::BF16, DType::F16] {
            let bytes = held_for_backward(dtype, device)?;
            // Each 16-bit array takes half the bytes, and the softmax's backward reads the
            // rounded output the product after it keeps: four half-size arrays against
            // four, half (the bookkeeping besides is a few hundred bytes).
            assert!(
                bytes <= f32_bytes * 51 / 100,
                "{device}: {dtype} holds {bytes} bytes, f32 {f32_bytes}"
            );
        }
    }
    Ok(())
}
