//! Tape behaviour: no_grad, one tape per model/thread, consumed graphs, detach.

use anyhow::Result;
use ferrotron_tape::{Error, Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor};

#[test]
fn no_grad_records_nothing_and_restores_recording() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[3]));
    let tape = Tape::new();
    let y = tape.no_grad(|| tape.watch(&w)?.exp())?;
    assert!(!y.requires_grad());
    assert!(tape.is_empty());
    assert!(tape.is_recording());
    let z = tape.watch(&w)?.exp()?;
    assert!(z.requires_grad());
    assert_eq!(tape.len(), 2, "one leaf and one op");
    assert!(!z.detach().requires_grad());
    tape.clear();
    assert!(tape.is_empty());
    Ok(())
}

#[test]
fn a_consumed_graph_is_reported_not_silently_reused() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[3]));
    let tape = Tape::new();
    let watched = tape.watch(&w)?;
    let loss = watched.sum()?;
    loss.backward()?;
    assert!(matches!(
        loss.backward(),
        Err(Error::StaleGraph { op: "backward" })
    ));
    assert!(matches!(
        watched.exp(),
        Err(Error::StaleGraph { op: "exp" })
    ));
    // Watching again starts a new pass.
    tape.watch(&w)?.sum()?.backward()?;
    assert_eq!(w.grad().expect("grad").to_vec()?, vec![2.0; 3]);
    Ok(())
}

#[test]
fn tensors_from_two_tapes_do_not_mix() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[3]));
    let (a, b) = (Tape::new(), Tape::new());
    let error = a.watch(&w)?.add(&b.watch(&w)?).expect_err("mixed tapes");
    assert!(matches!(error, Error::TapeMismatch { op: "add" }));
    let loss = a.watch(&w)?.sum()?;
    assert!(matches!(b.backward(&loss), Err(Error::TapeMismatch { .. })));
    a.backward(&loss)?;
    Ok(())
}

/// Trains a small model for a few SGD steps and returns its final weights.
fn train(seed: u64) -> ferrotron_tape::Result<Vec<f32>> {
    let mut rng = Generator::new(seed);
    let w = Parameter::new("w", Tensor::<f32>::randn(&[8, 4], 0.3, &mut rng));
    let x = Tensor::<f32>::randn(&[16, 8], 1.0, &mut rng);
    let mut sgd = Sgd::new(vec![w.clone()], SgdConfig::new(0.1))?;
    let tape = Tape::new();
    for _ in 0..10 {
        sgd.zero_grad();
        let y = x.matmul(&tape.watch(&w)?)?.tanh()?;
        y.mul(&y)?.mean()?.backward()?;
        sgd.step()?;
    }
    w.value()?.to_vec()
}

#[test]
fn eight_threads_train_independently() -> Result<()> {
    let serial: Vec<Vec<f32>> = (0..8).map(train).collect::<ferrotron_tape::Result<_>>()?;
    let threads: Vec<_> = (0..8)
        .map(|seed| std::thread::spawn(move || train(seed)))
        .collect();
    for (handle, expected) in threads.into_iter().zip(serial) {
        let got = handle
            .join()
            .map_err(|_| anyhow::anyhow!("rank thread panicked"))??;
        assert_eq!(got, expected);
    }
    Ok(())
}

#[test]
fn unused_parameters_get_no_gradient() -> Result<()> {
    let used = Parameter::new("used", Tensor::<f32>::ones(&[2]));
    let unused = Parameter::new("unused", Tensor::<f32>::ones(&[2]));
    let tape = Tape::new();
    let _dangling = tape.watch(&unused)?.exp()?;
    tape.watch(&used)?.sum()?.backward()?;
    assert!(used.grad().is_some());
    assert!(unused.grad().is_none());
    Ok(())
}

#[test]
fn backward_with_an_explicit_seed() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[2]));
    let tape = Tape::new();
    let y = tape.watch(&w)?.scale(3.0)?;
    y.backward_with_grad(&Tensor::from_vec(vec![1.0, 2.0], &[2])?)?;
    assert_eq!(w.grad().expect("grad").to_vec()?, vec![3.0, 6.0]);
    Ok(())
}
