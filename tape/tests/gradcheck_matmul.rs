//! Finite-difference checks of matrix products, including transposed (strided) operands.

use anyhow::Result;
use ferrotron_tape::{gradcheck, Generator, GradCheckOptions, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

#[test]
fn matmul_2d() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, (m, k, n)) in [(2, 3, 4), (1, 5, 1), (3, 1, 2)].into_iter().enumerate() {
        let seed = 10 * i as u64;
        gradcheck(
            |x| x[0].matmul(&x[1]),
            &[randn(&[m, k], seed), randn(&[k, n], seed + 1)],
            &options,
        )?;
    }
    Ok(())
}

#[test]
fn matmul_transposed_operands() -> Result<()> {
    let options = GradCheckOptions::default();
    // x · wᵀ with w stored [out, in], as a linear layer does.
    gradcheck(
        |x| x[0].matmul(&x[1].transpose(0, 1)?),
        &[randn(&[3, 4], 1), randn(&[2, 4], 2)],
        &options,
    )?;
    gradcheck(
        |x| x[0].transpose(0, 1)?.matmul(&x[1]),
        &[randn(&[4, 3], 3), randn(&[4, 2], 4)],
        &options,
    )?;
    gradcheck(
        |x| x[0].matmul_transposed(&x[1]),
        &[randn(&[2, 3, 4], 5), randn(&[2, 5, 4], 6)],
        &options,
    )?;
    Ok(())
}

#[test]
fn matmul_transposed_equals_the_product_with_a_transpose() -> Result<()> {
    let (a, w) = (randn(&[2, 3, 4], 7), randn(&[5, 4], 8));
    let expected = a.matmul(&w.transpose(0, 1)?)?.to_vec()?;
    assert_eq!(a.matmul_transposed(&w)?.to_vec()?, expected);
    let err = a.matmul_transposed(&randn(&[4], 9)).unwrap_err();
    assert!(err.to_string().contains("2-D or 3-D"), "{err}");
    Ok(())
}

#[test]
fn matmul_batched() -> Result<()> {
    let options = GradCheckOptions::default();
    gradcheck(
        |x| x[0].matmul(&x[1]),
        &[randn(&[2, 3, 4], 5), randn(&[2, 4, 2], 6)],
        &options,
    )?;
    gradcheck(
        |x| x[0].matmul(&x[1]),
        &[randn(&[1, 2, 3], 7), randn(&[1, 3, 1], 8)],
        &options,
    )?;
    // Attention-style q·kᵀ with the transpose as a view.
    gradcheck(
        |x| x[0].matmul(&x[1].transpose(1, 2)?),
        &[randn(&[2, 3, 4], 9), randn(&[2, 5, 4], 10)],
        &options,
    )?;
    Ok(())
}

#[test]
fn matmul_batch_times_shared_matrix() -> Result<()> {
    let options = GradCheckOptions::default();
    gradcheck(
        |x| x[0].matmul(&x[1]),
        &[randn(&[2, 3, 4], 11), randn(&[4, 5], 12)],
        &options,
    )?;
    // A non-contiguous batch takes the per-batch path.
    gradcheck(
        |x| x[0].permute(&[1, 0, 2])?.matmul(&x[1]),
        &[randn(&[3, 2, 4], 13), randn(&[4, 2], 14)],
        &options,
    )?;
    Ok(())
}

#[test]
fn matmul_values() -> Result<()> {
    let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2])?;
    let b = Tensor::<f32>::from_vec(vec![5.0, 6.0, 7.0, 8.0], &[2, 2])?;
    assert_eq!(a.matmul(&b)?.to_vec()?, vec![19.0, 22.0, 43.0, 50.0]);
    assert_eq!(
        a.matmul(&b.transpose(0, 1)?)?.to_vec()?,
        vec![17.0, 23.0, 39.0, 53.0]
    );
    Ok(())
}
