// Emulation stand-in for c10/cuda/CUDAException.h (tests/emulation).
#pragma once
#include "emu_runtime.h"
#define C10_CUDA_CHECK(expr) ::emu::check_status((expr), #expr)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
