//! Bad dims, sizes and shapes are typed errors on every rank, never hangs or panics: a
//! rank that rejects its own arguments makes its peers fail with `PeerRejected`, and
//! disagreements found in exchanged data fail everywhere with the same error.

mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator, LocalLauncher};
use ferrotron_mappings::{
    all_gather_variable, all_to_all, gather_from_region, reduce_from_region,
    reduce_scatter_to_region, scatter_to_region, split_sizes, Error,
};
use ferrotron_tape::{Parameter, Tape, Tensor};
use support::Group;

/// A short name for each error, comparable across ranks.
fn kind(result: ferrotron_mappings::Result<Tensor<f64>>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(Error::DimOutOfRange { .. }) => "dim",
        Err(Error::TooShortToSplit { .. }) => "too short",
        Err(Error::InvalidSizes { .. }) => "sizes",
        Err(Error::ShapeMismatch { .. }) => "shapes",
        Err(Error::PeerRejected { .. }) => "peer",
        Err(Error::Comm(ferrotron_comm_core::Error::Mismatch { .. })) => "comm mismatch",
        Err(_) => "other",
    }
}

/// Runs `f` on `n` ranks and returns each rank's error kind.
fn kinds(
    n: usize,
    f: impl Fn(usize, &Group) -> ferrotron_mappings::Result<Tensor<f64>> + Sync,
) -> Result<Vec<&'static str>> {
    Ok(run_local(n, |comm| -> Result<&'static str> {
        let rank = comm.rank();
        let group: Group = Arc::new(comm);
        Ok(kind(f(rank, &group)))
    })?)
}

fn zeros(shape: &[usize]) -> Tensor<f64> {
    Tensor::zeros(shape)
}

#[test]
fn a_dim_out_of_range_everywhere_fails_everywhere() -> Result<()> {
    let got = kinds(3, |_, g| gather_from_region(&zeros(&[2]), g, 1, None))?;
    assert_eq!(got, vec!["dim"; 3]);
    let got = kinds(3, |_, g| reduce_scatter_to_region(&zeros(&[3]), g, 2, None))?;
    assert_eq!(got, vec!["dim"; 3]);
    Ok(())
}

#[test]
fn a_rank_that_rejects_its_arguments_stops_its_peers() -> Result<()> {
    // Rank 1 passes a 1-d tensor where the others pass 2-d ones.
    let got = kinds(3, |rank, g| {
        let x = if rank == 1 {
            zeros(&[2])
        } else {
            zeros(&[2, 2])
        };
        gather_from_region(&x, g, 1, None)
    })?;
    assert_eq!(got, vec!["peer", "dim", "peer"]);
    // Rank 0's sizes do not match its tensor.
    let got = kinds(2, |rank, g| {
        let x = zeros(&[2 + rank, 3]);
        gather_from_region(&x, g, 0, Some(&[3, 3]))
    })?;
    assert_eq!(got, vec!["sizes", "peer"]);
    // After a rejection the group still works.
    let got = kinds(2, |rank, g| {
        let first = all_to_all(&zeros(&[1 + rank]), g, 0, 0, None);
        assert!(first.is_err());
        reduce_from_region(&zeros(&[2]), g)
    })?;
    assert_eq!(got, vec!["ok"; 2]);
    Ok(())
}

#[test]
fn disagreeing_shapes_or_dims_fail_on_every_rank() -> Result<()> {
    // Shapes differ outside the gathered dimension.
    let got = kinds(3, |rank, g| {
        gather_from_region(&zeros(&[2, 1 + rank]), g, 0, None)
    })?;
    assert_eq!(got, vec!["shapes"; 3]);
    // Ranks gather along different dimensions.
    let got = kinds(2, |rank, g| {
        all_gather_variable(&zeros(&[2, 2]), g, rank, None, false).map(|r| r.0)
    })?;
    assert_eq!(got, vec!["shapes"; 2]);
    // Different ranks of tensors: the exchanged headers differ in length.
    let got = kinds(2, |rank, g| {
        let x = if rank == 0 {
            zeros(&[2])
        } else {
            zeros(&[2, 1])
        };
        gather_from_region(&x, g, 0, None)
    })?;
    assert_eq!(got, vec!["comm mismatch"; 2]);
    // all_to_all across two dims needs the same splits on every rank.
    let got = kinds(2, |rank, g| {
        let splits = if rank == 0 { [1, 2] } else { [2, 1] };
        all_to_all(&zeros(&[3, 2]), g, 0, 1, Some(&splits))
    })?;
    assert_eq!(got, vec!["shapes"; 2]);
    Ok(())
}

