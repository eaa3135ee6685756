//! Fused attention against the unfused reference: outputs and the packed gradient of
//! queries, keys and values, on the CPU and every device, causal or not, multi-head and
//! grouped-query, with and without dropout (the same mask), in f32, f64 and 16-bit;
//! gradients against finite differences; and memory that grows linearly in the sequence.

#[path = "support/device.rs"]
mod device;

use device::{check, devices, output_and_grad, output_and_grad_rounded, Inputs};
use ferrotron_tape::{
    device_memory, fused_attention_dropout_mask, gradcheck, reset_device_peak, AttentionKernel,
    AttentionOptions, DType, Device, Generator, GradCheckOptions, Parameter, Result, Tape, Tensor,
};

/// Packed input `[s, b, groups, per_group + 2, d]`.
fn packed(s: usize, b: usize, groups: usize, per_group: usize, d: usize) -> [usize; 5] {
    [s, b, groups, per_group + 2, d]
}

fn options(shape: &[usize], causal: bool, kernel: AttentionKernel) -> AttentionOptions {
    AttentionOptions {
        scale: 1.0 / (shape[4] as f64).sqrt(),
        causal,
        kernel,
    }
}

/// The largest difference of `a` from `b`, relative to `b`'s largest magnitude (at
/// least 1).
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    let scale = b.iter().map(|x| f64::from(x.abs())).fold(1.0, f64::max);
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    diff / scale
}

/// `a` within `tolerance` of `b`, relative to `b`'s largest magnitude (at least 1).
fn assert_close(a: &[f32], b: &[f32], tolerance: f64, what: &str) {
    let error = relative_error(a, b);
    assert!(error <= tolerance, "{what}: differs by {error} relative");
}

/// Fused and unfused on `device` for one case, within `tolerance`.
fn compare(device: Device, dtype: DType, shape: &[usize], causal: bool, tolerance: f64) {
    let attend = |kernel| {
        output_and_grad(device, dtype, shape, |qkv| {
            qkv.packed_attention(options(shape, causal, kernel), None)
        })
        .unwrap_or_else(|e| panic!("{shape:?} on {device}: {e}"))
    };
    let (fused, unfused) = (
        attend(AttentionKernel::Fused),
        attend(AttentionKernel::Unfused),
    );
    let what = format!("{dtype} {shape:?} causal {causal} on {device}");
    assert_close(&fused.0, &unfused.0, tolerance, &format!("{what}: output"));
    assert_close(
        &fused.1,
        &unfused.1,
        tolerance,
        &format!("{what}: gradient"),
    );
}

/// Sequences 1, 17, 128 and 1000, head dims 40, 64 and 128 (wider than a device's fused
/// kernel takes: there the unfused one), causal and not, one, two and four queries per
/// key/value group and one, two and four groups.
const CASES: [([usize; 5], bool); 7] = [
    (packed_const(1, 2, 4, 1, 64), true),
    (packed_const(17, 1, 4, 2, 64), false),
    (packed_const(17, 2, 1, 4, 40), true),
    (packed_const(128, 1, 2, 1, 128), false),
    (packed_const(128, 2, 1, 2, 64), true),
    (packed_const(1000, 1, 1, 1, 64), true),
    (packed_const(1000, 1, 1, 2, 128), false),
];

const fn packed_const(s: usize, b: usize, g: usize, r: usize, d: usize) -> [usize; 5] {
    [s, b, g, r + 2, d]
}

#[test]
fn fused_equals_unfused_in_f32_on_the_cpu() {
    for (shape, causal) in CASES {
        compare(Device::Cpu, DType::F32, &shape, causal, 1e-5);
    }
}

#[test]
fn fused_equals_unfused_in_f32_on_every_device() {
    // The last case runs on the CPU only: its emulated reference alone takes tens of
    // seconds, and the one before covers sequence 1000 on devices.
    for device in devices() {
        for (shape, causal) in &CASES[..CASES.len() - 1] {
            compare(device, DType::F32, shape, *causal, 1e-5);
        }
    }
}

