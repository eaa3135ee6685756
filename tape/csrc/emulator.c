/* The host build of the device kernels (tape's Device::Emulated): every kernel of
 * src/gpu/kernels, compiled as C for f32 and f64. The CUDA build of the same files is
 * assembled in src/gpu/cuda.rs. */
#include "ferrotron_kernels.h"
#include "common.h"

#include "precision_f32.h"
#include "elementwise.cu"
#include "reduce.cu"
#include "shape.cu"
#include "index.cu"
#include "rows.cu"
#include "attention.cu"
#include "optim.cu"
#include "precision_end.h"

#include "precision_f64.h"
#include "elementwise.cu"
#include "reduce.cu"
#include "shape.cu"
#include "index.cu"
#include "rows.cu"
#include "attention.cu"
#include "optim.cu"
#include "precision_end.h"
