//! The timeout environment variable (its own binary: it changes the process environment).

use ferrotron_comm_core::{local::TIMEOUT_ENV, Error, LocalLauncher};

#[test]
fn invalid_and_valid_timeout_variables() {
    std::env::set_var(TIMEOUT_ENV, "soon");
    match LocalLauncher::new(2) {
        Err(Error::Config(msg)) => assert!(msg.contains("FERROTRON_TIMEOUT_SECS"), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
    std::env::set_var(TIMEOUT_ENV, "0.25");
    let launcher = LocalLauncher::new(2).unwrap();
    let timeouts = launcher.run(|comm| Ok::<_, Error>(comm.timeout())).unwrap();
    assert_eq!(timeouts[0], std::time::Duration::from_millis(250));
    std::env::remove_var(TIMEOUT_ENV);
}
