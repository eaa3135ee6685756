//! Elementwise ops, reductions and matrix products on devices equal the CPU, forward and
//! backward (see `support/device.rs`). Runs on the emulator everywhere and on CUDA when a
//! GPU is present.

#[path = "support/device.rs"]
mod device;

use device::{check, Inputs};
use ferrotron_tape::{Gelu, Tensor};

const F64: f64 = 1e-12;
const F32: f64 = 1e-5;

#[test]
fn broadcasting_arithmetic() {
    // Runs of summed dimensions, apart and joined through size-1 ones, reduce as one.
    let shapes: [(&[usize], &[usize]); 7] = [
        (&[3, 4], &[3, 4]),
        (&[2, 3, 4], &[4]),
        (&[2, 3, 4], &[3, 1]),
        (&[1, 3, 1], &[2, 1, 5]),
        (&[], &[2, 2]),
        (&[2, 3, 4, 5], &[3, 1, 1]),
        (&[2, 1, 4, 5], &[5]),
    ];
    for (a, b) in shapes {
        let inputs = || Inputs::new(&[a, b]);
        check::<f64>("add", inputs(), F64, |x| x[0].add(&x[1]));
        check::<f64>("sub", inputs(), F64, |x| x[0].sub(&x[1]));
        check::<f64>("mul", inputs(), F64, |x| x[0].mul(&x[1]));
        let positive = Inputs::new(&[a, b]).range(0.5, 2.0);
        check::<f64>("div", positive, F64, |x| x[0].div(&x[1]));
    }
    check::<f32>("add f32", Inputs::new(&[&[4, 5], &[5]]), F32, |x| {
        x[0].add(&x[1])
    });
}

#[test]
fn pointwise_functions() {
    let shape: &[usize] = &[3, 7];
    check::<f64>("scale", Inputs::new(&[shape]), F64, |x| x[0].scale(-1.5));
    check::<f64>("neg", Inputs::new(&[shape]), F64, |x| x[0].neg());
    check::<f64>("exp", Inputs::new(&[shape]), F64, |x| x[0].exp());
    let positive = Inputs::new(&[shape]).range(0.2, 3.0);
    check::<f64>("log", positive, F64, |x| x[0].log());
    check::<f64>("tanh", Inputs::new(&[shape]), F64, |x| x[0].tanh());
    check::<f64>("relu", Inputs::new(&[shape]), F64, |x| x[0].relu());
    check::<f64>("gelu erf", Inputs::new(&[shape]), F64, |x| {
        x[0].gelu(Gelu::Erf)
    });
    check::<f64>("gelu tanh", Inputs::new(&[shape]), F64, |x| {
        x[0].gelu(Gelu::Tanh)
    });
    check::<f32>("gelu f32", Inputs::new(&[shape]), F32, |x| {
        x[0].gelu(Gelu::Tanh)
    });
}

#[test]
fn reductions() {
    let shape: &[usize] = &[2, 3, 4];
    check::<f64>("sum", Inputs::new(&[shape]), F64, |x| x[0].sum());
    check::<f64>("mean", Inputs::new(&[shape]), F64, |x| x[0].mean());
    for dim in 0..3 {
        for keepdim in [false, true] {
            check::<f64>("sum_dim", Inputs::new(&[shape]), F64, |x| {
                x[0].sum_dim(dim, keepdim)
            });
            check::<f64>("mean_dim", Inputs::new(&[shape]), F64, |x| {
                x[0].mean_dim(dim, keepdim)
            });
            check::<f64>("max_dim", Inputs::new(&[shape]), F64, |x| {
                x[0].max_dim(dim, keepdim)
            });
        }
    }
}

/// Long dimensions with few outputs are summed in parts by many threads and the parts
/// summed again; the results still equal the CPU's.
#[test]
fn long_reductions_split_across_threads() {
    check::<f64>("long sum", Inputs::new(&[&[100_003]]), F64, |x| x[0].sum());
    // f32 sums of 40 000 terms in another order differ by more than one rounding.
    check::<f32>("long sum f32", Inputs::new(&[&[40_000]]), 10.0 * F32, |x| {
        x[0].sum()
    });
    check::<f64>("long mean", Inputs::new(&[&[2, 5_000, 3]]), F64, |x| {
        x[0].mean_dim(1, true)
    });
    check::<f64>("long max", Inputs::new(&[&[4_000, 2]]), F64, |x| {
        x[0].max_dim(0, false)
    });
    // A bias's gradient sums the broadcast rows.
    check::<f64>(
        "bias over many rows",
        Inputs::new(&[&[64, 40, 3], &[3]]),
        F64,
        |x| x[0].add(&x[1]),
    );
}

#[test]
fn matrix_products() {
    let cases: [(&[usize], &[usize]); 5] = [
        (&[3, 4], &[4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[1, 1], &[1, 1]),
        (&[3, 0], &[0, 2]),
    ];
    for (a, b) in cases {
        check::<f64>("matmul", Inputs::new(&[a, b]), F64, |x| x[0].matmul(&x[1]));
        check::<f32>("matmul f32", Inputs::new(&[a, b]), F32, |x| {
            x[0].matmul(&x[1])
        });
    }
}

/// `a·bᵀ` with `b` read as stored: a linear layer's `x·Wᵀ` (also over a folded batch) and
/// attention's batched `q·kᵀ`.
#[test]
fn products_with_a_transposed_operand() {
    let cases: [(&[usize], &[usize]); 4] = [
        (&[3, 4], &[5, 4]),
        (&[2, 3, 4], &[5, 4]),
        (&[2, 3, 4], &[2, 5, 4]),
        (&[3, 0], &[2, 0]),
    ];
    for (a, b) in cases {
        check::<f64>("matmul_transposed", Inputs::new(&[a, b]), F64, |x| {
            x[0].matmul_transposed(&x[1])
        });
        check::<f32>("matmul_transposed f32", Inputs::new(&[a, b]), F32, |x| {
            x[0].matmul_transposed(&x[1])
        });
    }
}

#[test]
fn reshape_is_free_and_differentiable() {
    check::<f64>("reshape", Inputs::new(&[&[2, 6]]), F64, |x| {
        x[0].reshape(&[3, 2, 2])?.exp()
    });
}

#[test]
fn mixing_devices_is_a_typed_error() {
    let cpu = Tensor::<f32>::ones(&[2]);
    let device = cpu.to_device(ferrotron_tape::Device::Emulated).unwrap();
    let err = cpu.add(&device).unwrap_err();
    assert!(
        matches!(err, ferrotron_tape::Error::DeviceMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("to_device"), "{err}");
}
