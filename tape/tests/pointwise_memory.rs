//! Pointwise ops, masked fill, dropout, softmax and layer norm on 16-bit device tensors
//! read their inputs as stored and round their result once as they write it: the only
//! memory an op takes is its result, in its format, with no widened copy of an input and
//! no f32 result to narrow; reductions take only their partial sums. Their backward reads
//! what it kept (a 16-bit input, operand or output) as stored too, and takes only the f32
//! gradient (a counting allocator: this test binary has one test, so nothing else
//! allocates meanwhile; the emulator's memory comes from the same allocator). Their values
//! are pinned against f32 by `low_precision.rs`. CUDA memory is not the host allocator's,
//! so on a GPU the byte counts pin nothing and only the result formats are checked.

#[path = "support/counting.rs"]
mod counting;
#[path = "support/device.rs"]
mod device;

use ferrotron_tape::{DType, Gelu, Generator, Parameter, Tape, Tensor};

const ROWS: usize = 64;
const COLS: usize = 256;

/// Makes a tensor from the ones under test.
type Make<'a> = &'a dyn Fn() -> ferrotron_tape::Result<Tensor>;

/// An op on the tensors under test.
type Inputs<'a> = &'a dyn Fn(&[Tensor]) -> ferrotron_tape::Result<Tensor>;

#[test]
fn sixteen_bit_pointwise_ops_take_only_their_result() -> ferrotron_tape::Result<()> {
    let mut rng = Generator::new(17);
    let values = Tensor::randn(&[ROWS, COLS], 1.0, &mut rng);
    let bias = Tensor::randn(&[COLS], 1.0, &mut rng);
    for device in device::devices() {
        for dtype in [DType::BF16, DType::F16] {
            let x = values.to_device(device)?.to_dtype(dtype)?;
            let y = values.scale(0.5)?.to_device(device)?.to_dtype(dtype)?;
            let row = bias.to_device(device)?.to_dtype(dtype)?;
            let f32_row = bias.to_device(device)?;
            // The emulated device's first cooperative launch on its worker thread sets up
            // the worker's runner, once; measure the ops after it.
            drop(x.softmax()?);
            ferrotron_tape::synchronize(device)?;
            let n = (ROWS * COLS) as isize;
            let half = n * dtype.size_in_bytes() as isize;
            // A reduction's partial sums: far below the 4n bytes of a widened copy.
            let partial_sums = n / 4;
            let every_other_column = ferrotron_tape::ndarray::ArrayD::from_shape_fn(
                ferrotron_tape::ndarray::IxDyn(&[COLS]),
                |i| i[0] % 2 == 0,
            );
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

            // The gradient of a 16-bit result is kept in its format.
            let grad = Tensor::full_as(&[ROWS, COLS], 1.0, dtype, device)?;
            // Each op's inputs (all parameters) and what its backward needs: the f32
            // gradients of its inputs, and for tanh its recomputed f32 output.
            let (one, two) = (4 * n, 8 * n);
            let backwards: [(&str, Vec<&Tensor>, Inputs<'_>, isize); 7] = [
                ("gelu", vec![&x], &|t| t[0].gelu(Gelu::Erf), one),
                ("exp", vec![&x], &|t| t[0].exp(), one),
                ("tanh", vec![&x], &|t| t[0].tanh(), two),
                ("softmax", vec![&x], &|t| t[0].softmax(), one),
                // Each operand's gradient reads the other operand as stored.
                ("mul", vec![&x, &y], &|t| t[0].mul(&t[1]), two),
                ("div's numerator", vec![&x], &|t| t[0].div(&y), one),
                // Its input as stored; the weight's and bias's gradients are COLS-wide
                // partial sums.
                (
                    "layer_norm",
                    vec![&x, &row, &row],
                    &|t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5),
                    one + partial_sums,
                ),
            ];
            for (name, inputs, op, needed) in backwards {
                let params: Vec<Parameter> = (inputs.iter().enumerate())
                    .map(|(i, &value)| Parameter::new(format!("x{i}"), value.clone()))
                    .collect();
                let tape = Tape::new();
                let watched: Vec<Tensor> = params
                    .iter()
                    .map(|p| tape.watch(p))
                    .collect::<std::result::Result<_, _>>()?;
                let out = op(&watched)?;
                counting::reset_peak();
                let before = counting::live();
                out.backward_with_grad(&grad)?;
                let taken = counting::peak() - before;
                assert!(
                    params.iter().all(Parameter::has_grad),
                    "{name}: every input gets a gradient"
                );
                assert!(
                    taken <= needed + needed / 8,
                    "{name}'s backward in {dtype} on {device} took {taken} bytes for {needed}"
                );
            }
        }
    }
    Ok(())
}
