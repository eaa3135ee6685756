//! Fused attention on the tensor cores (`mma.m16n8k16` and `ldmatrix`, run by the
//! emulated device with the PTX fragment layouts): 16-bit queries, keys and values at
//! head dimensions 64 and 128 against the unfused f32 reference on the same rounded
//! inputs, outputs and the packed gradient, causal or not, multi-head and grouped-query,
//! with dropout's documented mask; and the same bits run after run.
//!
//! Tolerances, in units of the format's rounding (2⁻⁸ bf16, 2⁻¹¹ f16) relative to the
//! reference's largest magnitude: the kernels round the output, the probabilities
//! before they multiply the values, and dS before it multiplies keys and queries, as
//! FlashAttention does, so outputs land within 2 units and gradients within 3. A GPU's
//! tensor cores add their products in an order NVIDIA does not specify; against the
//! emulated run they differ by f32's rounding of those sums, far below these bounds.

#[path = "support/device.rs"]
mod device;

use device::output_and_grad_rounded;
use ferrotron_tape::{
    with_cuda_core_attention, AttentionKernel, AttentionOptions, DType, Device, Generator, Result,
    Tensor,
};

/// A case: sequence, batch, key/value groups, queries per group, head dimension, causal.
type Case = (usize, usize, usize, usize, usize, bool);

fn shape((s, b, g, r, d, _): Case) -> [usize; 5] {
    [s, b, g, r + 2, d]
}

fn options(case: Case, kernel: AttentionKernel) -> AttentionOptions {
    AttentionOptions {
        scale: 1.0 / (case.4 as f64).sqrt(),
        causal: case.5,
        kernel,
    }
}

/// The largest difference of `a` from `b` in units of `unit` relative to `b`'s largest
/// magnitude (at least 1).
fn units(a: &[f32], b: &[f32], unit: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    let scale = b.iter().map(|x| f64::from(x.abs())).fold(1.0, f64::max);
    let diff = (a.iter().zip(b))
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    diff / scale / unit
}

/// Output and packed gradient of `case` with the input rounded to `dtype`, stored as
/// `store`, on `device`, with dropout `p` drawn from seed 5.
fn attend(
    case: Case,
    device: Device,
    dtype: DType,
    store: DType,
    kernel: AttentionKernel,
    p: f64,
) -> (Vec<f32>, Vec<f32>) {
    output_and_grad_rounded(device, dtype, store, &shape(case), |qkv| {
        let mut generator = Generator::new(5);
        let dropout = (p > 0.0).then_some((p, &mut generator));
        qkv.packed_attention(options(case, kernel), dropout)
    })
    .unwrap_or_else(|e| panic!("{case:?} on {device}: {e}"))
}

/// The tensor-core kernel on the emulated device against the unfused f32 reference on
/// the CPU, in `dtype`; the CUDA-core kernel's error beside it.
fn compare(case: Case, dtype: DType, unit: f64) {
    let exact = attend(
        case,
        Device::Cpu,
        dtype,
        DType::F32,
        AttentionKernel::Unfused,
        0.0,
    );
    let fused = || {
        attend(
            case,
            Device::Emulated,
            dtype,
            dtype,
            AttentionKernel::Fused,
            0.0,
        )
    };
    let tensor_cores = fused();
    let (out, grad) = (
        units(&tensor_cores.0, &exact.0, unit),
        units(&tensor_cores.1, &exact.1, unit),
    );
    // The CUDA-core kernel takes head dimension 64; at long sequences its emulated run
    // alone would take a minute.
    if case.4 == 64 && case.0 <= 1000 {
        let cuda_cores = with_cuda_core_attention(fused);
        println!(
            "{dtype} {case:?}: tensor cores {out:.2} / {grad:.2} units, CUDA cores {:.2} / {:.2}",
            units(&cuda_cores.0, &exact.0, unit),
            units(&cuda_cores.1, &exact.1, unit)
        );
    } else {
        println!("{dtype} {case:?}: tensor cores {out:.2} / {grad:.2} units");
    }
    assert!(
        out <= 2.0 && grad <= 3.0,
        "{dtype} {case:?}: {out} / {grad} units"
    );
}

