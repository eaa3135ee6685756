//! The flight recorder's environment variable (its own binary: it changes the process
//! environment).

use ferrotron_comm_core::flight_recorder::FLIGHT_RECORDER_ENV;
use ferrotron_comm_core::{CommunicatorExt, Error, LocalLauncher, ReduceOp};

/// Each rank's own record, after three all-reduces.
fn kept(launcher: LocalLauncher) -> Vec<usize> {
    launcher
        .run(|comm| {
            for _ in 0..3 {
                comm.all_reduce_slice(&mut [1u8], ReduceOp::Sum)?;
            }
            let record = comm.flight_record();
            Ok::<_, Error>(record.ranks.iter().map(|r| r.calls.len()).sum::<usize>())
        })
        .unwrap()
}

#[test]
fn the_variable_sets_how_many_calls_each_rank_keeps() {
    std::env::set_var(FLIGHT_RECORDER_ENV, "many");
    match LocalLauncher::new(2) {
        Err(Error::Config(msg)) => assert!(msg.contains(FLIGHT_RECORDER_ENV), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
    std::env::set_var(FLIGHT_RECORDER_ENV, "2");
    // Two ranks, each keeping its last two calls.
    assert_eq!(kept(LocalLauncher::new(2).unwrap()), vec![4, 4]);
    // The API overrides the environment.
    assert_eq!(
        kept(LocalLauncher::new(2).unwrap().flight_recorder(1)),
        vec![2, 2]
    );
    std::env::set_var(FLIGHT_RECORDER_ENV, "0");
    assert_eq!(kept(LocalLauncher::new(2).unwrap()), vec![0, 0]);
    std::env::remove_var(FLIGHT_RECORDER_ENV);
    assert_eq!(kept(LocalLauncher::new(2).unwrap()), vec![6, 6]);
}
