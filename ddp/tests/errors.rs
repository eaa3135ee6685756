//! Misuse becomes a typed error, never a panic or a hang.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::run_local;
use ferrotron_ddp::{CommHook, DdpConfig, DistributedDataParallel, Error};
use ferrotron_tape::{Parameter, Tape, Tensor};

#[test]
fn a_second_backward_without_finish_is_reported_and_recovers() -> Result<()> {
    run_local(2, |comm| -> Result<()> {
        let w = Parameter::new("w", Tensor::ones(&[2]));
        let ddp =
            DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), DdpConfig::default())?;
        let tape = Tape::new();
        tape.watch(&w)?.sum()?.backward()?; // forgot finish()
        let err = ddp.backward(&tape.watch(&w)?.sum()?).unwrap_err();
        assert!(
            matches!(&err, Error::FinishNotCalled { name } if name == "w"),
            "{err}"
        );
        assert!(err.to_string().contains("no_sync"), "{err}");

        w.zero_grad();
        ddp.backward(&tape.watch(&w)?.scale(3.0)?.sum()?)?;
        assert_eq!(
            w.grad().map(|g| g.to_vec()).transpose()?,
            Some(vec![3.0, 3.0])
        );
        Ok(())
    })?;
    Ok(())
}

#[test]
fn duplicate_parameters_and_zero_caps_are_rejected() -> Result<()> {
    run_local(1, |comm| -> Result<()> {
        let comm: Arc<dyn ferrotron_comm_core::Communicator> = Arc::new(comm);
        let w = Parameter::new("w", Tensor::ones(&[2]));
        let err = DistributedDataParallel::new(
            vec![w.clone(), w.clone()],
            comm.clone(),
            DdpConfig::default(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicateParameter {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{err}"
        );

        let config = DdpConfig {
            bucket_cap_bytes: 0,
            ..DdpConfig::default()
        };
        let err = DistributedDataParallel::new(vec![w], comm, config).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        Ok(())
    })?;
    Ok(())
}

/// A hook that asks for integer buckets.
struct IntegerHook;

impl CommHook for IntegerHook {
    fn name(&self) -> &str {
        "integer"
    }
    fn wire_dtype(&self) -> ferrotron_comm_core::DType {
        ferrotron_comm_core::DType::I32
    }
    fn start(
        &self,
        dp: &dyn ferrotron_comm_core::Communicator,
        bucket: ferrotron_comm_core::Buffer,
    ) -> ferrotron_comm_core::Result<ferrotron_comm_core::Work> {
        ferrotron_ddp::AllReduceAvg.start(dp, bucket)
    }
}

#[test]
fn a_hook_with_a_non_float_wire_dtype_is_rejected() -> Result<()> {
    run_local(1, |comm| -> Result<()> {
        let config = DdpConfig {
            comm_hook: Arc::new(IntegerHook),
            ..DdpConfig::default()
        };
        let w = Parameter::new("w", Tensor::ones(&[2]));
        let err = DistributedDataParallel::new(vec![w], Arc::new(comm), config).unwrap_err();
        assert!(err.to_string().contains("integer"), "{err}");
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_lost_peer_fails_the_step_instead_of_hanging() -> Result<()> {
    let outcomes = ferrotron_comm_core::LocalLauncher::new(2)?
        .timeout(std::time::Duration::from_secs(20))
        .run_each(|comm| -> Result<()> {
            let rank = ferrotron_comm_core::Communicator::rank(&comm);
            let w = Parameter::new("w", Tensor::ones(&[2]));
            let ddp = DistributedDataParallel::new(
                vec![w.clone()],
                Arc::new(comm),
                DdpConfig::default(),
            )?;
            if rank == 1 {
                anyhow::bail!("rank 1 stops before backward");
            }
            let tape = Tape::new();
            ddp.backward(&tape.watch(&w)?.sum()?)?;
            Ok(())
        });
    let (_, rank0) = outcomes[0]
        .as_ref()
        .expect_err("rank 0 sees the loss of rank 1");
    assert!(
        matches!(
            rank0.root_cause(),
            ferrotron_comm_core::Error::RankFailed { .. }
                | ferrotron_comm_core::Error::PeerLost { .. }
        ),
        "{rank0}"
    );
    assert!(rank0.to_string().contains("peer lost"), "{rank0}");
    Ok(())
}

/// The distributed optimizer refuses the settings the replicated one refuses, before it
/// shards anything.
#[test]
fn the_distributed_optimizer_refuses_invalid_settings() -> Result<()> {
    use ferrotron_ddp::DistributedOptimizer;
    use ferrotron_tape::{AdamWConfig, SgdConfig};
    run_local(2, |comm| -> Result<()> {
        let comm: Arc<dyn ferrotron_comm_core::Communicator> = Arc::new(comm);
        let config = DdpConfig {
            use_distributed_optimizer: true,
            ..DdpConfig::default()
        };
        let w = Parameter::new("w", Tensor::ones(&[4]));
        let ddp = DistributedDataParallel::new(vec![w], comm, config)?;
        let betas = AdamWConfig {
            betas: (0.9, 1.0),
            ..AdamWConfig::default()
        };
        let error = DistributedOptimizer::adamw([&ddp], betas)
            .map(drop)
            .unwrap_err();
        assert!(error.to_string().contains("second beta"), "{error}");
        let sgd = SgdConfig::new(-0.1);
        let error = DistributedOptimizer::sgd([&ddp], sgd)
            .map(drop)
            .unwrap_err();
        assert!(error.to_string().contains("learning rate"), "{error}");
        Ok(())
    })?;
    Ok(())
}