#[test]
fn mismatched_element_counts_are_caught_by_comm_core() -> Result<()> {
    let got = kinds(3, |rank, g| reduce_from_region(&zeros(&[2 + rank % 2]), g))?;
    assert_eq!(got, vec!["comm mismatch"; 3]);
    // Explicit sizes that differ by rank give different counts.
    let got = kinds(2, |rank, g| {
        let sizes = if rank == 0 { [2, 1] } else { [2, 3] };
        gather_from_region(&zeros(&[sizes[rank]]), g, 0, Some(&sizes))
    })?;
    assert_eq!(got, vec!["comm mismatch"; 2]);
    Ok(())
}

#[test]
fn splitting_needs_one_element_per_rank() -> Result<()> {
    assert!(matches!(
        split_sizes(3, 4),
        Err(Error::TooShortToSplit {
            len: 3,
            parts: 4,
            ..
        })
    ));
    let got = kinds(4, |_, g| scatter_to_region(&zeros(&[3]), g, 0, None))?;
    assert_eq!(got, vec!["too short"; 4]);
    let got = kinds(4, |_, g| {
        reduce_scatter_to_region(&zeros(&[3, 2]), g, 0, None)
    })?;
    assert_eq!(got, vec!["too short"; 4]);
    // Explicit sizes may leave a rank empty, but must cover the dimension.
    let got = kinds(4, |_, g| {
        scatter_to_region(&zeros(&[3]), g, 0, Some(&[1, 1, 1, 0]))
    })?;
    assert_eq!(got, vec!["ok"; 4]);
    let got = kinds(4, |_, g| {
        scatter_to_region(&zeros(&[3]), g, 0, Some(&[1, 1, 1]))
    })?;
    assert_eq!(got, vec!["sizes"; 4]);
    let got = kinds(2, |_, g| {
        reduce_scatter_to_region(&zeros(&[3]), g, 0, Some(&[1, 1]))
    })?;
    assert_eq!(got, vec!["sizes"; 2]);
    Ok(())
}

#[test]
fn a_group_of_one_checks_arguments_without_communicating() -> Result<()> {
    let got = kinds(1, |_, g| gather_from_region(&zeros(&[2]), g, 1, None))?;
    assert_eq!(got, vec!["dim"]);
    let got = kinds(1, |_, g| scatter_to_region(&zeros(&[2]), g, 0, Some(&[2])))?;
    assert_eq!(got, vec!["ok"]);
    Ok(())
}

/// A backward collective whose peer never comes fails as a tape error whose source is
/// this crate's error, instead of hanging.
#[test]
fn backward_errors_come_out_of_backward() -> Result<()> {
    let errors = LocalLauncher::new(2)?.timeout(Duration::from_secs(5)).run(
        |comm| -> Result<Option<String>> {
            let rank = comm.rank();
            let group: Group = Arc::new(comm);
            let x = Parameter::new("x", Tensor::<f64>::ones(&[2]));
            let tape = Tape::new();
            let y = ferrotron_mappings::copy_to_region(&tape.watch(&x)?, &group)?;
            if rank == 0 {
                // Rank 0 leaves without running backward (and drops its communicator).
                return Ok(None);
            }
            let error = y.sum()?.backward().err();
            Ok(error.map(|e| match e {
                ferrotron_tape::Error::Custom { op, source } => {
                    let ours = source
                        .downcast_ref::<Error>()
                        .map(|e| matches!(e, Error::Comm(_)));
                    format!("{op} {ours:?}")
                }
                other => format!("unexpected {other}"),
            }))
        },
    )?;
    assert_eq!(
        errors,
        vec![None, Some("copy_to_region Some(true)".to_string())]
    );
    Ok(())
}

#[test]
fn ranks_that_differ_only_in_the_gather_dim_fail_everywhere() -> Result<()> {
    let got = kinds(2, |rank, g| all_to_all(&zeros(&[2, 2]), g, 0, rank, None))?;
    assert_eq!(got, vec!["shapes"; 2]);
    let got = kinds(2, |rank, g| all_to_all(&zeros(&[2, 2]), g, rank, 1, None))?;
    assert_eq!(got, vec!["shapes"; 2]);
    Ok(())
}

#[test]
fn a_peer_rejection_names_exactly_the_ranks_that_rejected() -> Result<()> {
    let named = run_local(4, |comm| -> Result<Option<Vec<usize>>> {
        let rank = comm.rank();
        let group: Group = Arc::new(comm);
        // Ranks 1 and 2 pass 1-d tensors where the others pass 2-d ones.
        let x = if rank == 1 || rank == 2 {
            zeros(&[2])
        } else {
            zeros(&[2, 2])
        };
        Ok(match gather_from_region(&x, &group, 1, None) {
            Err(Error::PeerRejected { ranks, .. }) => Some(ranks),
            _ => None,
        })
    })?;
    assert_eq!(named, vec![Some(vec![1, 2]), None, None, Some(vec![1, 2])]);
    Ok(())
}