#[test]
fn sixteen_bit_fused_is_within_the_formats_rounding_of_f32() {
    // The reference is f32 on the same rounded inputs. The fused kernel rounds only its
    // outputs (and reads the 16-bit output gradient), so it lands within about a unit of
    // the format; the unfused one also rounds scores and probabilities, which costs more.
    for (dtype, unit) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        for device in [Device::Cpu].into_iter().chain(devices()) {
            for (shape, causal) in [
                (packed(17, 2, 2, 2, 64), true),
                (packed(128, 1, 1, 1, 64), false),
            ] {
                let attend = |kernel, store| {
                    output_and_grad_rounded(device, dtype, store, &shape, |qkv| {
                        qkv.packed_attention(options(&shape, causal, kernel), None)
                    })
                    .unwrap_or_else(|e| panic!("{shape:?} on {device}: {e}"))
                };
                let exact = attend(AttentionKernel::Unfused, DType::F32);
                let fused = attend(AttentionKernel::Fused, dtype);
                let unfused = attend(AttentionKernel::Unfused, dtype);
                let what = format!("{dtype} {shape:?} causal {causal} on {device}");
                let error = |a: &[f32], b: &[f32]| relative_error(a, b) / unit;
                let (out, grad) = (error(&fused.0, &exact.0), error(&fused.1, &exact.1));
                println!(
                    "{what}: fused {out:.2} / {grad:.2} units, unfused {:.2} / {:.2}",
                    error(&unfused.0, &exact.0),
                    error(&unfused.1, &exact.1)
                );
                assert!(
                    out <= 1.0 && grad <= 2.0,
                    "{what}: fused {out} / {grad} units"
                );
            }
        }
    }
}

#[test]
fn devices_match_the_cpu() {
    let fused = |shape: [usize; 5], causal: bool| {
        move |x: &[Tensor<f32>]| {
            x[0].packed_attention(options(&shape, causal, AttentionKernel::Fused), None)
        }
    };
    for (shape, causal) in [
        (packed(33, 2, 2, 2, 64), true),
        (packed(70, 1, 3, 1, 56), false),
        // An odd head width, less than a warp wide.
        (packed(37, 1, 2, 2, 33), true),
    ] {
        check::<f32>(
            "fused attention",
            Inputs::new(&[&shape]),
            1e-6,
            fused(shape, causal),
        );
    }
    let shape = packed(40, 1, 2, 2, 16);
    check::<f64>("fused attention f64", Inputs::new(&[&shape]), 1e-12, |x| {
        x[0].packed_attention(options(&shape, true, AttentionKernel::Fused), None)
    });
    check::<f64>(
        "fused attention f64, dropout",
        Inputs::new(&[&shape]),
        1e-12,
        |x| {
            let dropout = (0.2, &mut Generator::new(4));
            x[0].packed_attention(
                options(&shape, false, AttentionKernel::Fused),
                Some(dropout),
            )
        },
    );
}

/// The unfused composition with dropout's mask given: q, k and v split out of packed
/// input, each key and value repeated for its group's queries.
fn with_mask(qkv: &Tensor, causal: bool, mask: &Tensor) -> Result<Tensor> {
    let [s, b, g, parts, d] = qkv.shape().try_into().expect("5-D");
    let r = parts - 2;
    let heads = |t: Tensor| t.permute(&[1, 2, 3, 0, 4])?.reshape(&[b * g * r, s, d]);
    let shared = |index: usize| {
        let part = qkv.narrow(3, index, 1)?;
        heads(Tensor::concat(&vec![&part; r], 3)?)
    };
    let scores = heads(qkv.narrow(3, 0, r)?)?.matmul_transposed(&shared(r)?)?;
    let scale = 1.0 / (d as f64).sqrt();
    let probs = match causal {
        true => scores.causal_softmax(scale)?,
        false => scores.scale(scale)?.softmax()?,
    };
    probs
        .mul(mask)?
        .matmul(&shared(r + 1)?)?
        .reshape(&[b, g * r, s, d])?
        .permute(&[2, 0, 1, 3])?
        .reshape(&[s, b, g * r * d])
}

