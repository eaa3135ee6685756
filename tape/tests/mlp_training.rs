//! A 2-layer MLP trained with SGD and AdamW: the loss falls, and the first step matches a
//! hand-derived update.

use anyhow::Result;
use ferrotron_tape::ndarray::{Array1, Array2, Axis, Ix1, Ix2};
use ferrotron_tape::{
    AdamW, AdamWConfig, Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor,
};

struct Mlp {
    w1: Parameter<f64>,
    b1: Parameter<f64>,
    w2: Parameter<f64>,
    b2: Parameter<f64>,
}

impl Mlp {
    fn new(seed: u64) -> Self {
        let mut rng = Generator::new(seed);
        Mlp {
            w1: Parameter::new("w1", Tensor::randn(&[3, 8], 0.5, &mut rng)),
            b1: Parameter::new("b1", Tensor::randn(&[8], 0.1, &mut rng)),
            w2: Parameter::new("w2", Tensor::randn(&[8, 2], 0.5, &mut rng)),
            b2: Parameter::new("b2", Tensor::randn(&[2], 0.1, &mut rng)),
        }
    }

    fn params(&self) -> Vec<Parameter<f64>> {
        vec![
            self.w1.clone(),
            self.b1.clone(),
            self.w2.clone(),
            self.b2.clone(),
        ]
    }

    /// Mean squared error of relu(x·w1 + b1)·w2 + b2 against `target`.
    fn loss(
        &self,
        tape: &Tape<f64>,
        x: &Tensor<f64>,
        target: &Tensor<f64>,
    ) -> ferrotron_tape::Result<Tensor<f64>> {
        let h = x
            .matmul(&tape.watch(&self.w1)?)?
            .add(&tape.watch(&self.b1)?)?
            .relu()?;
        let y = h
            .matmul(&tape.watch(&self.w2)?)?
            .add(&tape.watch(&self.b2)?)?;
        let diff = y.sub(target)?;
        diff.mul(&diff)?.mean()
    }
}

fn data() -> (Tensor<f64>, Tensor<f64>) {
    let mut rng = Generator::new(99);
    let x = Tensor::randn(&[16, 3], 1.0, &mut rng);
    let target = Tensor::randn(&[16, 2], 1.0, &mut rng);
    (x, target)
}

fn train(optimizer: &mut dyn Optimizer<f64>, mlp: &Mlp) -> Result<Vec<f64>> {
    let (x, target) = data();
    let tape = Tape::new();
    let mut losses = Vec::new();
    for _ in 0..50 {
        optimizer.zero_grad();
        let loss = mlp.loss(&tape, &x, &target)?;
        losses.push(loss.item()?);
        loss.backward()?;
        optimizer.step()?;
    }
    Ok(losses)
}

#[test]
fn sgd_with_momentum_and_adamw_reduce_the_loss() -> Result<()> {
    let mlp = Mlp::new(1);
    let config = SgdConfig {
        momentum: 0.9,
        weight_decay: 1e-4,
        ..SgdConfig::new(0.02)
    };
    let losses = train(&mut Sgd::new(mlp.params(), config)?, &mlp)?;
    assert!(
        losses[49] < 0.7 * losses[0],
        "SGD: {} → {}",
        losses[0],
        losses[49]
    );

    let mlp = Mlp::new(1);
    let config = AdamWConfig {
        lr: 0.01,
        ..Default::default()
    };
    let losses = train(&mut AdamW::new(mlp.params(), config)?, &mlp)?;
    assert!(
        losses[49] < 0.7 * losses[0],
        "AdamW: {} → {}",
        losses[0],
        losses[49]
    );
    Ok(())
}

fn array2(t: &Tensor<f64>) -> Result<Array2<f64>> {
    Ok(t.to_array()?.into_dimensionality::<Ix2>()?)
}

fn array1(t: &Tensor<f64>) -> Result<Array1<f64>> {
    Ok(t.to_array()?.into_dimensionality::<Ix1>()?)
}

