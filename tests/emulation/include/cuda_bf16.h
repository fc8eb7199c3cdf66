// Emulation stand-in for the CUDA runtime header (tests/emulation): types only.
#pragma once
#include "emu_runtime.h"
