//! `MixedPrecision`: bf16 and f16 parameters trained through f32 master weights follow
//! f32 training, share main gradients without copies, and checkpoint the masters.

use anyhow::Result;
use ferrotron_tape::{
    AdamW, AdamWConfig, DType, Device, FlatStorage, FlatView, Generator, MixedPrecision, Optimizer,
    Parameter, Tape, Tensor, MASTER_BUFFER,
};

/// A two-layer tanh network's parameters.
fn model(seed: u64) -> Vec<Parameter> {
    let mut rng = Generator::new(seed);
    vec![
        Parameter::new("w1", Tensor::randn(&[4, 16], 0.5, &mut rng)),
        Parameter::new("b1", Tensor::randn(&[16], 0.1, &mut rng)),
        Parameter::new("w2", Tensor::randn(&[16, 3], 0.5, &mut rng)),
    ]
}

/// Cross-entropy of the network on a fixed batch, computed in f32 from its logits.
fn loss(tape: &Tape, params: &[Parameter], device: Device) -> ferrotron_tape::Result<Tensor> {
    let mut rng = Generator::new(5);
    let x = Tensor::randn(&[32, 4], 1.0, &mut rng).to_device(device)?;
    let labels: Vec<i64> = (0..32).map(|i| (i * 7 % 3) as i64).collect();
    let [w1, b1, w2] = [0, 1, 2].map(|i| tape.watch(&params[i]));
    let (w1, b1, w2) = (w1?, b1?, w2?);
    // The input joins the parameters' format, as a model's embedding output would be.
    let x = x.to_dtype(w1.dtype())?;
    let logits = x.matmul(&w1)?.add(&b1)?.tanh()?.matmul(&w2)?;
    logits
        .to_dtype(DType::F32)?
        .cross_entropy(&labels, &Default::default())
}

fn adamw(masters: Vec<Parameter>) -> ferrotron_tape::Result<AdamW> {
    AdamW::new(
        masters,
        AdamWConfig {
            lr: 2e-2,
            ..AdamWConfig::default()
        },
    )
}

/// Trains `steps` steps; the losses.
fn train(
    optimizer: &mut dyn Optimizer,
    params: &[Parameter],
    device: Device,
    steps: usize,
) -> Result<Vec<f32>> {
    let mut losses = Vec::new();
    for _ in 0..steps {
        let tape = Tape::new();
        let loss = loss(&tape, params, device)?;
        losses.push(loss.item()?);
        loss.backward()?;
        optimizer.step()?;
        optimizer.zero_grad();
    }
    Ok(losses)
}

fn on(device: Device, params: Vec<Parameter>) -> Result<Vec<Parameter>> {
    for p in &params {
        p.set_value(p.value()?.to_device(device)?)?;
    }
    Ok(params)
}

#[test]
fn sixteen_bit_training_follows_f32() -> Result<()> {
    let steps = 60;
    let reference = model(1);
    let exact = train(
        &mut adamw(reference.clone())?,
        &reference,
        Device::Cpu,
        steps,
    )?;
    for device in [Device::Cpu, Device::Emulated] {
        for (dtype, tolerance) in [(DType::BF16, 0.03), (DType::F16, 0.01)] {
            let params = on(device, model(1))?;
            let mut optimizer = MixedPrecision::new(&params, dtype, adamw)?;
            assert!(params.iter().all(|p| p.dtype() == dtype));
            let losses = train(&mut optimizer, &params, device, steps)?;
            assert!(losses.iter().all(|l| l.is_finite()));
            let (last, expected) = (losses[steps - 1], exact[steps - 1]);
            assert!(
                last < 0.7 * losses[0],
                "{dtype} on {device}: the loss falls ({} -> {last})",
                losses[0]
            );
            assert!(
                (last - expected).abs() <= tolerance * expected,
                "{dtype} on {device}: final loss {last} vs f32 {expected}"
            );
            // The model holds the masters, rounded.
            for (p, m) in params.iter().zip(optimizer.params()) {
                let rounded = m.value()?.to_dtype(dtype)?.to_vec()?;
                assert_eq!(p.value()?.to_vec()?, rounded);
                assert_eq!(m.dtype(), DType::F32);
            }
        }
    }
    Ok(())
}

