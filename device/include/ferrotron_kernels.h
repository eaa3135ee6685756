/* The host build's kernel language (the emulated device's): include this, then the
 * kernels. See ferrotron_types.h for the rules. */
#ifndef FERROTRON_KERNELS_H
#define FERROTRON_KERNELS_H
#include "ferrotron_types.h"
#include "ferrotron_prelude_host.h"
#include "ferrotron_half.h"
#endif