#[test]
fn head_dimension_64_is_within_the_formats_rounding() {
    for case in [
        (1, 2, 2, 1, 64, true),
        (17, 1, 1, 4, 64, false),
        (128, 1, 2, 2, 64, true),
        (1000, 1, 1, 1, 64, true),
    ] {
        compare(case, DType::BF16, 2f64.powi(-8));
    }
    compare((70, 1, 1, 2, 64, false), DType::F16, 2f64.powi(-11));
}

#[test]
fn head_dimension_128_is_within_the_formats_rounding() {
    for case in [
        (1, 1, 1, 2, 128, false),
        (17, 2, 1, 1, 128, true),
        (128, 1, 1, 4, 128, false),
        (300, 1, 1, 2, 128, true),
    ] {
        compare(case, DType::BF16, 2f64.powi(-8));
    }
    compare((65, 1, 2, 1, 128, true), DType::F16, 2f64.powi(-11));
}

/// A long causal sequence: 64 query tiles against up to 64 key tiles each.
#[test]
fn a_sequence_of_4096_is_within_the_formats_rounding() {
    compare((4096, 1, 1, 1, 64, true), DType::BF16, 2f64.powi(-8));
}

/// On a GPU with tensor cores, the same kernels against the emulated device's run: the
/// tensor cores' own order of accumulation moves the f32 sums by a few units of f32's
/// last place, which can flip a 16-bit rounding of an output, or of a probability or dS
/// before its product: outputs within 1 unit of the format and gradients within 2
/// (relative to the largest magnitude). Skipped, saying why, without one.
#[test]
fn a_gpu_matches_the_emulated_device() {
    let Some(gpu) = device::devices()
        .into_iter()
        .find(|d| *d != Device::Emulated)
    else {
        println!("skipped: no CUDA device");
        return;
    };
    if !ferrotron_tape::tensor_core_attention_takes(gpu, DType::BF16, 64) {
        println!("skipped: {gpu} has no tensor-core attention (compute capability below 8.0)");
        return;
    }
    let unit = 2f64.powi(-8);
    for case in [(1000, 2, 2, 2, 64, true), (300, 1, 2, 4, 128, false)] {
        let run = |device| {
            attend(
                case,
                device,
                DType::BF16,
                DType::BF16,
                AttentionKernel::Fused,
                0.1,
            )
        };
        let (emulated, on_gpu) = (run(Device::Emulated), run(gpu));
        let (out, grad) = (
            units(&on_gpu.0, &emulated.0, unit),
            units(&on_gpu.1, &emulated.1, unit),
        );
        println!("{case:?}: {gpu} against emulated {out:.2} / {grad:.2} units");
        assert!(out <= 1.0 && grad <= 2.0, "{case:?}: {out} / {grad} units");
    }
}

#[test]
fn dropout_applies_the_documented_mask() {
    // Every fused kernel (the CPU's too) draws one seed and keeps probability (z, i, j)
    // by the documented rule, so the reference is the CPU's fused kernel in f32 on the
    // same rounded inputs: the difference is the tensor cores' rounding only.
    let unit = 2f64.powi(-8);
    for case in [(97, 1, 1, 2, 64, true), (40, 1, 1, 1, 128, false)] {
        let run =
            |device, store, p| attend(case, device, DType::BF16, store, AttentionKernel::Fused, p);
        let exact = run(Device::Cpu, DType::F32, 0.3);
        let tensor_cores = run(Device::Emulated, DType::BF16, 0.3);
        let (out, grad) = (
            units(&tensor_cores.0, &exact.0, unit),
            units(&tensor_cores.1, &exact.1, unit),
        );
        println!("dropout {case:?}: {out:.2} / {grad:.2} units");
        assert!(out <= 2.0 && grad <= 3.0, "{case:?}: {out} / {grad} units");
        let without = run(Device::Emulated, DType::BF16, 0.0);
        assert!(
            units(&tensor_cores.0, &without.0, unit) > 10.0,
            "dropout changed nothing"
        );
    }
}

#[test]
fn a_backward_the_cuda_core_kernel_cannot_take_is_a_typed_error() -> anyhow::Result<()> {
    use ferrotron_tape::{Parameter, Tape};
    // Forward on tensor cores at head dimension 128; backward told to use CUDA cores,
    // whose tiles hold 64: refused, never run over the tiles' end.
    let mut generator = Generator::new(4);
    let value = Tensor::<f32>::uniform(&[9, 1, 1, 3, 128], -1.0, 1.0, &mut generator)
        .to_dtype(DType::BF16)?
        .to_device(Device::Emulated)?;
    let qkv = Parameter::new("qkv", value);
    let tape = Tape::new();
    let out = tape
        .watch(&qkv)?
        .packed_attention(AttentionOptions::causal(128), None)?;
    let error = with_cuda_core_attention(|| out.to_dtype(DType::F32)?.sum()?.backward())
        .expect_err("the CUDA-core kernel cannot take heads 128 wide");
    assert!(
        error.to_string().contains("with_cuda_core_attention"),
        "{error}"
    );
    Ok(())
}

