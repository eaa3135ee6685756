//! The RNG tracker's streams: the default stream is shared by tensor-parallel ranks, the
//! model-parallel stream is seeded `seed + 2718 + tp_rank`, as Megatron-Core's.

use ferrotron_layers::{
    MasterInit, RngState, RngStreamState, RngTracker, DEFAULT_STREAM, MODEL_PARALLEL_STREAM,
};
use ferrotron_tape::Generator;

#[test]
fn streams_follow_megatron_seeding() -> ferrotron_layers::Result<()> {
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
fn named_streams_are_unique() -> ferrotron_layers::Result<()> {
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
fn seeds_are_unique_across_streams() -> ferrotron_layers::Result<()> {
    let mut tracker = RngTracker::new(1, 3);
    tracker.add("expert", 77)?;
    for (seed, owner) in [
        (1, DEFAULT_STREAM),
        (1 + 2718 + 3, MODEL_PARALLEL_STREAM),
        (77, "expert"),
    ] {
        match tracker.add("other", seed) {
            Err(ferrotron_layers::Error::DuplicateSeed {
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

/// Some draws of every kind from every stream, as bits so that equality is exact.
fn draws(tracker: &mut RngTracker) -> ferrotron_layers::Result<Vec<u64>> {
    let mut out = Vec::new();
    for name in [DEFAULT_STREAM, MODEL_PARALLEL_STREAM, "expert"] {
        let stream = tracker.stream(name)?;
        out.push(stream.next_u64());
        out.push(stream.uniform().to_bits());
        out.push(stream.normal().to_bits());
        out.push(stream.normal().to_bits());
    }
    Ok(out)
}

fn tracker_with_expert(tp_rank: usize) -> ferrotron_layers::Result<RngTracker> {
    let mut tracker = RngTracker::new(1234, tp_rank);
    tracker.add("expert", 5)?;
    Ok(tracker)
}

#[test]
fn restored_state_continues_with_identical_draws() -> ferrotron_layers::Result<()> {
    let mut original = tracker_with_expert(1)?;
    draws(&mut original)?;
    let saved = original.state();
    assert_eq!(
        saved
            .streams
            .iter()
            .map(|s| (s.name.as_str(), s.seed, s.words.len()))
            .collect::<Vec<_>>(),
        [
            (DEFAULT_STREAM, 1234, 4),
            (MODEL_PARALLEL_STREAM, 1234 + 2718 + 1, 4),
            ("expert", 5, 4)
        ]
    );
    let want = draws(&mut original)?;

    let mut resumed = tracker_with_expert(1)?;
    let fresh = draws(&mut resumed.clone())?;
    assert_ne!(fresh, want, "a fresh tracker draws something else");
    resumed.restore(&saved)?;
    assert_eq!(draws(&mut resumed)?, want);
    assert_eq!(resumed.state(), original.state());
    Ok(())
}

#[test]
fn restore_rejects_states_of_other_streams_and_leaves_the_tracker_alone(
) -> ferrotron_layers::Result<()> {
    let saved = tracker_with_expert(0)?.state();
    let mut missing = saved.clone();
    missing.streams.pop();
    let mut extra = saved.clone();
    extra.streams.push(RngStreamState {
        name: "unknown".into(),
        seed: 9,
        words: vec![1, 2, 3, 4],
    });
    let mut doubled = saved.clone();
    doubled.streams.push(saved.streams[2].clone());
    let mut short = saved.clone();
    short.streams[1].words.pop();
    let mut zeros = saved.clone();
    zeros.streams[0].words = vec![0; 4];
    let cases: [(&str, &RngState, &str); 6] = [
        ("missing", &missing, "lacks this tracker's stream 'expert'"),
        ("extra", &extra, "stream 'unknown' that this tracker lacks"),
        ("doubled", &doubled, "'expert' appears twice"),
        ("short", &short, "expected 4 state words, got 3"),
        ("zeros", &zeros, "all-zero"),
        (
            "other rank",
            &tracker_with_expert(1)?.state(),
            "seeded 3952 here but 3953",
        ),
    ];
    for (what, state, mention) in cases {
        let mut tracker = tracker_with_expert(0)?;
        draws(&mut tracker)?;
        let before = tracker.state();
        match tracker.restore(state) {
            Err(error @ ferrotron_layers::Error::RngStateMismatch { .. }) => {
                let text = error.to_string();
                assert!(text.contains(mention), "{what}: {text}");
            }
            other => panic!("{what}: expected RngStateMismatch, got {other:?}"),
        }
        assert_eq!(tracker.state(), before, "{what}: the tracker changed");
    }
    // A tracker that lacks the added stream refuses the state that has it.
    assert!(matches!(
        RngTracker::new(1234, 0).restore(&saved),
        Err(ferrotron_layers::Error::RngStateMismatch { .. })
    ));
    Ok(())
}

#[test]
fn master_weights_depend_on_name_and_seed_only() -> ferrotron_layers::Result<()> {
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

/// Megatron's `_set_random_seed`: pipeline stage `s` seeds its tracker from
/// `seed + 100 · s`; stage 0 is the plain tracker. Stages draw apart; within a stage the
/// tensor-parallel ranks share the default stream and not the model-parallel one.
#[test]
fn pipeline_stages_are_seeded_100_apart() {
    assert_eq!(ferrotron_layers::PIPELINE_SEED_STRIDE, 100);
    let state = |tracker: &RngTracker| tracker.state();
    assert_eq!(
        state(&RngTracker::for_pipeline_stage(1234, 1, 0)),
        state(&RngTracker::new(1234, 1))
    );
    for stage in 1..4 {
        let mut tp0 = RngTracker::for_pipeline_stage(1234, 0, stage);
        let mut tp1 = RngTracker::for_pipeline_stage(1234, 1, stage);
        let seed = 1234 + 100 * stage as u64;
        assert_eq!(*tp0.default_stream(), Generator::new(seed));
        assert_eq!(
            *tp1.model_parallel_stream(),
            Generator::new(seed + 2718 + 1)
        );
        assert_eq!(*tp0.default_stream(), *tp1.default_stream());
        assert_ne!(
            tp0.model_parallel_stream().next_u64(),
            tp1.model_parallel_stream().next_u64()
        );
        let mut first = RngTracker::for_pipeline_stage(1234, 0, 0);
        assert_ne!(
            first.default_stream().next_u64(),
            tp0.default_stream().next_u64(),
            "stage {stage}"
        );
    }
}