#[test]
fn dropout_applies_the_mask_it_documents_and_regenerates_it_in_backward() -> Result<()> {
    let p = 0.3;
    for (shape, causal) in [
        (packed(17, 2, 2, 2, 64), true),
        (packed(45, 1, 1, 1, 64), false),
    ] {
        let [s, b, g, parts, _] = shape;
        let heads = b * g * (parts - 2);
        let seed = Generator::new(9).next_u64();
        let mask = fused_attention_dropout_mask::<f32>(seed, p, [heads, s, s])?;
        let kept = mask.to_vec()?.iter().filter(|&&m| m > 0.0).count() as f64;
        let share = kept / mask.numel() as f64;
        assert!((share - (1.0 - p)).abs() < 0.05, "kept {share}");
        for device in [Device::Cpu].into_iter().chain(devices()) {
            let fused = output_and_grad(device, DType::F32, &shape, |qkv| {
                let dropout = (p, &mut Generator::new(9));
                qkv.packed_attention(
                    options(&shape, causal, AttentionKernel::Fused),
                    Some(dropout),
                )
            })?;
            let reference = output_and_grad(device, DType::F32, &shape, |qkv| {
                with_mask(qkv, causal, &mask.to_device(device)?)
            })?;
            let what = format!("{shape:?} causal {causal} on {device}");
            assert_close(&fused.0, &reference.0, 1e-5, &format!("{what}: output"));
            assert_close(&fused.1, &reference.1, 1e-5, &format!("{what}: gradient"));
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences_in_f64() -> Result<()> {
    let shape = packed(9, 2, 2, 2, 3);
    let mut generator = Generator::new(21);
    let x = Tensor::<f64>::uniform(&shape, -1.0, 1.0, &mut generator);
    for causal in [true, false] {
        for p in [0.0, 0.25] {
            let attend = |inputs: &[Tensor<f64>]| {
                let mut generator = Generator::new(3);
                let dropout = (p > 0.0).then_some((p, &mut generator));
                let how = options(&shape, causal, AttentionKernel::Fused);
                inputs[0].packed_attention(how, dropout)?.sum()
            };
            gradcheck(
                attend,
                std::slice::from_ref(&x),
                &GradCheckOptions::default(),
            )?;
        }
    }
    Ok(())
}

#[test]
fn wide_heads_on_a_device_fall_back_to_the_unfused_kernel() -> Result<()> {
    let shape = packed(9, 1, 2, 1, 136);
    for device in devices() {
        let attend = |kernel| {
            output_and_grad(device, DType::F32, &shape, |qkv| {
                qkv.packed_attention(options(&shape, true, kernel), None)
            })
        };
        assert_eq!(
            attend(AttentionKernel::Fused)?,
            attend(AttentionKernel::Unfused)?
        );
    }
    Ok(())
}

/// The device memory a forward and backward hold at most, in bytes.
fn peak_bytes(device: Device, seq: usize, kernel: AttentionKernel) -> Result<u64> {
    let shape = packed(seq, 1, 2, 1, 64);
    let qkv = Parameter::new("qkv", Tensor::<f32>::zeros(&shape).to_device(device)?);
    let before = device_memory(device);
    reset_device_peak(device);
    let tape = Tape::new();
    let out = tape
        .watch(&qkv)?
        .packed_attention(options(&shape, true, kernel), None)?;
    out.sum()?.backward()?;
    drop(out);
    let peak = device_memory(device).peak;
    Ok(peak - before.live)
}

#[test]
fn memory_grows_linearly_in_the_sequence() -> Result<()> {
    let device = Device::Emulated;
    let ratio = |kernel| -> Result<f64> {
        Ok(peak_bytes(device, 1024, kernel)? as f64 / peak_bytes(device, 512, kernel)? as f64)
    };
    let (fused, unfused) = (
        ratio(AttentionKernel::Fused)?,
        ratio(AttentionKernel::Unfused)?,
    );
    assert!(
        fused < 2.2,
        "fused peak grows {fused}x from seq 512 to 1024"
    );
    assert!(
        unfused > 3.0,
        "unfused peak grows {unfused}x (the sequence² tensors)"
    );
    Ok(())
}

/// A block with no keys (or no queries) has zero gradients everywhere, on every device
/// as on the CPU: the kernel writes none of them, so a device must not hand back the
/// memory it allocated for them unwritten (the emulated device fills fresh memory with
/// NaNs, so it would show).
#[test]
fn an_empty_block_has_zero_gradients_on_every_device() -> Result<()> {
    use ferrotron_tape::attention_block_backward;
    let (heads, d) = (2, 4);
    for (sq, sk) in [(3, 0), (0, 3), (0, 0)] {
        for device in std::iter::once(Device::Cpu).chain(devices()) {
            let ones = |shape: &[usize]| Tensor::<f32>::ones(shape).to_device(device);
            let (q, kv) = (ones(&[heads, sq, d])?, ones(&[heads, sk, d])?);
            let (out, lse) = (ones(&[heads, sq, d])?, ones(&[heads, sq])?);
            let grads = attention_block_backward((&q, &kv, &kv), &out, &out, &lse, 0.5, false)?;
            for (grad, s) in grads.iter().zip([sq, sk, sk]) {
                assert_eq!(grad.shape(), [heads, s, d]);
                let values = grad.to_vec()?;
                assert!(
                    values.iter().all(|&v| v == 0.0),
                    "{device} {sq}×{sk}: {values:?}"
                );
            }
        }
    }
    Ok(())
}
