//! Differentiable collectives for tensor/sequence parallel regions (not built yet; see issue 5).