#[test]
fn runs_are_the_same_bits() -> Result<()> {
    let case = (80, 1, 1, 2, 64, true);
    let once = || {
        attend(
            case,
            Device::Emulated,
            DType::BF16,
            DType::BF16,
            AttentionKernel::Fused,
            0.1,
        )
    };
    assert_eq!(once(), once());
    Ok(())
}

#[test]
fn f32_input_keeps_the_cuda_core_kernel() -> Result<()> {
    // Tensor cores take 16-bit operands: f32 attention is computed as before, to f32's
    // rounding (the CUDA-core kernel's numbers exactly).
    let case = (33, 1, 1, 1, 64, true);
    let fused = || {
        attend(
            case,
            Device::Emulated,
            DType::F32,
            DType::F32,
            AttentionKernel::Fused,
            0.0,
        )
    };
    assert_eq!(fused(), with_cuda_core_attention(fused));
    let mut generator = Generator::new(1);
    let wide = Tensor::<f32>::uniform(&[9, 1, 1, 3, 128], -1.0, 1.0, &mut generator)
        .to_device(Device::Emulated)?;
    // Head dimension 128 in f32: the unfused kernel (noted once), not an error.
    wide.packed_attention(
        options((9, 1, 1, 1, 128, true), AttentionKernel::Fused),
        None,
    )?;
    Ok(())
}

/// What one forward and backward launches and moves on the emulated device, per kernel
/// name: (launches, bytes read, bytes written).
fn profiled(
    kernel: AttentionKernel,
    dims: (usize, usize, usize),
) -> anyhow::Result<Vec<(String, u64, u64, u64)>> {
    use ferrotron_tape::{profile, Parameter, Tape};
    let (s, n, d) = dims;
    let mut generator = Generator::new(9);
    let value = Tensor::<f32>::uniform(&[s, 1, n, 3, d], -1.0, 1.0, &mut generator)
        .to_dtype(DType::BF16)?
        .to_device(Device::Emulated)?;
    let qkv = Parameter::new("qkv", value);
    let upstream = Tensor::<f32>::ones(&[s, 1, n * d])
        .to_dtype(DType::BF16)?
        .to_device(Device::Emulated)?;
    let tape = Tape::new();
    profile::start(Device::Emulated);
    let options = AttentionOptions {
        kernel,
        ..AttentionOptions::causal(d)
    };
    tape.watch(&qkv)?
        .packed_attention(options, None)?
        .backward_with_grad(&upstream)?;
    let profile = profile::finish()?;
    Ok((profile.kernels.iter())
        .map(|k| (k.name.to_string(), k.launches, k.read, k.written))
        .collect())
}

#[test]
fn the_fused_kernels_are_four_launches_and_the_unfused_keeps_16_bit_probabilities(
) -> anyhow::Result<()> {
    let (s, n, d) = (64, 2, 128);
    let fused = profiled(AttentionKernel::Fused, (s, n, d))?;
    let names: Vec<&str> = fused.iter().map(|k| k.0.as_str()).collect();
    for name in [
        "attention_tc_forward_d128_bf16_f32",
        "attention_delta_f32",
        "attention_tc_backward_q_d128_bf16_f32",
        "attention_tc_backward_kv_d128_bf16_f32",
    ] {
        assert!(names.contains(&name), "{name} not in {names:?}");
    }
    assert_eq!(fused.iter().map(|k| k.1).sum::<u64>(), 4, "{fused:?}");
    // The reference's softmax writes its [heads, s, s] probabilities in bf16 (2 bytes).
    let unfused = profiled(AttentionKernel::Unfused, (s, n, d))?;
    let softmax = (unfused.iter().find(|k| k.0 == "softmax_rows_f32"))
        .unwrap_or_else(|| panic!("no softmax in {unfused:?}"));
    assert_eq!(softmax.3, (n * s * s * 2) as u64, "{softmax:?}");
    Ok(())
}
