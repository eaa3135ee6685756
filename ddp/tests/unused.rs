//! Parameters without a gradient: with `find_unused_parameters` they count as zeros (and
//! keep no gradient when no rank used them); without it, an error names them and the next
//! step still works.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, Error};
use ferrotron_tape::{Parameter, Tape, Tensor};

/// `used` on every rank, `rank0_only` on rank 0, `never` on no rank; one bucket each, with
/// `never` and `rank0_only` launching first.
fn params() -> Vec<Parameter> {
    vec![
        Parameter::new("used", Tensor::ones(&[3])),
        Parameter::new("rank0_only", Tensor::ones(&[2])),
        Parameter::new("never", Tensor::ones(&[2])),
    ]
}

fn tiny_buckets(find_unused_parameters: bool) -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 1,
        bucket_cap_bytes: 1,
        find_unused_parameters,
        ..DdpConfig::default()
    }
}

#[test]
fn unused_parameters_are_zeros_with_the_flag() -> Result<()> {
    let grads = run_local(2, |comm| -> Result<Vec<Option<Vec<f32>>>> {
        let rank = comm.rank();
        let params = params();
        let ddp = DistributedDataParallel::new(params.clone(), Arc::new(comm), tiny_buckets(true))?;
        assert_eq!(ddp.buckets().len(), 3);
        let tape = Tape::new();
        let mut loss = tape.watch(&params[0])?.scale(rank as f64 + 1.0)?.sum()?;
        if rank == 0 {
            loss = loss.add(&tape.watch(&params[1])?.scale(4.0)?.sum()?)?;
        }
        ddp.backward(&loss)?;
        Ok(params
            .iter()
            .map(|p| p.grad().map(|g| g.to_vec()).transpose())
            .collect::<ferrotron_tape::Result<_>>()?)
    })?;
    for per_param in &grads {
        assert_eq!(per_param[0], Some(vec![1.5; 3]), "(1 + 2) / 2");
        assert_eq!(per_param[1], Some(vec![2.0; 2]), "(4 + 0) / 2");
        assert_eq!(per_param[2], None, "unused everywhere: no gradient");
    }
    Ok(())
}

#[test]
fn without_the_flag_an_error_names_the_parameters_and_the_next_step_works() -> Result<()> {
    run_local(2, |comm| -> Result<()> {
        let params = params();
        let ddp =
            DistributedDataParallel::new(params.clone(), Arc::new(comm), tiny_buckets(false))?;
        let tape = Tape::new();
        let partial = tape
            .watch(&params[0])?
            .sum()?
            .add(&tape.watch(&params[1])?.sum()?)?;
        match ddp.backward(&partial) {
            Err(Error::UnusedParameters { names, buckets }) => {
                assert_eq!(names, vec!["never".to_string()]);
                assert_eq!(buckets, vec![0]);
            }
            other => panic!("expected UnusedParameters, got {other:?}"),
        }
        let message = ddp
            .finish()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.contains("find_unused_parameters"), "{message}");

        // A full step afterwards synchronises normally.
        for p in &params {
            p.zero_grad();
        }
        let full = params
            .iter()
            .map(|p| tape.watch(p)?.sum())
            .collect::<ferrotron_tape::Result<Vec<_>>>()?;
        let loss = full[0].add(&full[1])?.add(&full[2])?;
        ddp.backward(&loss)?;
        for p in &params {
            assert!(p.grad().is_some(), "{} has a gradient", p.name());
        }
        Ok(())
    })?;
    Ok(())
}

#[test]
fn accumulated_gradients_count_as_used() -> Result<()> {
    let grads = run_local(2, |comm| -> Result<Vec<f32>> {
        let params = params();
        let ddp = DistributedDataParallel::new(params.clone(), Arc::new(comm), tiny_buckets(true))?;
        let tape = Tape::new();
        {
            let _accumulate = ddp.no_sync();
            ddp.backward(&tape.watch(&params[2])?.scale(2.0)?.sum()?)?;
        }
        // The last micro-batch does not touch `never`; its accumulated gradient still counts.
        ddp.backward(&tape.watch(&params[0])?.sum()?)?;
        Ok(params[2]
            .grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default())
    })?;
    assert_eq!(grads, vec![vec![2.0, 2.0]; 2]);
    Ok(())
}
