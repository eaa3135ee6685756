//! The pipeline's errors.

/// What can go wrong in a pipeline step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bad schedule, microbatch count, layer split or stage list.
    #[error("pipeline configuration: {0}")]
    Config(String),
    /// A stage produced, or its neighbour sent, an activation or gradient whose shape is
    /// not the step's fixed shape.
    #[error(
        "pipeline stage {stage}: the {what} of microbatch {microbatch} has shape {got:?}, \
         but this step exchanges {expected:?}; every stage boundary of a step carries the \
         configured shape (`PipelineConfig::shape`)"
    )]
    Shape {
        /// The virtual stage that noticed.
        stage: usize,
        /// `"activation sent"`, `"activation received"`, ...
        what: &'static str,
        /// The microbatch.
        microbatch: usize,
        /// The shape it had.
        got: Vec<i64>,
        /// The configured shape.
        expected: Vec<usize>,
    },
    /// An activation or gradient between stages is not in the format the pipeline
    /// carries (see `PipelineConfig::dtype`).
    #[error(
        "pipeline stage {stage}, microbatch {microbatch}: the {what} is {got}, the pipeline \
         carries {expected}; set PipelineConfig::dtype to the activations' storage format \
         on every rank"
    )]
    Format {
        /// The virtual stage that noticed.
        stage: usize,
        /// `"activation sent"`, `"gradient received"`, ...
        what: &'static str,
        /// The microbatch.
        microbatch: usize,
        /// The format it had.
        got: String,
        /// The configured format.
        expected: ferrotron_comm_core::DType,
    },
    /// The user's stage failed.
    #[error("pipeline stage {stage}, microbatch {microbatch}: {source}")]
    Stage {
        /// The virtual stage.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// The stage's own error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A transfer between stages failed.
    #[error(transparent)]
    Comm(#[from] ferrotron_comm_core::Error),
    /// The autograd tape failed.
    #[error(transparent)]
    Tape(#[from] ferrotron_tape::Error),
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;
