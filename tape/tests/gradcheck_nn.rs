//! Finite-difference checks of the neural-network ops: softmax, layer norm, dropout,
//! embedding and cross-entropy.

use anyhow::Result;
use ferrotron_tape::{
    gradcheck, CrossEntropyOptions, Generator, GradCheckOptions, Reduction, Tensor,
};

fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

#[test]
fn softmax_and_log_softmax() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, shape) in [&[4][..], &[2, 3], &[2, 1, 5], &[3, 1]]
        .into_iter()
        .enumerate()
    {
        let x = [randn(shape, i as u64)];
        gradcheck(|x| x[0].softmax(), &x, &options)?;
        gradcheck(|x| x[0].log_softmax(), &x, &options)?;
    }
    let rows =
        Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 1000.0, 1000.0, 1000.0], &[2, 3])?.softmax()?;
    let values = rows.to_vec()?;
    assert!((values[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
    assert!(
        values[3..].iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-6),
        "stable for large logits"
    );
    Ok(())
}

/// The fused causal softmax: its gradient, and that it equals scale, mask, softmax done
/// one after another (the composite attention used before), forward and backward.
#[test]
fn causal_softmax_equals_scale_mask_softmax() -> Result<()> {
    let options = GradCheckOptions::default();
    for (i, shape) in [&[1, 1][..], &[3, 3], &[2, 4, 4]].into_iter().enumerate() {
        let x = [randn(shape, 20 + i as u64)];
        gradcheck(|x| x[0].causal_softmax(0.7), &x, &options)?;
        let n = shape[shape.len() - 1];
        let tape = ferrotron_tape::Tape::new();
        let watched = |p: &ferrotron_tape::Parameter<f64>| tape.watch(p);
        let (fused_x, composite_x) = (
            ferrotron_tape::Parameter::new("fused", x[0].clone()),
            ferrotron_tape::Parameter::new("composite", x[0].clone()),
        );
        let weights = randn(shape, 30 + i as u64);
        let fused = watched(&fused_x)?.causal_softmax(0.7)?;
        let composite = watched(&composite_x)?
            .scale(0.7)?
            .masked_fill(&ferrotron_tape::causal_mask(n), f64::NEG_INFINITY)?
            .softmax()?;
        fused
            .mul(&weights)?
            .sum()?
            .add(&composite.mul(&weights)?.sum()?)?
            .backward()?;
        let close = |a: Vec<f64>, b: Vec<f64>| {
            a.iter()
                .zip(&b)
                .all(|(a, b)| (a - b).abs() <= 1e-14 * (1.0 + b.abs()))
        };
        assert!(
            close(fused.to_vec()?, composite.to_vec()?),
            "forward {shape:?}"
        );
        let grad = |p: &ferrotron_tape::Parameter<f64>| p.grad().expect("a gradient").to_vec();
        assert!(
            close(grad(&fused_x)?, grad(&composite_x)?),
            "backward {shape:?}"
        );
    }
    let err = Tensor::<f32>::zeros(&[2, 3])
        .causal_softmax(1.0)
        .unwrap_err();
    assert!(err.to_string().contains("square"), "{err}");
    assert!(Tensor::<f32>::zeros(&[3]).causal_softmax(1.0).is_err());
    Ok(())
}

#[test]
fn layer_norm_with_and_without_affine() -> Result<()> {
    let options = GradCheckOptions::default();
    // Widths below, at and past the row kernel's eight-lane blocks.
    for (i, shape) in [&[5][..], &[3, 4], &[2, 1, 3], &[2, 8], &[3, 19]]
        .into_iter()
        .enumerate()
    {
        let width = *shape.last().unwrap_or(&1);
        let seed = 10 * i as u64;
        let inputs = [
            randn(shape, seed),
            randn(&[width], seed + 1),
            randn(&[width], seed + 2),
        ];
        gradcheck(
            |x| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5),
            &inputs,
            &options,
        )?;
        gradcheck(
            |x| x[0].layer_norm(None, Some(&x[2]), 1e-5),
            &inputs,
            &options,
        )?;
        gradcheck(
            |x| x[0].layer_norm(Some(&x[1]), None, 1e-5),
            &inputs,
            &options,
        )?;
        gradcheck(
            |x| x[0].layer_norm(None, None, 1e-5),
            &inputs[..1],
            &options,
        )?;
    }
    let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 4])?;
    let y = x.layer_norm(None, None, 0.0)?.to_vec()?;
    let want = [-1.341_640_8, -0.447_213_6, 0.447_213_6, 1.341_640_8];
    assert!(
        y.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5),
        "{y:?}"
    );
    // A strided (transposed) input normalises as its contiguous copy does.
    let x = randn(&[11, 3], 7).transpose(0, 1)?;
    let copy = Tensor::<f64>::from_vec(x.to_vec()?, x.shape())?;
    assert_eq!(
        x.layer_norm(None, None, 1e-5)?.to_vec()?,
        copy.layer_norm(None, None, 1e-5)?.to_vec()?
    );
    Ok(())
}

