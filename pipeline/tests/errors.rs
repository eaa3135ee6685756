//! Mistakes are typed errors on every rank they concern, promptly: misshapen or
//! misformatted tensors between stages, bad microbatch counts, chunk lists and failing stages.

use ferrotron_comm_core::{Communicator, Error as CommError, LocalLauncher};
use ferrotron_pipeline::{Error, Pipeline, PipelineConfig, Schedule, Stage};
use ferrotron_tape::{Parameter, Tape, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `x · W` on a `[3, 4]` activation (the first stage makes its input from the
/// microbatch number); the last stage returns the mean as the loss. `distort` changes
/// the first stage's output.
struct Linear {
    weight: Parameter,
    last: bool,
    distort: Option<fn(&Tensor) -> ferrotron_tape::Result<Tensor>>,
    /// The microbatch whose forward fails, if any.
    fail_at: Option<usize>,
}

impl Linear {
    fn new(last: bool) -> Linear {
        Linear {
            weight: Parameter::new("w", Tensor::full(&[4, 4], 0.5)),
            last,
            distort: None,
            fail_at: None,
        }
    }
}

impl Stage for Linear {
    fn forward(
        &mut self,
        tape: &Tape,
        mb: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor, BoxError> {
        if self.fail_at == Some(mb) {
            return Err("this stage's data loader failed".into());
        }
        let x = match input {
            Some(x) => x.clone(),
            None => Tensor::full(&[3, 4], mb as f32),
        };
        let y = x.matmul(&tape.watch(&self.weight)?)?;
        if self.last {
            return Ok(y.mean()?);
        }
        Ok(match self.distort {
            Some(distort) => distort(&y)?,
            None => y,
        })
    }
}

/// Runs a two-stage 1F1B step where `tweak` changes stage 0; returns each rank's error.
fn two_stages(tweak: impl Fn(&mut Linear) + Sync) -> Vec<Error> {
    two_stages_posting(false, tweak)
}

/// [`two_stages`], with receives posted ahead or not.
fn two_stages_posting(overlap_p2p: bool, tweak: impl Fn(&mut Linear) + Sync) -> Vec<Error> {
    LocalLauncher::new(2)
        .unwrap()
        .timeout(Duration::from_secs(60))
        .run_each(|comm| {
            let group: Arc<dyn Communicator> = Arc::new(comm);
            let mut config = PipelineConfig::new(Schedule::OneFOneB, 3, &[3, 4]);
            config.overlap_p2p = overlap_p2p;
            let pipeline = Pipeline::new(group.clone(), config)?;
            let mut stage = Linear::new(group.rank() == 1);
            if group.rank() == 0 {
                tweak(&mut stage);
            }
            pipeline.run(&mut [&mut stage]).map(drop)
        })
        .into_iter()
        .map(|outcome| match outcome {
            Err((_, CommError::RankFailed { source, .. })) => *source.downcast::<Error>().unwrap(),
            other => panic!("expected a failure, got {:?}", other.map(drop)),
        })
        .collect()
}

#[test]
fn a_transposed_activation_is_a_shape_error_on_both_sides() {
    for overlap_p2p in [false, true] {
        let started = Instant::now();
        let errors = two_stages_posting(overlap_p2p, |stage| {
            stage.distort = Some(|y| y.reshape(&[4, 3]))
        });
        assert!(started.elapsed() < Duration::from_secs(10));
        expect_transposed(&errors);
    }
}

fn expect_transposed(errors: &[Error]) {
    let expect = |err: &Error, what: &str| match err {
        Error::Shape {
            stage: _,
            what: w,
            microbatch: 0,
            got,
            expected,
        } => {
            assert_eq!(*w, what);
            assert_eq!(got, &[4, 3]);
            assert_eq!(expected, &[3, 4]);
            assert!(err.to_string().contains("PipelineConfig::shape"), "{err}");
        }
        other => panic!("expected a shape error, got {other}"),
    };
    expect(&errors[0], "activation sent");
    expect(&errors[1], "activation received");
}

#[test]
fn an_activation_of_another_size_or_rank_count_fails_both_sides() {
    // Two rows instead of three: the sender sends a placeholder of the expected size (a
    // device backend does not check sizes), and its header tells the receiver.
    let errors = two_stages(|stage| stage.distort = Some(|y| y.narrow(0, 0, 2)));
    // One dimension instead of two: the header itself does not fit.
    let flat = two_stages(|stage| stage.distort = Some(|y| y.reshape(&[12])));
    for errors in [&errors, &flat] {
        assert!(
            matches!(
                &errors[0],
                Error::Shape {
                    what: "activation sent",
                    ..
                }
            ),
            "{}",
            errors[0]
        );
    }
    assert!(
        matches!(
            &errors[1],
            Error::Shape {
                what: "activation received",
                ..
            }
        ),
        "{}",
        errors[1]
    );
    assert!(
        matches!(&flat[1], Error::Comm(CommError::Mismatch { .. })),
        "{}",
        flat[1]
    );
}

#[test]
fn a_failing_stage_names_itself_and_releases_its_neighbour() {
    let started = Instant::now();
    let errors = two_stages(|stage| stage.fail_at = Some(0));
    assert!(started.elapsed() < Duration::from_secs(10));
    expect_stage_failure(&errors, 0);
}

/// With receives posted ahead, a failing stage gives up the receives it posted rather
/// than wait for them: under GPipe, a stage failing in its last forward has posted the
/// receive of its first gradient, which the stages after it can never send.
#[test]
fn a_failing_stage_abandons_the_receives_it_posted_ahead() {
    for failing in 0..3 {
        let started = Instant::now();
        let outcomes = LocalLauncher::new(4)
            .unwrap()
            .timeout(Duration::from_secs(60))
            .run_each(|comm| {
                let group: Arc<dyn Communicator> = Arc::new(comm);
                let mut config = PipelineConfig::new(Schedule::GPipe, 4, &[3, 4]);
                config.overlap_p2p = true;
                let pipeline = Pipeline::new(group.clone(), config)?;
                let mut stage = Linear::new(group.rank() == 3);
                if group.rank() == failing {
                    stage.fail_at = Some(3);
                }
                pipeline.run(&mut [&mut stage]).map(drop)
            });
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "stage {failing}"
        );
        match &outcomes[failing] {
            Err((_, CommError::RankFailed { source, .. })) => assert!(
                source.to_string().contains("data loader"),
                "stage {failing}: {source}"
            ),
            other => panic!(
                "stage {failing}: expected its error, got {:?}",
                other.as_ref().map(drop)
            ),
        }
    }
}

fn expect_stage_failure(errors: &[Error], failing: usize) {
    match &errors[0] {
        Error::Stage {
            stage: 0,
            microbatch,
            source,
        } if *microbatch == failing => {
            assert!(source.to_string().contains("data loader"))
        }
        other => panic!("expected the stage's error at microbatch {failing}, got {other}"),
    }
    assert!(
        matches!(&errors[1], Error::Comm(CommError::PeerLost { rank: 0, .. })),
        "{}",
        errors[1]
    );
}

#[test]
fn bad_microbatch_counts_and_chunk_lists_are_configuration_errors() {
    let outcomes = LocalLauncher::new(4).unwrap().run_each(|comm| {
        let group: Arc<dyn Communicator> = Arc::new(comm);
        let interleaved = Schedule::Interleaved { virtual_stages: 2 };
        let err = Pipeline::new(group.clone(), PipelineConfig::new(interleaved, 6, &[1]))
            .err()
            .expect("6 microbatches over 4 stages");
        assert!(err.to_string().contains("use 4 or 8"), "{err}");
        let pipeline = Pipeline::new(group, PipelineConfig::new(interleaved, 4, &[1]))?;
        let mut one = Linear::new(false);
        let err = pipeline.run(&mut [&mut one]).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        assert!(
            err.to_string().contains("2 model chunk(s) per rank, but 1"),
            "{err}"
        );
        Ok::<_, Error>(())
    });
    assert!(outcomes.iter().all(Result::is_ok));
}

#[test]
fn an_activation_in_another_format_fails_both_sides() {
    let errors =
        two_stages(|stage| stage.distort = Some(|y| y.to_dtype(ferrotron_tape::DType::BF16)));
    match &errors[0] {
        Error::Format {
            what: "activation sent",
            got,
            expected: ferrotron_tape::DType::F32,
            ..
        } if got == "bf16" => {
            assert!(errors[0].to_string().contains("PipelineConfig::dtype"));
        }
        other => panic!("expected a format error, got {other}"),
    }
    // A placeholder in the expected format travels; the header names the wrong one.
    assert!(
        matches!(
            &errors[1],
            Error::Format {
                what: "activation received",
                ..
            }
        ),
        "{}",
        errors[1]
    );
}

#[test]
fn activations_travel_only_as_f32_bf16_or_f16() {
    ferrotron_comm_core::run_local(1, |comm| -> Result<(), BoxError> {
        let mut config = PipelineConfig::new(Schedule::OneFOneB, 1, &[3, 4]);
        config.dtype = ferrotron_tape::DType::F64;
        let err = Pipeline::new(Arc::new(comm), config)
            .err()
            .expect("refused");
        assert!(err.to_string().contains("f32, bf16 or f16"), "{err}");
        Ok(())
    })
    .unwrap();
}
