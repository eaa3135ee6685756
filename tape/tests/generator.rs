//! A generator's state round-trips exactly, and malformed states are typed errors.

use ferrotron_tape::{Error, Generator};

#[test]
fn generator_rebuilt_from_its_state_draws_the_same() -> ferrotron_tape::Result<()> {
    let mut original = Generator::new(42);
    // An odd number of normals: nothing may be left over between calls.
    for _ in 0..3 {
        original.normal();
    }
    let words = original.state();
    assert_eq!(words.len(), Generator::STATE_WORDS);
    let mut resumed = Generator::from_state(&words)?;
    assert_eq!(resumed, original);
    for _ in 0..5 {
        assert_eq!(resumed.normal().to_bits(), original.normal().to_bits());
        assert_eq!(resumed.next_u64(), original.next_u64());
    }
    Ok(())
}

#[test]
fn malformed_generator_states_are_rejected() {
    for (words, mention) in [
        (vec![1, 2, 3], "expected 4 state words, got 3"),
        (vec![1; 5], "expected 4 state words, got 5"),
        (vec![0; 4], "all-zero"),
    ] {
        match Generator::from_state(&words) {
            Err(error @ Error::InvalidArgument { .. }) => {
                assert!(error.to_string().contains(mention), "{error}")
            }
            other => panic!("{words:?}: expected InvalidArgument, got {other:?}"),
        }
    }
}
