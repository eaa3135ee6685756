//! Pointwise ops, masked fill, dropout, softmax and layer norm on 16-bit device tensors
//! read their inputs as stored and round their result once as they write it: the only
//! memory an op takes is its result, in its format, with no widened copy of an input and
//! no f32 result to narrow; reductions take only their partial sums. Their backward reads
//! what it kept (a 16-bit input, operand or output) as stored too, and takes only the f32
//! gradient (a counting allocator: this test binary has one test, so nothing else
//! allocates meanwhile; the emulator's memory comes from the same allocator). Their values
//! are pinned against f32 by `low_precision.rs`.

#[path = "support/counting.rs"]
mod counting;
#[path = "support/device.rs"]
mod device;

use tape::{DType, Gelu, Generator, Parameter, Tape, Tensor};

const ROWS: usize = 64;
const COLS: usize = 256;

/// Makes a tensor from the ones under test.
type Make<'a> = &'a dyn Fn() -> tape::Result<Tensor>;

/// An op on the tensor under test.
type OneInput<'a> = &'a dyn Fn(&Tensor) -> tape::Result<Tensor>;

#[test]
fn sixteen_bit_pointwise_ops_take_only_their_result() -> tape::Result<()> {
    let mut rng = Generator::new(17);
    let values = Tensor::randn(&[ROWS, COLS], 1.0, &mut rng);
    let bias = Tensor::randn(&[COLS], 1.0, &mut rng);
    for device in device::devices() {
        for dtype in [DType::BF16, DType::F16] {
            let x = values.to_device(device)?.to_dtype(dtype)?;
            let y = values.scale(0.5)?.to_device(device)?.to_dtype(dtype)?;
            let row = bias.to_device(device)?.to_dtype(dtype)?;
            let f32_row = bias.to_device(device)?;
            let n = (ROWS * COLS) as isize;
            let half = n * dtype.size_in_bytes() as isize;
            // A reduction's partial sums: far below the 4n bytes of a widened copy.
            let partial_sums = n / 4;
            let every_other_column =
                tape::ndarray::ArrayD::from_shape_fn(tape::ndarray::IxDyn(&[COLS]), |i| {
                    i[0] % 2 == 0
                });
            let ops: [(&str, isize, Make<'_>); 15] = [
                ("full_as", half, &|| {
                    Tensor::full_as(&[ROWS, COLS], 0.5, dtype, device)
                }),
                ("add", half, &|| x.add(&y)),
                ("mul by a broadcast row", half, &|| x.mul(&row)),
                ("scale", half, &|| x.scale(0.25)),
                ("exp", half, &|| x.exp()),
                ("gelu", half, &|| x.gelu(Gelu::Tanh)),
                ("softmax", half, &|| x.softmax()),
                ("log_softmax", half, &|| x.log_softmax()),
                // Its two f32 statistics per row are within the slack.
                ("layer_norm", half, &|| {
                    x.layer_norm(Some(&row), Some(&row), 1e-5)
                }),
                // An f32 operand makes the result f32; the 16-bit one is still read as is.
                ("add an f32 row", 4 * n, &|| x.add(&f32_row)),
                ("masked_fill by a broadcast row", half, &|| {
                    x.masked_fill(&every_other_column, -1.0e4)
                }),
                // Its keep mask, one byte per element on the host and on the device.
                ("dropout", half + 2 * n, &|| {
                    x.dropout(0.25, &mut Generator::new(3))
                }),
                ("sum", partial_sums, &|| x.sum()),
                ("sum_dim", partial_sums, &|| x.sum_dim(1, false)),
                ("max_dim", partial_sums, &|| x.max_dim(1, true)),
            ];
            for (name, result, op) in ops {
                counting::reset_peak();
                let before = counting::live();
                let out = op()?;
                let taken = counting::peak() - before;
                assert!(
                    taken <= result + result / 8,
                    "{name} of {dtype} on {device} took {taken} bytes for a {result}-byte result"
                );
                let expected = if name == "add an f32 row" {
                    DType::F32
                } else {
                    dtype
                };
                assert_eq!(out.dtype(), expected, "{name}");
            }

            let grad = Tensor::full_on(&[ROWS, COLS], 1.0, device)?;
            let backwards: [(&str, OneInput<'_>); 7] = [
                ("gelu", &|x| x.gelu(Gelu::Erf)),
                ("exp", &|x| x.exp()),
                ("tanh", &|x| x.tanh()),
                ("softmax", &|x| x.softmax()),
                // Backward reads the other 16-bit operand as stored.
                ("mul", &|x| x.mul(&y)),
                ("div", &|x| x.div(&y)),
                // Its input and weight as stored; the weight's and bias's gradients are
                // COLS-wide partial sums.
                ("layer_norm", &|x| {
                    x.layer_norm(Some(&row), Some(&row), 1e-5)
                }),
            ];
            for (name, op) in backwards {
                let p = Parameter::new("x", x.clone());
                let tape = Tape::new();
                let out = op(&tape.watch(&p))?;
                counting::reset_peak();
                let before = counting::live();
                out.backward_with_grad(&grad)?;
                let taken = counting::peak() - before;
                // Tanh recomputes its f32 output from a kept 16-bit input.
                let needed = if name == "tanh" { 8 * n } else { 4 * n };
                let needed = if name == "layer_norm" {
                    needed + partial_sums
                } else {
                    needed
                };
                assert!(
                    taken <= needed + needed / 8,
                    "{name}'s backward in {dtype} on {device} took {taken} bytes for {needed}"
                );
            }
        }
    }
    Ok(())
}
