//! Cross-crate end-to-end tests live in `tests/`.
