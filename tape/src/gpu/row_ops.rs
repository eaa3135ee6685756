//! Device math of the row ops (softmax, log_softmax, layer_norm, cross_entropy).

use super::{Kernel, KernelArgs};

kernels! {
    ROW_KERNELS:
}
