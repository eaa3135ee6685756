//! A device profile counts each kernel's launches, the bytes of the arrays it reads and
//! writes (each once) and a product's flops, by hand for one layer's forward and
//! backward on the emulated device: a linear layer with bias and GELU, layer norm and
//! softmax, in f32.

use ferrotron_tape::profile::{self, KernelStats, Profile};
use ferrotron_tape::{Device, Gelu, Generator, Parameter, Tape, Tensor};

const R: usize = 24;
const H: usize = 40;
const F: usize = 56;
const B: u64 = 4;

fn line<'a>(profile: &'a Profile, name: &str) -> &'a KernelStats {
    (profile.kernels.iter().find(|k| k.name == name))
        .unwrap_or_else(|| panic!("no {name} in {profile:#?}"))
}

/// (launches, bytes read, bytes written) of `name`.
fn counts(profile: &Profile, name: &str) -> (u64, u64, u64) {
    let stats = line(profile, name);
    (stats.launches, stats.read, stats.written)
}

#[test]
fn a_layers_kernels_are_counted_as_by_hand() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::Emulated;
    let mut rng = Generator::new(3);
    let param = |name: &str, shape: &[usize], rng: &mut Generator| {
        let value: Tensor = Tensor::randn(shape, 0.5, rng).to_device(device)?;
        Ok::<_, ferrotron_tape::Error>(Parameter::new(name, value))
    };
    let x = param("x", &[R, H], &mut rng)?;
    let w = param("w", &[F, H], &mut rng)?;
    let b = param("b", &[F], &mut rng)?;
    let gamma = param("gamma", &[F], &mut rng)?;
    let beta = param("beta", &[F], &mut rng)?;
    let upstream: Tensor = Tensor::randn(&[R, F], 1.0, &mut rng).to_device(device)?;
    let tape = Tape::new();
    let (x, w, b) = (tape.watch(&x)?, tape.watch(&w)?, tape.watch(&b)?);
    let (gamma, beta) = (tape.watch(&gamma)?, tape.watch(&beta)?);

    profile::start(device);
    let y = (x.matmul_transposed(&w)?.add(&b)?.gelu(Gelu::Tanh)?)
        .layer_norm(Some(&gamma), Some(&beta), 1e-5)?
        .softmax()?;
    let forward = profile::finish()?;
    let (rf, rh, f, h) = ((R * F) as u64, (R * H) as u64, F as u64, H as u64);
    let gemm = line(&forward, "gemm_f32");
    assert_eq!(
        (gemm.launches, gemm.read, gemm.written, gemm.flops),
        (1, (rh + f * h) * B, rf * B, 2 * rf * h)
    );
    assert_eq!(counts(&forward, "binary_f32"), (1, (rf + f) * B, rf * B));
    assert_eq!(counts(&forward, "unary_f32"), (1, rf * B, rf * B));
    // Layer norm writes each row's mean and 1/std besides its output.
    let stats = 2 * R as u64 * B;
    assert_eq!(
        counts(&forward, "layer_norm_rows_f32"),
        (1, (rf + 2 * f) * B, rf * B + stats)
    );
    assert_eq!(counts(&forward, "softmax_rows_f32"), (1, rf * B, rf * B));
    assert_eq!(forward.kernels.len(), 5, "{forward:#?}");
    assert_eq!(forward.total().launches, 5);
    assert!(forward.kernels.iter().all(|k| k.time.is_none()));

    profile::start(device);
    y.backward_with_grad(&upstream)?;
    let backward = profile::finish()?;
    // Softmax's backward reads the gradient and its output.
    assert_eq!(
        counts(&backward, "softmax_rows_backward_f32"),
        (1, 2 * rf * B, rf * B)
    );
    // Layer norm's input gradient reads the gradient, the input, the weight and the row
    // statistics.
    assert_eq!(
        counts(&backward, "layer_norm_rows_backward_f32"),
        (1, (2 * rf + f) * B + stats, rf * B)
    );
    Ok(())
}

#[test]
fn nothing_is_recorded_without_a_recording_or_on_another_device(
) -> Result<(), Box<dyn std::error::Error>> {
    let x = Tensor::from_vec(vec![1.0f32; 8], &[2, 4])?.to_device(Device::Emulated)?;
    let _ = x.softmax()?;
    assert_eq!(profile::finish()?, Profile::default());
    profile::start(Device::Cuda(0));
    let _ = x.softmax()?;
    assert!(profile::finish()?.kernels.is_empty());
    Ok(())
}

/// Mixed precision's optimizer step is one multi-tensor AdamW launch, which also writes
/// the rounded 16-bit model weights (no separate conversion), and a bias's gradient over
/// `[sequence, batch, features]` is one two-level sum.
#[test]
fn a_mixed_precision_step_is_one_launch() -> Result<(), Box<dyn std::error::Error>> {
    use ferrotron_tape::{AdamW, AdamWConfig, DType, MixedPrecision, Optimizer};
    let device = Device::Emulated;
    let mut rng = Generator::new(5);
    let params: Vec<Parameter> = [("w", &[F, H][..]), ("b", &[F][..])]
        .into_iter()
        .map(|(name, shape)| {
            let value: Tensor = Tensor::randn(shape, 0.5, &mut rng).to_device(device)?;
            Ok(Parameter::new(name, value))
        })
        .collect::<ferrotron_tape::Result<_>>()?;
    // 128 rows: long enough to be summed in two levels (one kernel per dimension
    // would take three launches).
    let x: Tensor = Tensor::randn(&[64, 2, H], 1.0, &mut rng).to_device(device)?;
    let mut adamw = MixedPrecision::new(&params, DType::BF16, |masters| {
        AdamW::new(masters, AdamWConfig::default())
    })?;
    for step in 0..2 {
        let tape = Tape::new();
        let (w, b) = (tape.watch(&params[0])?, tape.watch(&params[1])?);
        let y = x.to_dtype(DType::BF16)?.matmul_transposed(&w)?.add(&b)?;
        let loss = y.to_dtype(DType::F32)?.sum()?;
        profile::start(device);
        loss.backward()?;
        let backward = profile::finish()?;
        if step == 1 {
            assert_eq!(
                line(&backward, "reduce_dim_f32").launches,
                2,
                "{backward:#?}"
            );
        }
        profile::start(device);
        adamw.step()?;
        let update = profile::finish()?;
        adamw.zero_grad();
        if step == 0 {
            continue; // The first step also makes the moments.
        }
        let n = (F * H + F) as u64;
        assert_eq!(update.kernels.len(), 1, "{update:#?}");
        assert_eq!(
            counts(&update, "adamw_list_f32"),
            (1, 4 * n * B, 3 * n * B + 2 * n)
        );
    }
    for (model, master) in params.iter().zip(adamw.params()) {
        assert_eq!(model.dtype(), DType::BF16);
        assert_eq!(
            model.value()?.to_vec()?,
            master.value()?.to_dtype(DType::BF16)?.to_vec()?
        );
    }
    Ok(())
}
