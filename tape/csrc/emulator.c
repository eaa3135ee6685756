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
/* The tensor-core kernels: f32 only, once per head dimension and 16-bit format. */
#define TC_D 64
#define TC_KIND 1
#define TC_TAG _d64_bf16
#include "attention_tc.cu"
#undef TC_D
#undef TC_KIND
#undef TC_TAG
#define TC_D 64
#define TC_KIND 2
#define TC_TAG _d64_f16
#include "attention_tc.cu"
#undef TC_D
#undef TC_KIND
#undef TC_TAG
#define TC_D 128
#define TC_KIND 1
#define TC_TAG _d128_bf16
#include "attention_tc.cu"
#undef TC_D
#undef TC_KIND
#undef TC_TAG
#define TC_D 128
#define TC_KIND 2
#define TC_TAG _d128_f16
#include "attention_tc.cu"
#undef TC_D
#undef TC_KIND
#undef TC_TAG
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
