//! Cross-crate tests live in `tests/`. This library also compiles and runs every Rust
//! example in the mdBook (`docs/src`) as a doctest, so the book cannot rot.

#[doc = include_str!("../../docs/src/getting-started.md")]
pub mod book_getting_started {}

#[doc = include_str!("../../ARCHITECTURE.md")]
pub mod book_architecture {}

#[doc = include_str!("../../docs/src/comm-core.md")]
pub mod book_comm_core {}

#[doc = include_str!("../../docs/src/troubleshooting.md")]
pub mod book_troubleshooting {}
