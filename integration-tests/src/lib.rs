//! Cross-crate tests live in `tests/`. This library also compiles and runs every Rust
//! example in the mdBook (`docs/src`) as a doctest, so the book cannot rot.

#[doc = include_str!("../../docs/src/getting-started.md")]
pub mod book_getting_started {}

#[doc = include_str!("../../ARCHITECTURE.md")]
pub mod book_architecture {}

#[doc = include_str!("../../docs/src/device.md")]
pub mod book_device {}

#[doc = include_str!("../../docs/src/comm-core.md")]
pub mod book_comm_core {}

#[doc = include_str!("../../docs/src/parallel-state.md")]
pub mod book_parallel_state {}

#[doc = include_str!("../../docs/src/tape.md")]
pub mod book_tape {}

#[doc = include_str!("../../docs/src/mappings.md")]
pub mod book_mappings {}

#[doc = include_str!("../../docs/src/layers.md")]
pub mod book_layers {}

#[doc = include_str!("../../docs/src/ddp.md")]
pub mod book_ddp {}

#[doc = include_str!("../../docs/src/pipeline.md")]
pub mod book_pipeline {}

#[doc = include_str!("../../docs/src/planner.md")]
pub mod book_planner {}

#[doc = include_str!("../../docs/src/data.md")]
pub mod book_data {}

#[doc = include_str!("../../docs/src/launching.md")]
pub mod book_launching {}

#[doc = include_str!("../../docs/src/correctness.md")]
pub mod book_correctness {}

#[doc = include_str!("../../docs/src/troubleshooting.md")]
pub mod book_troubleshooting {}

#[doc = include_str!("../../docs/src/performance.md")]
pub mod book_performance {}

#[doc = include_str!("../../docs/src/comparison.md")]
pub mod book_comparison {}
