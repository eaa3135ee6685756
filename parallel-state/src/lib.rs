//! Megatron-style rank layouts and process groups (not built yet; see issue 3).
