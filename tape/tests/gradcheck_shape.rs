//! Finite-difference checks of the shape ops and masked fill.

use anyhow::Result;
use ferrotron_tape::{causal_mask, gradcheck, Generator, GradCheckOptions, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

#[test]
fn reshape_transpose_permute() -> Result<()> {
    let options = GradCheckOptions::default();
    let x = [randn(&[2, 3, 4], 1)];
    gradcheck(|x| x[0].reshape(&[6, 4]), &x, &options)?;
    gradcheck(|x| x[0].reshape(&[24]), &x, &options)?;
    gradcheck(|x| x[0].transpose(0, 2), &x, &options)?;
    gradcheck(|x| x[0].permute(&[1, 2, 0]), &x, &options)?;
    // Reshaping a strided view must copy in row-major order.
    gradcheck(|x| x[0].transpose(1, 2)?.reshape(&[2, 12]), &x, &options)?;
    let t = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    assert_eq!(
        t.transpose(0, 1)?.to_vec()?,
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    assert_eq!(
        t.transpose(0, 1)?.reshape(&[6])?.to_vec()?,
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    Ok(())
}

#[test]
fn narrow_split_chunk_concat() -> Result<()> {
    let options = GradCheckOptions::default();
    let x = [randn(&[3, 5, 2], 2)];
    for dim in 0..3 {
        gradcheck(|x| x[0].narrow(dim, 1, 1), &x, &options)?;
    }
    gradcheck(|x| x[0].narrow(1, 1, 3), &x, &options)?;
    // Use every piece of a split, weighted differently, then put them back together.
    gradcheck(
        |x| {
            let parts = x[0].split(&[2, 0, 3], 1)?;
            let scaled = parts[2].scale(3.0)?;
            Tensor::concat(&[&scaled, &parts[0], &parts[1]], 1)
        },
        &x,
        &options,
    )?;
    gradcheck(
        |x| {
            let parts = x[0].chunk(3, 0)?;
            Tensor::concat(&[&parts[1], &parts[0].exp()?], 0)
        },
        &x,
        &options,
    )?;
    gradcheck(
        |x| Tensor::concat(&[&x[0], &x[1], &x[0]], 2),
        &[randn(&[2, 3, 1], 3), randn(&[2, 3, 2], 4)],
        &options,
    )?;
    let t = Tensor::<f32>::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3])?;
    let parts = t.split(&[1, 2], 1)?;
    assert_eq!(parts[1].to_vec()?, vec![1.0, 2.0, 4.0, 5.0]);
    assert_eq!(
        Tensor::concat(&[&parts[1], &parts[0]], 1)?.to_vec()?,
        vec![1.0, 2.0, 0.0, 4.0, 5.0, 3.0]
    );
    Ok(())
}

#[test]
fn masked_fill_for_causal_attention() -> Result<()> {
    let mask = causal_mask(3);
    gradcheck(
        |x| x[0].masked_fill(&mask, -1e9)?.softmax(),
        &[randn(&[2, 3, 3], 5)],
        &GradCheckOptions::default(),
    )?;
    let scores = Tensor::<f32>::zeros(&[3, 3])
        .masked_fill(&mask, f32::NEG_INFINITY)?
        .softmax()?;
    assert_eq!(
        scores.to_vec()?,
        vec![
            1.0,
            0.0,
            0.0,
            0.5,
            0.5,
            0.0,
            1.0 / 3.0,
            1.0 / 3.0,
            1.0 / 3.0
        ]
    );
    Ok(())
}
