//! Finite-difference checks of the elementwise ops, including broadcasting and size-1 dims.

use anyhow::Result;
use tape::{gradcheck, Gelu, Generator, GradCheckOptions, Tensor};

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
