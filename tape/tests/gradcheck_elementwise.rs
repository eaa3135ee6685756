//! Finite-difference checks of the elementwise ops, including broadcasting and size-1 dims.

use anyhow::Result;
use ferrotron_tape::{gradcheck, Gelu, Generator, GradCheckOptions, Parameter, Tape, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

/// Values in [0.5, 2): safe for log, division, and away from relu's kink.
fn positive(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::uniform(shape, 0.5, 2.0, &mut Generator::new(seed))
}

const BROADCAST_PAIRS: &[(&[usize], &[usize])] = &[
    (&[3], &[3]),
    (&[2, 3], &[2, 3]),
    (&[2, 3], &[3]),
    (&[3], &[2, 3]),
    (&[2, 1, 4], &[3, 1]),
    (&[1, 3], &[2, 1]),
    (&[2, 3, 4], &[1]),
    (&[], &[2, 2]),
];

#[test]
fn add_sub_mul_div_broadcast() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, &(a, b)) in BROADCAST_PAIRS.iter().enumerate() {
        let seed = i as u64 * 10;
        let inputs = [randn(a, seed), positive(b, seed + 1)];
        gradcheck(|x| x[0].add(&x[1]), &inputs, &options)?;
        gradcheck(|x| x[0].sub(&x[1]), &inputs, &options)?;
        gradcheck(|x| x[0].mul(&x[1]), &inputs, &options)?;
        gradcheck(|x| x[0].div(&x[1]), &inputs, &options)?;
    }
    Ok(())
}

#[test]
fn same_tensor_on_both_sides() -> Result<()> {
    gradcheck(
        |x| x[0].mul(&x[0]),
        &[randn(&[2, 3], 5)],
        &GradCheckOptions::default(),
    )?;
    Ok(())
}

#[test]
fn unary_ops() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, shape) in [&[4][..], &[2, 3], &[1, 3, 1]].into_iter().enumerate() {
        let x = randn(shape, 100 + i as u64);
        let inputs = std::slice::from_ref(&x);
        gradcheck(|x| x[0].scale(-2.5), inputs, &options)?;
        gradcheck(|x| x[0].neg(), inputs, &options)?;
        gradcheck(|x| x[0].exp(), inputs, &options)?;
        gradcheck(|x| x[0].tanh(), inputs, &options)?;
        gradcheck(|x| x[0].gelu(Gelu::Tanh), inputs, &options)?;
        gradcheck(|x| x[0].gelu(Gelu::Erf), inputs, &options)?;
        gradcheck(|x| x[0].log(), &[positive(shape, 7)], &options)?;
        // Keep relu inputs away from 0, where it has no derivative.
        let signed = positive(shape, 8).mul(&Tensor::from_vec(
            (0..x.numel())
                .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
                .collect(),
            shape,
        )?)?;
        gradcheck(|x| x[0].relu(), &[signed], &options)?;
    }
    Ok(())
}

#[test]
fn forward_values() -> Result<()> {
    let x = Tensor::<f32>::from_vec(vec![-1.0, 0.0, 2.0], &[3])?;
    assert_eq!(x.relu()?.to_vec()?, vec![0.0, 0.0, 2.0]);
    let erf = x.gelu(Gelu::Erf)?.to_vec()?;
    let tanh = x.gelu(Gelu::Tanh)?.to_vec()?;
    // torch.nn.functional.gelu reference values.
    for (got, want) in erf.iter().zip([-0.158_655_25, 0.0, 1.954_499_7]) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    for (got, want) in tanh.iter().zip([-0.158_808, 0.0, 1.954_597_7]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
    let b = Tensor::<f32>::from_vec(vec![10.0, 20.0], &[2, 1])?;
    assert_eq!(x.add(&b)?.shape(), &[2, 3]);
    assert_eq!(
        x.add(&b)?.to_vec()?,
        vec![9.0, 10.0, 12.0, 19.0, 20.0, 22.0]
    );
    Ok(())
}

/// f32 tanh and tanh-GELU (their own vectorised tanh) against the f64 results, forward
/// and backward, from −12 to 12 (both polynomial branches and the saturated range), to a
/// few f32 roundings (absolute near zero: the derivative cancels in 1 + tanh).
#[test]
fn f32_tanh_and_gelu_follow_f64() -> Result<()> {
    let values: Vec<f64> = (0..=2400).map(|i| -12.0 + 0.01 * f64::from(i)).collect();
    let shape = [values.len()];
    let wide = Tensor::<f64>::from_vec(values.clone(), &shape)?;
    let narrow = Tensor::<f32>::from_vec(values.iter().map(|&v| v as f32).collect(), &shape)?;
    type Op32 = fn(&Tensor<f32>) -> ferrotron_tape::Result<Tensor<f32>>;
    type Op64 = fn(&Tensor<f64>) -> ferrotron_tape::Result<Tensor<f64>>;
    let cases: [(&str, Op32, Op64); 2] = [
        ("tanh", |x| x.tanh(), |x| x.tanh()),
        ("gelu", |x| x.gelu(Gelu::Tanh), |x| x.gelu(Gelu::Tanh)),
    ];
    for (name, op32, op64) in cases {
        let (tape32, tape64) = (Tape::new(), Tape::new());
        let (p32, p64) = (
            Parameter::new("x", narrow.clone()),
            Parameter::new("x", wide.clone()),
        );
        let y32 = op32(&tape32.watch(&p32)?)?;
        let y64 = op64(&tape64.watch(&p64)?)?;
        y32.sum()?.backward()?;
        y64.sum()?.backward()?;
        let grad = |p: &Parameter<f32>| p.grad().map(|g| g.to_vec()).transpose();
        let (g32, g64) = (grad(&p32)?, p64.grad().map(|g| g.to_vec()).transpose()?);
        let (g32, g64) = (g32.unwrap_or_default(), g64.unwrap_or_default());
        assert_eq!(g32.len(), values.len(), "{name}: no gradient");
        for (what, got, want) in [
            ("forward", y32.to_vec()?, y64.to_vec()?),
            ("backward", g32, g64),
        ] {
            for ((&got, want), x) in got.iter().zip(want).zip(&values) {
                let error = (f64::from(got) - want).abs();
                assert!(
                    error <= 1e-6 * want.abs().max(1.0),
                    "{name} {what} at {x}: {got} vs {want}"
                );
            }
        }
    }
    Ok(())
}
