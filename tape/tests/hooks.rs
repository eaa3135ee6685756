//! Grad-ready hooks fire as soon as a parameter's gradient is complete, while the rest of
//! backward is still running, in reverse order of use.

use std::sync::{mpsc, Arc, Mutex};

use anyhow::Result;
use ferrotron_tape::{CustomOp, Error, Parameter, Tape, Tensor};

type Log = Arc<Mutex<Vec<String>>>;

/// Identity op that writes to the log when its backward runs.
struct Marker {
    label: &'static str,
    log: Log,
}

impl CustomOp<f32> for Marker {
    fn name(&self) -> &str {
        self.label
    }
    fn forward(
        &self,
        inputs: &[Tensor],
        _saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        Ok(inputs[0].clone())
    }
    fn backward(
        &self,
        grad: &Tensor,
        _saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        self.log
            .lock()
            .expect("log")
            .push(format!("backward {}", self.label));
        Ok(vec![Some(grad.clone())])
    }
}

fn logging_param(name: &str, log: &Log) -> Parameter {
    let param = Parameter::new(name, Tensor::full(&[4], 0.5));
    let log = log.clone();
    param.register_grad_hook(move |p| {
        let grad = p
            .grad()
            .ok_or_else(|| Error::custom("hook", "no gradient"))?;
        log.lock()
            .expect("log")
            .push(format!("hook {} {:?}", p.name(), grad.to_vec()?));
        Ok(())
    });
    param
}

#[test]
fn hooks_fire_before_backward_ends_in_reverse_order_of_use() -> Result<()> {
    let log = Log::default();
    let first = logging_param("first", &log);
    let last = logging_param("last", &log);
    let tape = Tape::new();
    let marker = |label| {
        Arc::new(Marker {
            label,
            log: log.clone(),
        }) as Arc<dyn CustomOp>
    };

    // first → marker "early" → × last → marker "late" → sum
    let h = tape.watch(&first)?.scale(2.0)?;
    let h = Tensor::apply(marker("early"), &[&h])?;
    let h = h.mul(&tape.watch(&last)?)?;
    let h = Tensor::apply(marker("late"), &[&h])?;
    h.sum()?.backward()?;
    log.lock().expect("log").push("backward returned".into());

    assert_eq!(
        *log.lock().expect("log"),
        vec![
            "backward late",
            // `last` is complete here, while the early part of the graph is still pending.
            "hook last [1.0, 1.0, 1.0, 1.0]",
            "backward early",
            "hook first [1.0, 1.0, 1.0, 1.0]",
            "backward returned",
        ]
    );
    Ok(())
}

#[test]
fn a_parameter_used_twice_fires_once_with_the_full_gradient() -> Result<()> {
    let log = Log::default();
    let shared = logging_param("shared", &log);
    let tape = Tape::new();
    let marker = Arc::new(Marker {
        label: "middle",
        log: log.clone(),
    });
    let w = tape.watch(&shared)?;
    let h = Tensor::apply(marker, &[&w.scale(3.0)?])?;
    h.add(&tape.watch(&shared)?)?.sum()?.backward()?;
    assert_eq!(
        *log.lock().expect("log"),
        vec!["backward middle", "hook shared [4.0, 4.0, 4.0, 4.0]"]
    );
    Ok(())
}

#[test]
fn hooks_are_send_and_can_hand_gradients_to_another_thread() -> Result<()> {
    let (sender, receiver) = mpsc::channel::<Vec<f32>>();
    let worker = std::thread::spawn(move || {
        receiver
            .iter()
            .map(|g| g.iter().sum::<f32>())
            .collect::<Vec<_>>()
    });
    let w = Parameter::new("w", Tensor::ones(&[3]));
    w.register_grad_hook(move |p| {
        let grad = p
            .grad()
            .ok_or_else(|| Error::custom("hook", "no gradient"))?;
        sender
            .send(grad.to_vec()?)
            .map_err(|e| Error::custom("hook", e.to_string()))
    });
    let tape = Tape::new();
    for _ in 0..2 {
        tape.watch(&w)?.scale(2.0)?.sum()?.backward()?;
    }
    w.clear_grad_hooks(); // drops the sender so the worker finishes
    let sums = worker
        .join()
        .map_err(|_| anyhow::anyhow!("worker panicked"))?;
    assert_eq!(
        sums,
        vec![6.0, 12.0],
        "the second pass sees the accumulated gradient"
    );
    Ok(())
}

#[test]
fn a_failing_hook_stops_backward_with_its_error() -> Result<()> {
    let w = Parameter::new("w", Tensor::<f32>::ones(&[2]));
    w.register_grad_hook(|_| Err(Error::custom("all-reduce hook", "peer rank 3 is gone")));
    let tape = Tape::new();
    let error = tape.watch(&w)?.sum()?.backward().expect_err("hook error");
    assert!(matches!(error, Error::Custom { .. }));
    assert!(error.to_string().contains("peer rank 3 is gone"), "{error}");
    Ok(())
}
