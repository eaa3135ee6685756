//! Buckets start their all-reduce while backward is still running, strictly in bucket
//! order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use ferrotron_comm_core::{run_local, Buffer, Communicator, Work};
use ferrotron_ddp::{AllReduceAvg, CommHook, DdpConfig, DistributedDataParallel, SyncProgress};
use ferrotron_tape::{CustomOp, Parameter, Tape, Tensor};

/// Identity op whose backward records how many buckets had started by then.
struct Probe {
    progress: SyncProgress,
    seen: Arc<AtomicUsize>,
}

impl CustomOp<f32> for Probe {
    fn name(&self) -> &str {
        "probe"
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
        self.seen
            .store(self.progress.buckets_started(), Ordering::SeqCst);
        Ok(vec![Some(grad.clone())])
    }
}

fn one_bucket_per_param(overlap_grad_reduce: bool) -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 1,
        bucket_cap_bytes: 1,
        overlap_grad_reduce,
        ..DdpConfig::default()
    }
}

/// x·w1 → probe → ·w2 → ·w3 → sum. Backward completes w3, then w2, runs the probe, then
/// completes w1. Returns (buckets started when the probe ran, when w1's own earlier hook
/// ran, at the end).
fn started_during_backward(overlap: bool) -> Result<Vec<(usize, usize, usize)>> {
    Ok(run_local(2, |comm| -> Result<(usize, usize, usize)> {
        let w: Vec<Parameter> = (1..=3)
            .map(|i| Parameter::new(format!("w{i}"), Tensor::full(&[2, 2], 0.5)))
            .collect();
        // Registered before DDP's own hook, so it runs before w1's bucket can start.
        let at_w1_hook = Arc::new(Mutex::new(None::<SyncProgress>));
        let seen_at_w1 = Arc::new(AtomicUsize::new(usize::MAX));
        {
            let (slot, seen) = (at_w1_hook.clone(), seen_at_w1.clone());
            w[0].register_grad_hook(move |_| {
                if let Some(progress) = slot.lock().expect("slot").as_ref() {
                    seen.store(progress.buckets_started(), Ordering::SeqCst);
                }
                Ok(())
            });
        }
        let ddp =
            DistributedDataParallel::new(w.clone(), Arc::new(comm), one_bucket_per_param(overlap))?;
        *at_w1_hook.lock().expect("slot") = Some(ddp.progress());
        assert_eq!(ddp.progress().buckets_total(), 3);

        let seen_at_probe = Arc::new(AtomicUsize::new(usize::MAX));
        let probe = Arc::new(Probe {
            progress: ddp.progress(),
            seen: seen_at_probe.clone(),
        });
        let tape = Tape::new();
        let x = Tensor::ones(&[1, 2]);
        let h = x.matmul(&tape.watch(&w[0])?)?;
        let h = Tensor::apply(probe, &[&h])?;
        let loss = h
            .matmul(&tape.watch(&w[1])?)?
            .matmul(&tape.watch(&w[2])?)?
            .sum()?;
        loss.backward()?;
        let at_end = ddp.progress().buckets_started();
        ddp.finish()?;
        Ok((
            seen_at_probe.load(Ordering::SeqCst),
            seen_at_w1.load(Ordering::SeqCst),
            at_end,
        ))
    })?)
}

#[test]
fn buckets_start_before_backward_ends() -> Result<()> {
    // w3's and w2's buckets are in flight while the rest of backward still runs.
    assert_eq!(started_during_backward(true)?, vec![(2, 2, 3); 2]);
    Ok(())
}

#[test]
fn without_overlap_every_bucket_starts_in_finish() -> Result<()> {
    assert_eq!(started_during_backward(false)?, vec![(0, 0, 0); 2]);
    Ok(())
}

/// `a` is registered first but its gradient completes first: its bucket (1) must wait
/// for bucket 0 (`b`) so that every rank issues the all-reduces in the same order.
#[test]
fn a_bucket_ready_early_waits_for_earlier_buckets() -> Result<()> {
    let seen = run_local(2, |comm| -> Result<(usize, usize)> {
        let a = Parameter::new("a", Tensor::ones(&[2]));
        let b = Parameter::new("b", Tensor::ones(&[2]));
        let ddp = DistributedDataParallel::new(
            vec![a.clone(), b.clone()],
            Arc::new(comm),
            one_bucket_per_param(true),
        )?;
        assert_eq!(ddp.buckets()[0].params[0].name, "b");
        let (after_a, after_b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        for (param, slot) in [(&a, after_a.clone()), (&b, after_b.clone())] {
            let progress = ddp.progress();
            param.register_grad_hook(move |_| {
                slot.store(progress.buckets_started(), Ordering::SeqCst);
                Ok(())
            });
        }
        let probe = Arc::new(Probe {
            progress: ddp.progress(),
            seen: Arc::new(AtomicUsize::new(0)),
        });
        let tape = Tape::new();
        // a is used last in forward, so backward completes it first.
        let hb = Tensor::apply(probe, &[&tape.watch(&b)?.scale(2.0)?])?;
        let loss = hb.mul(&tape.watch(&a)?)?.sum()?;
        ddp.backward(&loss)?;
        Ok((
            after_a.load(Ordering::SeqCst),
            after_b.load(Ordering::SeqCst),
        ))
    })?;
    assert_eq!(seen, vec![(0, 2); 2]);
    Ok(())
}

/// Records, as each bucket starts, how many buckets the progress handle says had started.
struct ProgressLoggingHook {
    progress: Arc<Mutex<Option<SyncProgress>>>,
    seen: Arc<Mutex<Vec<usize>>>,
}

impl CommHook for ProgressLoggingHook {
    fn name(&self) -> &str {
        "progress-logging"
    }
    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work> {
        if let Some(progress) = self.progress.lock().expect("slot").as_ref() {
            self.seen
                .lock()
                .expect("log")
                .push(progress.buckets_started());
        }
        AllReduceAvg.start(dp, bucket)
    }
}

/// A comm hook runs while the DDP's reducer is locked; the progress handle must not take
/// that lock (it used to, and the rank deadlocked on itself).
#[test]
fn a_comm_hook_may_read_progress() -> Result<()> {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let logs = run_local(2, |comm| -> Result<Vec<usize>> {
            let w: Vec<Parameter> = (1..=3)
                .map(|i| Parameter::new(format!("w{i}"), Tensor::full(&[2], 0.5)))
                .collect();
            let progress = Arc::new(Mutex::new(None));
            let seen = Arc::new(Mutex::new(Vec::new()));
            let config = DdpConfig {
                comm_hook: Arc::new(ProgressLoggingHook {
                    progress: progress.clone(),
                    seen: seen.clone(),
                }),
                ..one_bucket_per_param(true)
            };
            let ddp = DistributedDataParallel::new(w.clone(), Arc::new(comm), config)?;
            *progress.lock().expect("slot") = Some(ddp.progress());
            let tape = Tape::new();
            let loss = w
                .iter()
                .map(|p| tape.watch(p)?.sum())
                .reduce(|a, b| a?.add(&b?))
                .expect("three parameters")?;
            ddp.backward(&loss)?;
            let log = seen.lock().expect("log").clone();
            Ok(log)
        });
        let _ = done.send(logs.map_err(|e| e.to_string()));
    });
    let logs = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a comm hook reading progress deadlocked the rank")
        .map_err(anyhow::Error::msg)?;
    // Each bucket sees the ones before it as started.
    assert_eq!(logs, vec![vec![0, 1, 2]; 2]);
    Ok(())
}
