//! Tensor-parallel layers (not built yet; see issue 6).
