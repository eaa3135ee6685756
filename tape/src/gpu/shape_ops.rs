//! Device math of the shape and index ops (transpose, permute, narrow, concat, embedding, masked_fill, dropout).

use super::{Kernel, KernelArgs};

kernels! {
    SHAPE_KERNELS:
}
