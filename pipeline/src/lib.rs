//! Pipeline parallelism for ferrotron: Megatron-Core's `pipeline_parallel` schedules over
//! any [`Communicator`](ferrotron_comm_core::Communicator).
//!
//! A model is cut into stages, one per rank of the pipeline group (or, interleaved,
//! several chunks per rank). Each step splits the batch into microbatches and drives them
//! through the stages under a [`Schedule`]: [GPipe](Schedule::GPipe),
//! [1F1B](Schedule::OneFOneB) or [interleaved 1F1B](Schedule::Interleaved). Activations go
//! forward and their gradients backward in batched exchanges
//! ([`Communicator::exchange`](ferrotron_comm_core::Communicator::exchange)), so neighbours never
//! deadlock; each transfer carries a small header, so a misshapen tensor is a typed error
//! on both sides instead of a misread. The last stage returns each microbatch's loss and
//! the step's gradients are the mean over microbatches, as one big batch would give.
//!
//! * [`Stage`]: what a rank runs for one chunk (its layers' forward);
//! * [`Pipeline`]: plans and runs a step, reports losses, peak activations in flight and,
//!   on request, a timeline ([`chrome_trace`]);
//! * [`Schedule::plan`]: the plan itself, pure data, with the theory's bubble fraction.
//!
//! # Two stages compute what one model computes
//! A two-layer model `loss = mean((tanh(x·W₁)·W₂)²)` split over two rank threads, four
//! microbatches, 1F1B; the gradients equal the serial model's:
//! ```
//! use ferrotron_comm_core::{run_local, Communicator};
//! use ferrotron_pipeline::{Pipeline, PipelineConfig, Schedule, Stage};
//! use std::sync::Arc;
//! use ferrotron_tape::{Generator, Parameter, Tape, Tensor};
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//! let mut rng = Generator::new(1);
//! let data = Tensor::randn(&[4, 3, 5], 1.0, &mut rng); // 4 microbatches of [3, 5]
//! let w1 = Tensor::randn(&[5, 5], 0.5, &mut rng);
//! let w2 = Tensor::randn(&[5, 5], 0.5, &mut rng);
//!
//! struct First { data: Tensor, w: Parameter }
//! impl Stage for First {
//!     fn forward(&mut self, tape: &Tape, mb: usize, _: Option<&Tensor>) -> Result<Tensor, BoxError> {
//!         let x = self.data.narrow(0, mb, 1)?.reshape(&[3, 5])?;
//!         Ok(x.matmul(&tape.watch(&self.w)?)?.tanh()?)
//!     }
//! }
//! struct Last { w: Parameter }
//! impl Stage for Last {
//!     fn forward(&mut self, tape: &Tape, _: usize, x: Option<&Tensor>) -> Result<Tensor, BoxError> {
//!         let y = x.unwrap().matmul(&tape.watch(&self.w)?)?;
//!         Ok(y.mul(&y)?.mean()?)
//!     }
//! }
//!
//! let grads = run_local(2, |comm| -> Result<Vec<f32>, BoxError> {
//!     let group: Arc<dyn Communicator> = Arc::new(comm);
//!     let config = PipelineConfig::new(Schedule::OneFOneB, 4, &[3, 5]);
//!     let pipeline = Pipeline::new(group.clone(), config)?;
//!     if group.rank() == 0 {
//!         let mut stage = First { data: data.clone(), w: Parameter::new("w1", w1.clone()) };
//!         pipeline.run(&mut [&mut stage])?;
//!         Ok(stage.w.grad().unwrap().to_vec()?)
//!     } else {
//!         let mut stage = Last { w: Parameter::new("w2", w2.clone()) };
//!         let report = pipeline.run(&mut [&mut stage])?;
//!         assert_eq!(report.losses.len(), 4);
//!         Ok(stage.w.grad().unwrap().to_vec()?)
//!     }
//! })?;
//!
//! // The serial model over the whole batch.
//! let (p1, p2) = (Parameter::new("w1", w1), Parameter::new("w2", w2));
//! let tape = Tape::new();
//! let x = data.reshape(&[4, 3, 5])?;
//! let y = x.matmul(&tape.watch(&p1)?)?.tanh()?.matmul(&tape.watch(&p2)?)?;
//! y.mul(&y)?.mean()?.backward()?;
//! for (serial, piped) in [(p1, &grads[0]), (p2, &grads[1])] {
//!     for (a, b) in serial.grad().unwrap().to_vec()?.iter().zip(piped) {
//!         assert!((a - b).abs() < 1e-5, "{a} vs {b}");
//!     }
//! }
//! # Ok::<(), BoxError>(())
//! ```
//!
//! # Cargo features
//! None is on by default.
//! * `mpi`: the MPI test binary (enables `ferrotron-comm-core/mpi`).

#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod driver;
mod error;
pub mod schedule;
mod trace;

pub use driver::{Pipeline, PipelineConfig, Stage, StepReport};
pub use error::{Error, Result};
pub use schedule::{Action, Schedule, Transfer};
pub use trace::{chrome_trace, chrome_trace_with_streams, Span};
