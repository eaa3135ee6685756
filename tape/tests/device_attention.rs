//! Packed causal attention: on a device its strided products give exactly the numbers of
//! the composition it replaces (narrow and permute copies, batched products, causal
//! softmax, dropout), in f32 and 16-bit, with and without dropout; it matches the CPU;
//! and it copies nothing.

#[path = "support/device.rs"]
mod device;

use device::{check, devices, output_and_grad, Inputs};
use ferrotron_tape::profile;
use ferrotron_tape::{DType, Device, Generator, Parameter, Result, Tape, Tensor};

/// What `packed_causal_attention` equals: q, k and v split out of the packed layout.
fn composed(qkv: &Tensor, scale: f64, dropout: Option<(f64, &mut Generator)>) -> Result<Tensor> {
    let [s, b, n, _, d] = qkv.shape().try_into().expect("5-D");
    let part = |index: usize| {
        qkv.narrow(3, index, 1)?
            .reshape(&[s, b, n, d])?
            .permute(&[1, 2, 0, 3])?
            .reshape(&[b * n, s, d])
    };
    let probs = part(0)?
        .matmul_transposed(&part(1)?)?
        .causal_softmax(scale)?;
    let probs = match dropout {
        Some((p, generator)) => probs.dropout(p, generator)?,
        None => probs,
    };
    probs
        .matmul(&part(2)?)?
        .reshape(&[b, n, s, d])?
        .permute(&[2, 0, 1, 3])?
        .reshape(&[s, b, n * d])
}

const SHAPES: [[usize; 5]; 4] = [
    [1, 1, 1, 3, 1],
    [5, 2, 3, 3, 4],
    [17, 1, 2, 3, 8],
    [33, 2, 1, 3, 3],
];

#[test]
fn on_a_device_it_gives_the_compositions_numbers_exactly() -> Result<()> {
    for device in devices() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for shape in SHAPES {
                for p in [0.0, 0.3] {
                    let scale = 1.0 / (shape[4] as f64).sqrt();
                    let draw = |seed| (p > 0.0).then(|| Generator::new(seed));
                    let packed = output_and_grad(device, dtype, &shape, |qkv| {
                        let mut generator = draw(5);
                        qkv.packed_causal_attention(scale, generator.as_mut().map(|g| (p, g)))
                    })?;
                    let reference = output_and_grad(device, dtype, &shape, |qkv| {
                        let mut generator = draw(5);
                        composed(qkv, scale, generator.as_mut().map(|g| (p, g)))
                    })?;
                    assert_eq!(
                        packed, reference,
                        "{dtype} {shape:?} dropout {p} on {device}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn it_matches_the_cpu() {
    for shape in SHAPES {
        let scale = 1.0 / (shape[4] as f64).sqrt();
        check::<f64>("packed attention", Inputs::new(&[&shape]), 1e-12, |x| {
            x[0].packed_causal_attention(scale, None)
        });
        check::<f32>("packed attention f32", Inputs::new(&[&shape]), 1e-5, |x| {
            x[0].packed_causal_attention(scale, None)
        });
        check::<f64>(
            "packed attention, dropout",
            Inputs::new(&[&shape]),
            1e-12,
            |x| {
                let mut generator = Generator::new(3);
                x[0].packed_causal_attention(scale, Some((0.25, &mut generator)))
            },
        );
    }
}

/// Forward: two products and the softmax; backward: four products and the softmax's
/// backward. No gathers, scatters, zero fills or sums of partial gradients.
#[test]
fn on_a_device_it_copies_nothing() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = Device::Emulated;
    let mut generator = Generator::new(2);
    let qkv = Parameter::new(
        "qkv",
        Tensor::<f32>::uniform(&[16, 2, 4, 3, 8], -1.0, 1.0, &mut generator).to_device(device)?,
    );
    let tape = Tape::new();
    profile::start(device);
    let out = tape.watch(&qkv)?.packed_causal_attention(0.25, None)?;
    let forward = profile::finish()?;
    let upstream = Tensor::<f32>::ones(out.shape()).to_device(device)?;
    profile::start(device);
    out.backward_with_grad(&upstream)?;
    let backward = profile::finish()?;
    let launches = |p: &profile::Profile| -> Vec<(String, u64)> {
        p.kernels
            .iter()
            .map(|k| (k.name.clone(), k.launches))
            .collect()
    };
    assert_eq!(
        launches(&forward),
        [
            ("gemm_f32".to_string(), 2),
            ("softmax_rows_f32".to_string(), 1)
        ]
    );
    assert_eq!(
        launches(&backward),
        [
            ("gemm_f32".to_string(), 4),
            ("softmax_rows_backward_f32".to_string(), 1)
        ]
    );
    // The scores are [batch·heads, sequence, sequence]; the context and the packed
    // gradient are written once, in place.
    let gemm = forward
        .kernels
        .iter()
        .find(|k| k.name == "gemm_f32")
        .unwrap();
    let (s, bn, d) = (16u64, 8u64, 8u64);
    assert_eq!(gemm.written, 4 * (bn * s * s + bn * s * d));
    Ok(())
}

#[test]
fn misshapen_input_and_bad_probabilities_are_typed_errors() {
    let flat = Tensor::<f32>::zeros(&[4, 2, 3]);
    let error = flat.packed_causal_attention(1.0, None).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("[sequence, batch, groups, queries per group + 2, head_dim]"),
        "{error}"
    );
    let qkv = Tensor::<f32>::zeros(&[2, 1, 1, 3, 2]);
    let mut generator = Generator::new(1);
    let error = qkv
        .packed_causal_attention(1.0, Some((1.5, &mut generator)))
        .unwrap_err();
    assert!(error.to_string().contains("not in [0, 1]"), "{error}");
}