/// Gradients of the MLP loss derived by hand: w1, b1, w2, b2.
fn hand_gradients(mlp: &Mlp) -> Result<[ferrotron_tape::ndarray::ArrayD<f64>; 4]> {
    let (x, target) = data();
    let (x, target) = (array2(&x)?, array2(&target)?);
    let (w1, b1) = (array2(&mlp.w1.value()?)?, array1(&mlp.b1.value()?)?);
    let (w2, b2) = (array2(&mlp.w2.value()?)?, array1(&mlp.b2.value()?)?);
    let z1 = x.dot(&w1) + &b1;
    let h = z1.mapv(|v| v.max(0.0));
    let y = h.dot(&w2) + &b2;
    let dy = (y - &target) * (2.0 / target.len() as f64);
    let dw2 = h.t().dot(&dy);
    let db2 = dy.sum_axis(Axis(0));
    let dz1 = dy.dot(&w2.t()) * z1.mapv(|v| if v > 0.0 { 1.0 } else { 0.0 });
    let dw1 = x.t().dot(&dz1);
    let db1 = dz1.sum_axis(Axis(0));
    Ok([
        dw1.into_dyn(),
        db1.into_dyn(),
        dw2.into_dyn(),
        db2.into_dyn(),
    ])
}

fn assert_close(got: &Tensor<f64>, want: &ferrotron_tape::ndarray::ArrayD<f64>) -> Result<()> {
    assert_eq!(got.shape(), want.shape());
    for (g, w) in got.to_vec()?.iter().zip(want.iter()) {
        assert!((g - w).abs() < 1e-12, "{g} vs {w}");
    }
    Ok(())
}

#[test]
fn first_sgd_step_matches_hand_computation() -> Result<()> {
    let mlp = Mlp::new(2);
    let grads = hand_gradients(&mlp)?;
    let before: Vec<_> = mlp
        .params()
        .iter()
        .map(Parameter::value)
        .collect::<ferrotron_tape::Result<_>>()?;
    let (lr, wd) = (0.1, 0.01);
    let mut sgd = Sgd::new(
        mlp.params(),
        SgdConfig {
            weight_decay: wd,
            momentum: 0.9,
            ..SgdConfig::new(lr)
        },
    )?;
    let (x, target) = data();
    mlp.loss(&Tape::new(), &x, &target)?.backward()?;
    for (param, grad) in mlp.params().iter().zip(&grads) {
        assert_close(&param.grad().expect("gradient"), grad)?;
    }
    sgd.step()?;
    for ((param, grad), old) in mlp.params().iter().zip(&grads).zip(&before) {
        // First momentum step: buffer = g + wd·p, p ← p − lr·buffer.
        let old = old.to_array()?;
        let want = &old - &((grad + &(&old * wd)) * lr);
        assert_close(&param.value()?, &want)?;
    }
    Ok(())
}

#[test]
fn first_adamw_step_matches_hand_computation() -> Result<()> {
    let mlp = Mlp::new(3);
    let grads = hand_gradients(&mlp)?;
    let before: Vec<_> = mlp
        .params()
        .iter()
        .map(Parameter::value)
        .collect::<ferrotron_tape::Result<_>>()?;
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut adam = AdamW::new(mlp.params(), config)?;
    let (x, target) = data();
    mlp.loss(&Tape::new(), &x, &target)?.backward()?;
    adam.step()?;
    for ((param, grad), old) in mlp.params().iter().zip(&grads).zip(&before) {
        // Step 1: m̂ = g, v̂ = g², so p ← p·(1 − lr·wd) − lr·g/(|g| + eps).
        let old = old.to_array()?;
        let update = grad.mapv(|g| g / (g.abs() + config.eps));
        let want = &old * (1.0 - config.lr * config.weight_decay) - update * config.lr;
        assert_close(&param.value()?, &want)?;
    }
    Ok(())
}
