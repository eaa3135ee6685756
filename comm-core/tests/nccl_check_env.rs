//! The NCCL signature check's environment variable (its own binary: it changes the
//! process environment). Its value is read before any library is needed, so this runs
//! without a GPU: a bad value is an error on every rank, promptly.
#![cfg(feature = "cuda")]

use ferrotron_comm_core::nccl::CHECK_ENV;
use ferrotron_comm_core::{Error, LocalLauncher, NcclCommunicator};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn a_bad_value_fails_every_rank_before_touching_nccl() {
    assert_eq!(CHECK_ENV, "FERROTRON_NCCL_CHECK");
    std::env::set_var(CHECK_ENV, "detail");
    let errors = LocalLauncher::new(3)
        .unwrap()
        .timeout(Duration::from_secs(20))
        .run(|comm| Ok::<_, Error>(NcclCommunicator::new(Arc::new(comm), 0).err()))
        .unwrap();
    std::env::remove_var(CHECK_ENV);
    for (rank, error) in errors.iter().enumerate() {
        match error {
            Some(Error::Config(message)) => {
                assert!(
                    message.contains("FERROTRON_NCCL_CHECK=\"detail\""),
                    "{message}"
                );
                assert!(message.contains("default 0"), "{message}");
            }
            other => panic!("rank {rank}: expected Config, got {other:?}"),
        }
    }
}
