//! Compiles and runs the book's getting-started chapter against the packaged crates, as a
//! project outside this repository would depend on them.

#[doc = include_str!("../../../docs/src/getting-started.md")]
pub struct GettingStarted;
