//! Finite-difference checks of sum, mean and max.

use anyhow::Result;
use ferrotron_tape::{gradcheck, Generator, GradCheckOptions, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

#[test]
fn sum_and_mean_all() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, shape) in [&[5][..], &[2, 3], &[2, 1, 3], &[]].into_iter().enumerate() {
        let x = [randn(shape, i as u64)];
        gradcheck(|x| x[0].sum(), &x, &options)?;
        gradcheck(|x| x[0].mean(), &x, &options)?;
    }
    Ok(())
}

#[test]
fn sum_mean_max_along_dims() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, shape) in [&[4][..], &[2, 3], &[2, 1, 3], &[3, 2, 4]]
        .into_iter()
        .enumerate()
    {
        let x = [randn(shape, 10 + i as u64)];
        for dim in 0..shape.len() {
            for keepdim in [false, true] {
                gradcheck(|x| x[0].sum_dim(dim, keepdim), &x, &options)?;
                gradcheck(|x| x[0].mean_dim(dim, keepdim), &x, &options)?;
                gradcheck(|x| x[0].max_dim(dim, keepdim), &x, &options)?;
            }
        }
    }
    Ok(())
}

#[test]
fn reduction_values_and_shapes() -> Result<()> {
    let x = Tensor::<f32>::from_vec(vec![1.0, 5.0, 3.0, 4.0, 2.0, 6.0], &[2, 3])?;
    assert_eq!(x.sum()?.item()?, 21.0);
    assert_eq!(x.mean()?.item()?, 3.5);
    assert_eq!(x.sum_dim(0, false)?.to_vec()?, vec![5.0, 7.0, 9.0]);
    assert_eq!(x.mean_dim(1, true)?.shape(), &[2, 1]);
    assert_eq!(x.max_dim(1, false)?.to_vec()?, vec![5.0, 6.0]);
    assert_eq!(x.max_dim(0, true)?.to_vec()?, vec![4.0, 5.0, 6.0]);
    Ok(())
}
