//! Backward from a grad handle (a recorded tensor without its values) is backward from
//! the tensor itself.

use ferrotron_tape::{Error, Generator, Parameter, Tape, Tensor};

#[test]
fn a_handle_backpropagates_as_its_tensor_would() -> ferrotron_tape::Result<()> {
    let mut rng = Generator::new(3);
    let x = Tensor::randn(&[2, 3], 1.0, &mut rng);
    let seed = Tensor::randn(&[2, 4], 1.0, &mut rng);
    let run = |use_handle: bool| -> ferrotron_tape::Result<Vec<f32>> {
        let w = Parameter::new("w", Tensor::full(&[3, 4], 0.5));
        let tape = Tape::new();
        let y = x.matmul(&tape.watch(&w)?)?.tanh()?;
        if use_handle {
            let handle = y.grad_handle().expect("recorded");
            assert_eq!(handle.shape(), &[2, 4]);
            drop(y); // the values go; backward still runs
            handle.backward_with_grad(&seed)?;
        } else {
            y.backward_with_grad(&seed)?;
        }
        w.grad().expect("a gradient").to_vec()
    };
    assert_eq!(run(true)?, run(false)?);
    Ok(())
}

#[test]
fn a_handle_checks_its_seed_and_needs_a_recorded_tensor() -> ferrotron_tape::Result<()> {
    assert!(
        Tensor::<f32>::ones(&[2]).grad_handle().is_none(),
        "not on a tape"
    );
    let w = Parameter::new("w", Tensor::<f32>::ones(&[2]));
    let tape = Tape::new();
    let handle = tape.watch(&w)?.scale(2.0)?.grad_handle().expect("recorded");
    let err = handle.backward_with_grad(&Tensor::ones(&[3])).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    handle.backward_with_grad(&Tensor::ones(&[2]))?;
    assert_eq!(w.grad().expect("a gradient").to_vec()?, vec![2.0, 2.0]);
    Ok(())
}
