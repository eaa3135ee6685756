//! Construction: shapes are compared across DP ranks (every mismatch listed by rank) and
//! DP rank 0's values are broadcast.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator, LocalLauncher};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, Error, ShapeMismatch};
use ferrotron_tape::{Parameter, Tensor};

#[test]
fn shape_mismatches_are_listed_per_rank_on_every_rank() -> Result<()> {
    let outcomes = LocalLauncher::new(3)?.run_each(|comm| -> ferrotron_ddp::Result<()> {
        let mut params = vec![
            Parameter::new(
                "w",
                Tensor::ones(if comm.rank() == 1 { &[3, 2] } else { &[2, 3] }),
            ),
            Parameter::new("b", Tensor::ones(&[3])),
        ];
        if comm.rank() == 2 {
            params.push(Parameter::new("extra", Tensor::ones(&[1])));
        }
        DistributedDataParallel::new(params, Arc::new(comm), DdpConfig::default()).map(|_| ())
    });
    for outcome in outcomes {
        let (_, error) = outcome.expect_err("every rank fails");
        let ferrotron_comm_core::Error::RankFailed { source, .. } = error else {
            panic!("expected RankFailed, got {error}");
        };
        let message = source.to_string();
        let error = source.downcast::<Error>().expect("a ddp error");
        let Error::ShapeMismatch { mismatches, .. } = *error else {
            panic!("expected ShapeMismatch, got {message}");
        };
        assert_eq!(
            mismatches,
            vec![
                ShapeMismatch {
                    rank: 1,
                    index: Some(0),
                    name: Some("w".into()),
                    expected: vec![2, 3],
                    found: vec![3, 2],
                },
                ShapeMismatch {
                    rank: 2,
                    index: None,
                    name: None,
                    expected: vec![2],
                    found: vec![3],
                },
            ]
        );
        assert!(
            message.contains("rank 1: parameter #0 ('w') has shape [3, 2], rank 0 has [2, 3]"),
            "{message}"
        );
        assert!(
            message.contains("rank 2: 3 parameters, rank 0 has 2"),
            "{message}"
        );
    }
    Ok(())
}

#[test]
fn parameters_start_from_dp_rank_0() -> Result<()> {
    let values = run_local(4, |comm| -> Result<Vec<Vec<f32>>> {
        let r = comm.rank() as f32;
        let params = vec![
            Parameter::new("w", Tensor::full(&[2, 2], r)),
            Parameter::new("b", Tensor::full(&[3], 10.0 + r)),
        ];
        let config = DdpConfig {
            first_bucket_bytes: 4,
            bucket_cap_bytes: 4,
            ..DdpConfig::default()
        };
        DistributedDataParallel::new(params.clone(), Arc::new(comm), config)?;
        Ok(params
            .iter()
            .map(|p| p.value()?.to_vec())
            .collect::<ferrotron_tape::Result<_>>()?)
    })?;
    assert_eq!(values, vec![vec![vec![0.0; 4], vec![10.0; 3]]; 4]);
    Ok(())
}