#[test]
fn dropout_masks_and_scales() -> Result<()> {
    // A fixed seed inside f gives the same mask on every evaluation.
    gradcheck(
        |x| x[0].dropout(0.3, &mut Generator::new(42)),
        &[randn(&[3, 4], 1)],
        &GradCheckOptions::default(),
    )?;
    let ones = Tensor::<f32>::ones(&[10_000]);
    let out = ones.dropout(0.25, &mut Generator::new(7))?.to_vec()?;
    let kept = out.iter().filter(|&&v| v != 0.0).count();
    assert!((7_200..7_800).contains(&kept), "kept {kept}");
    assert!(out
        .iter()
        .all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
    assert_eq!(
        ones.dropout(0.0, &mut Generator::new(7))?.to_vec()?,
        vec![1.0; 10_000]
    );
    Ok(())
}

#[test]
fn embedding_scatter_adds_repeated_ids() -> Result<()> {
    let ids = [2, 0, 2, 3, 2, 1];
    gradcheck(
        |x| x[0].embedding(&ids, &[2, 3]),
        &[randn(&[4, 3], 3)],
        &GradCheckOptions::default(),
    )?;
    let table = Tensor::<f32>::from_vec((0..6).map(|v| v as f32).collect(), &[3, 2])?;
    let rows = table.embedding(&[2, 2, 0], &[3])?;
    assert_eq!(rows.shape(), &[3, 2]);
    assert_eq!(rows.to_vec()?, vec![4.0, 5.0, 4.0, 5.0, 0.0, 1.0]);
    Ok(())
}

#[test]
fn cross_entropy_all_variants() -> Result<()> {
    let labels = [1, -100, 0, 3, 2, 3];
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        for label_smoothing in [0.0, 0.1] {
            let options = CrossEntropyOptions {
                ignore_index: Some(-100),
                label_smoothing,
                reduction,
            };
            gradcheck(
                |x| x[0].cross_entropy(&labels, &options),
                &[randn(&[2, 3, 4], 9)],
                &GradCheckOptions::default(),
            )?;
        }
    }
    Ok(())
}

#[test]
fn cross_entropy_matches_torch_values() -> Result<()> {
    // torch.nn.functional.cross_entropy(torch.tensor([[1.,2.,3.],[1.,0.,-1.]]), torch.tensor([2,0]))
    let logits = Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 1.0, 0.0, -1.0], &[2, 3])?;
    let plain = logits
        .cross_entropy(&[2, 0], &CrossEntropyOptions::default())?
        .item()?;
    assert!((plain - 0.407_605_964_1).abs() < 1e-9, "{plain}");
    // ... with label_smoothing=0.1 → 0.5076059641.
    let smooth = CrossEntropyOptions {
        label_smoothing: 0.1,
        ..Default::default()
    };
    let smoothed = logits.cross_entropy(&[2, 0], &smooth)?.item()?;
    assert!((smoothed - 0.507_605_964_1).abs() < 1e-9, "{smoothed}");
    // An ignored row is excluded from the mean.
    let ignored = logits
        .cross_entropy(&[2, -100], &CrossEntropyOptions::default())?
        .item()?;
    assert!((ignored - 0.407_605_964_1).abs() < 1e-9, "{ignored}");
    // Unreduced losses have the leading shape.
    let none = CrossEntropyOptions {
        reduction: Reduction::None,
        ..Default::default()
    };
    assert_eq!(logits.cross_entropy(&[2, 0], &none)?.shape(), &[2]);
    Ok(())
}