#[test]
fn masters_share_main_gradients() -> Result<()> {
    let params = model(2);
    let numel: usize = params.iter().map(|p| p.numel()).sum();
    let storage = FlatStorage::zeros(Device::Cpu, numel)?;
    let mut offset = 0;
    for p in &params {
        p.attach_main_grad(FlatView::new(&storage, offset, &p.shape())?)?;
        offset += p.numel();
    }
    let mut optimizer = MixedPrecision::new(&params, DType::BF16, adamw)?;
    let reference = model(2);
    let mut plain = adamw(reference.clone())?;
    for _ in 0..3 {
        let tape = Tape::new();
        loss(&tape, &params, Device::Cpu)?.backward()?;
        optimizer.step()?;
        for (p, m) in params.iter().zip(optimizer.params()) {
            let (mine, theirs) = (p.main_grad().unwrap(), m.main_grad().unwrap());
            assert!(mine.storage().same_storage(theirs.storage()));
            assert_eq!(mine.offset(), theirs.offset());
        }
        optimizer.zero_grad();
        assert!(params
            .iter()
            .chain(optimizer.params())
            .all(|p| !p.has_grad()));
        // The same steps with f32 parameters and their own gradients stay close.
        let tape = Tape::new();
        loss(&tape, &reference, Device::Cpu)?.backward()?;
        plain.step()?;
        plain.zero_grad();
    }
    for (m, r) in optimizer.params().iter().zip(&reference) {
        let (m, r) = (m.value()?.to_vec()?, r.value()?.to_vec()?);
        let diff = m
            .iter()
            .zip(&r)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 2e-2, "masters drift {diff} from f32 training");
    }
    // Main gradients moved to new storage at the same offsets (a rebuilt DDP): the
    // masters follow them rather than the old storage.
    let moved = FlatStorage::zeros(Device::Cpu, numel)?;
    let mut offset = 0;
    for p in &params {
        p.attach_main_grad(FlatView::new(&moved, offset, &p.shape())?)?;
        offset += p.numel();
    }
    let tape = Tape::new();
    loss(&tape, &params, Device::Cpu)?.backward()?;
    optimizer.step()?;
    for m in optimizer.params() {
        assert!(m.main_grad().unwrap().storage().same_storage(&moved));
    }
    Ok(())
}

#[test]
fn the_wrapper_names_the_model_its_rate_and_its_format() -> Result<()> {
    let params = model(5);
    let config = AdamWConfig {
        lr: 0.25,
        ..AdamWConfig::default()
    };
    let optimizer = MixedPrecision::new(&params, DType::F16, |m| AdamW::new(m, config))?;
    let ids = |ps: &[Parameter]| ps.iter().map(Parameter::id).collect::<Vec<_>>();
    assert_eq!(ids(optimizer.model_params()), ids(&params));
    assert!(ids(optimizer.params())
        .iter()
        .all(|id| !ids(&params).contains(id)));
    assert_eq!(optimizer.lr(), 0.25);
    let debug = format!("{optimizer:?}");
    assert!(
        debug.contains("F16") && debug.contains(&format!("params: {}", params.len())),
        "{debug}"
    );
    Ok(())
}

#[test]
fn a_checkpoint_keeps_the_masters_and_resumes_the_same_run() -> Result<()> {
    // Ten steps straight, against five, a checkpoint of the optimizer state, and five
    // more in a fresh model and optimizer restored from it.
    let straight = model(3);
    let mut optimizer = MixedPrecision::new(&straight, DType::BF16, adamw)?;
    let all = train(&mut optimizer, &straight, Device::Cpu, 10)?;

    let first = model(3);
    let mut optimizer = MixedPrecision::new(&first, DType::BF16, adamw)?;
    train(&mut optimizer, &first, Device::Cpu, 5)?;
    let state = optimizer.state()?;
    for (entry, master) in state.params.iter().zip(optimizer.params()) {
        let (name, saved) = entry.buffers.last().expect("a master buffer");
        assert_eq!(name, MASTER_BUFFER);
        assert_eq!(saved.dtype(), DType::F32);
        assert_eq!(saved.to_vec()?, master.value()?.to_vec()?);
    }
    let resumed = model(99); // other values: all of them come from the checkpoint
    let mut optimizer = MixedPrecision::new(&resumed, DType::BF16, adamw)?;
    optimizer.load_state(&state)?;
    let rest = train(&mut optimizer, &resumed, Device::Cpu, 5)?;
    assert_eq!(rest, all[5..]);
    for (a, b) in straight.iter().zip(&resumed) {
        assert_eq!(a.value()?.to_vec()?, b.value()?.to_vec()?);
    }
    Ok(())
}

#[test]
fn only_16_bit_formats_take_master_weights() {
    let err = MixedPrecision::new(&model(4), DType::F32, adamw).unwrap_err();
    assert!(err.to_string().contains("bf16 or f16"), "{err}");
}

#[test]
fn a_state_with_a_misshapen_master_changes_nothing() -> Result<()> {
    let params = model(5);
    let mut optimizer = MixedPrecision::new(&params, DType::BF16, adamw)?;
    train(&mut optimizer, &params, Device::Cpu, 2)?;
    let before = optimizer.state()?;
    let mut state = before.clone();
    let last = state.params.last_mut().unwrap().buffers.last_mut().unwrap();
    last.1 = Tensor::zeros(&[2]);
    let err = optimizer.load_state(&state).unwrap_err().to_string();
    assert!(err.contains("master weight of 'w2'"), "{err}");
    let after = optimizer.state()?;
    for (a, b) in before.params.iter().zip(&after.params) {
        for ((_, x), (_, y)) in a.buffers.iter().zip(&b.buffers) {
            assert_eq!(x.to_vec()?, y.to_vec()?);
        }
    }
    Ok(())
}
