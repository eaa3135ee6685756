/* The host build of comm-core's kernels (src/kernels), which the emulated device runs;
 * the CUDA build of the same source is assembled in src/kernels.rs. */
#include "ferrotron_kernels.h"
#include "reduce.cu"
