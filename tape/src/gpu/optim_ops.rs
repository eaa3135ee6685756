//! Device math of the optimizer steps (SGD, AdamW).

use super::{Kernel, KernelArgs};

kernels! {
    OPTIM_KERNELS:
}
