//! The RNG tracker's streams: the default stream is shared by tensor-parallel ranks, the
//! model-parallel stream is seeded `seed + 2718 + tp_rank`, as Megatron-Core's.

use layers::{MasterInit, RngTracker, DEFAULT_STREAM, MODEL_PARALLEL_STREAM};
use tape::Generator;

#[test]
fn streams_follow_megatron_seeding() -> layers::Result<()> {
    let mut rank0 = RngTracker::new(1234, 0);
    let mut rank1 = RngTracker::new(1234, 1);
    assert_eq!(
        rank0.default_stream().next_u64(),
        rank1.default_stream().next_u64()
    );
    assert_eq!(
        *rank1.model_parallel_stream(),
        Generator::new(1234 + 2718 + 1)
    );
    assert_ne!(
        rank0.model_parallel_stream().next_u64(),
        rank1.model_parallel_stream().next_u64()
    );
    assert_eq!(*rank0.for_activations(false), *rank1.for_activations(false));
    assert_eq!(
        rank0.stream(MODEL_PARALLEL_STREAM)?.clone(),
        *rank0.model_parallel_stream()
    );
    Ok(())
}

#[test]
fn named_streams_are_unique() -> layers::Result<()> {
    let mut tracker = RngTracker::new(1, 0);
    tracker.add("expert", 77)?;
    assert_eq!(*tracker.stream("expert")?, Generator::new(77));
    assert!(tracker.add("expert", 78).is_err());
    assert!(tracker.add(MODEL_PARALLEL_STREAM, 78).is_err());
    assert!(tracker.stream("missing").is_err());
    Ok(())
}

/// Megatron's `test_cuda_rng_states_tracker`: a seed already in use is rejected, whether
/// the default stream, this rank's model-parallel stream or an added stream holds it.
#[test]
fn seeds_are_unique_across_streams() -> layers::Result<()> {
    let mut tracker = RngTracker::new(1, 3);
    tracker.add("expert", 77)?;
    for (seed, owner) in [
        (1, DEFAULT_STREAM),
        (1 + 2718 + 3, MODEL_PARALLEL_STREAM),
        (77, "expert"),
    ] {
        match tracker.add("other", seed) {
            Err(layers::Error::DuplicateSeed {
                seed: got, stream, ..
            }) => assert_eq!((got, stream.as_str()), (seed, owner)),
            other => panic!("seed {seed}: expected DuplicateSeed, got {other:?}"),
        }
    }
    // The failed attempts added nothing: the name is still free, with a fresh seed.
    tracker.add("other", 78)?;
    assert_eq!(*tracker.stream("other")?, Generator::new(78));
    // Rank 0's model-parallel seed is free on rank 3.
    tracker.add("rank0-seed", 1 + 2718)?;
    Ok(())
}

#[test]
fn master_weights_depend_on_name_and_seed_only() -> layers::Result<()> {
    let init = MasterInit::new(5, 1.0);
    assert_eq!(
        init.weight("a", &[2, 3]).to_vec()?,
        init.weight("a", &[2, 3]).to_vec()?
    );
    assert_ne!(
        init.weight("a", &[2, 3]).to_vec()?,
        init.weight("b", &[2, 3]).to_vec()?
    );
    assert_eq!(init.bias("a", &[2], 1.0)?.to_vec()?, vec![1.0, 1.0]);
    Ok(())
}
