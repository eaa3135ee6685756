//! A parameter's pending value (`Parameter::set_pending`): the work that sets it runs once,
//! at the first read or write of any parameter it was given to, a tape's `watch`
//! included (another thread's read waits for a landing under way); a value set
//! explicitly is not overwritten by it later; a failure is the error of every later
//! read (`value`, `watch`, `settle`), never the old value; a landing that panics fails
//! too, and the threads waiting for it see that failure.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrotron_tape::{Error, Parameter, PendingValue, Tape, Tensor};

fn param(name: &str, value: f32) -> Parameter {
    Parameter::new(name, Tensor::from_vec(vec![value; 2], &[2]).unwrap())
}

/// Two parameters whose pending work sets them to 7 and 8, counting its runs.
fn pending_pair() -> (Parameter, Parameter, Arc<AtomicUsize>) {
    let (a, b) = (param("a", 1.0), param("b", 2.0));
    let runs = Arc::new(AtomicUsize::new(0));
    let (la, lb, counted) = (a.clone(), b.clone(), runs.clone());
    let pending = PendingValue::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        la.set_value(Tensor::from_vec(vec![7.0; 2], &[2])?)?;
        lb.set_value(Tensor::from_vec(vec![8.0; 2], &[2])?)
    });
    a.set_pending(&pending);
    b.set_pending(&pending);
    (a, b, runs)
}

#[test]
fn the_first_read_of_either_parameter_lands_both_once() {
    let (a, b, runs) = pending_pair();
    let tape = Tape::new();
    assert_eq!(tape.watch(&b).unwrap().to_vec().unwrap(), [8.0, 8.0]);
    assert_eq!(a.value().unwrap().to_vec().unwrap(), [7.0, 7.0]);
    let mut out = [0.0; 2];
    a.read_flat(0, &mut out).unwrap();
    assert_eq!(out, [7.0, 7.0]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_value_set_before_the_landing_is_not_overwritten_by_it() {
    let (a, b, runs) = pending_pair();
    a.set_value(Tensor::from_vec(vec![3.0; 2], &[2]).unwrap())
        .unwrap();
    assert_eq!(a.value().unwrap().to_vec().unwrap(), [3.0, 3.0]);
    assert_eq!(b.value().unwrap().to_vec().unwrap(), [8.0, 8.0]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn a_failed_landing_is_every_later_reads_error_never_the_old_value() {
    let a = param("a", 1.0);
    let pending = PendingValue::new(|| Err(Error::custom("gather", "a peer was lost")));
    a.set_pending(&pending);
    let tape = Tape::new();
    for _ in 0..2 {
        let errors = [
            a.value().map(drop).unwrap_err(),
            tape.watch(&a).map(drop).unwrap_err(),
            a.settle().unwrap_err(),
            a.read_flat(0, &mut [0.0; 2]).unwrap_err(),
        ];
        for error in errors.map(|e| e.to_string()) {
            assert!(error.contains("a peer was lost"), "{error}");
        }
    }
    assert!(a.write_flat(0, &[5.0]).is_err());
}

#[test]
fn a_landing_that_panics_fails_and_wakes_the_threads_waiting_for_it() {
    let (a, b) = (param("a", 1.0), param("b", 2.0));
    let (started, under_way) = std::sync::mpsc::channel();
    let pending = PendingValue::new(move || {
        started.send(()).expect("the test listens");
        std::thread::sleep(std::time::Duration::from_millis(100));
        panic!("the gather's buffer was misplaced");
    });
    a.set_pending(&pending);
    b.set_pending(&pending);
    let landing = std::thread::spawn(move || a.value().map(drop));
    under_way.recv().unwrap();
    // Waits for the landing under way, which panics: a failure, not a wait forever.
    let error = b.value().map(drop).unwrap_err().to_string();
    assert!(error.contains("panicked"), "{error}");
    assert!(landing.join().is_err(), "the landing thread panicked");
    assert!(b.settle().is_err());
}

#[test]
fn another_threads_read_waits_for_a_landing_under_way() {
    let (a, b) = (param("a", 1.0), param("b", 2.0));
    let (started, under_way) = std::sync::mpsc::channel();
    let lb = b.clone();
    let pending = PendingValue::new(move || {
        started.send(()).expect("the test listens");
        // Long enough for the other thread's read to arrive while this runs.
        std::thread::sleep(std::time::Duration::from_millis(100));
        lb.set_value(Tensor::from_vec(vec![8.0; 2], &[2])?)
    });
    a.set_pending(&pending);
    b.set_pending(&pending);
    let landing = std::thread::spawn(move || a.value().map(drop));
    under_way.recv().unwrap();
    assert_eq!(b.value().unwrap().to_vec().unwrap(), [8.0, 8.0]);
    landing.join().unwrap().unwrap();
}
