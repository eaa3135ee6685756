//! The thread-count setting, and products, layer norms, softmaxes and pointwise ops split
//! over threads equal the one-thread results.

use anyhow::Result;
use ferrotron_tape::{num_threads, set_num_threads, Generator, Parameter, Tape, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor<f32> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

/// Output and both gradients of `a·b` (any of the product's shape forms).
fn product_and_grads(a: &Tensor<f32>, b: &Tensor<f32>) -> Result<[Vec<f32>; 3]> {
    let (pa, pb) = (
        Parameter::new("a", a.clone()),
        Parameter::new("b", b.clone()),
    );
    let tape = Tape::new();
    let y = tape.watch(&pa)?.matmul(&tape.watch(&pb)?)?;
    // A non-uniform seed, so every gradient element depends on its own output row/column.
    let weights = randn(y.shape(), 99);
    y.mul(&weights)?.sum()?.backward()?;
    let grad = |p: &Parameter<f32>| -> Result<Vec<f32>> {
        Ok(p.grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default())
    };
    Ok([y.to_vec()?, grad(&pa)?, grad(&pb)?])
}

#[test]
fn products_on_several_threads_equal_one_thread_bit_for_bit() -> Result<()> {
    // Large enough to split three ways: by rows (tall), by columns (wide), a batch of
    // products, a batch times a shared matrix, and non-multiples of the 8-wide tiles.
    let cases: [(&[usize], &[usize]); 4] = [
        (&[129, 257], &[257, 200]),
        (&[40, 300], &[300, 601]),
        (&[6, 97, 96], &[6, 96, 130]),
        (&[5, 67, 129], &[129, 250]),
    ];
    for (i, (a_shape, b_shape)) in cases.into_iter().enumerate() {
        let (a, b) = (randn(a_shape, i as u64), randn(b_shape, 10 + i as u64));
        set_num_threads(1)?;
        let one = product_and_grads(&a, &b)?;
        set_num_threads(3)?;
        let three = product_and_grads(&a, &b)?;
        for (what, (x, y)) in ["product", "grad a", "grad b"]
            .iter()
            .zip(one.iter().zip(&three))
        {
            assert!(!x.is_empty(), "{what} of case {i} is missing");
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{what} of case {a_shape:?}·{b_shape:?} differs between 1 and 3 threads"
            );
        }
    }
    Ok(())
}

/// Every row-wise and pointwise op's output and input gradient (and the layer norm's
/// parameter gradients) on `x`.
fn row_ops_and_grads(x: &Tensor<f32>) -> Result<Vec<Vec<f32>>> {
    let width = *x.shape().last().unwrap_or(&1);
    let px = Parameter::new("x", x.clone());
    let weight = Parameter::new("w", randn(&[width], 7));
    let bias = Parameter::new("b", randn(&[width], 8));
    let tape = Tape::new();
    let input = tape.watch(&px)?;
    let outputs = [
        input.layer_norm(Some(&tape.watch(&weight)?), Some(&tape.watch(&bias)?), 1e-5)?,
        input.softmax()?,
        input.causal_softmax(0.125)?,
        input.gelu(ferrotron_tape::Gelu::Tanh)?,
        input.gelu(ferrotron_tape::Gelu::Erf)?,
        input.tanh()?,
    ];
    let mut total = outputs[0].sum()?;
    let mut values = Vec::new();
    for (i, y) in outputs.iter().enumerate() {
        values.push(y.to_vec()?);
        total = total.add(&y.mul(&randn(y.shape(), 20 + i as u64))?.sum()?)?;
    }
    total.backward()?;
    for p in [&px, &weight, &bias] {
        values.push(
            p.grad()
                .map(|g| g.to_vec())
                .transpose()?
                .unwrap_or_default(),
        );
    }
    Ok(values)
}

#[test]
fn row_and_pointwise_ops_on_several_threads_equal_one_thread_bit_for_bit() -> Result<()> {
    // Square matrices (the causal softmax's rows are positions), enough elements for
    // three threads, and a row count that does not divide evenly.
    let x = randn(&[3, 257, 257], 5);
    set_num_threads(1)?;
    let one = row_ops_and_grads(&x)?;
    set_num_threads(3)?;
    let three = row_ops_and_grads(&x)?;
    for (i, (a, b)) in one.iter().zip(&three).enumerate() {
        assert!(!a.is_empty(), "result {i} is missing");
        assert!(
            a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
            "result {i} differs between 1 and 3 threads"
        );
    }
    Ok(())
}

#[test]
fn the_setting_is_per_thread_and_rejects_zero() -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert_eq!(
        num_threads(),
        cores,
        "unset: the cores available to the process"
    );
    set_num_threads(5)?;
    assert_eq!(num_threads(), 5);
    let elsewhere = std::thread::spawn(num_threads).join().expect("thread");
    assert_eq!(elsewhere, cores, "another thread keeps its own setting");
    let err = set_num_threads(0).unwrap_err();
    assert!(err.to_string().contains("at least one thread"), "{err}");
    assert_eq!(num_threads(), 5, "a rejected setting changes nothing");
    Ok(())
}

#[test]
fn local_rank_threads_share_the_cores() -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    for ranks in [1, 2, 3] {
        let seen = ferrotron_comm_core::run_local(ranks, |_| {
            Ok::<_, ferrotron_comm_core::Error>(num_threads())
        })?;
        assert_eq!(seen, vec![(cores / ranks).max(1); ranks], "{ranks} ranks");
    }
    Ok(())
}
