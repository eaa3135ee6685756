//! Reverse-mode autograd over CPU and CUDA tensors (not built yet; see issue 4).
