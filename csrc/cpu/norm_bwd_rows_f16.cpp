// The CPU backward's rows for float16 dy (an input of its own dtype, or a float32 sum):
// norm_bwd_rows.h.

#include "cpu/norm_bwd_rows.h"

FUSEDNORM_CPU_NORM_BWD_ROWS(c10::Half, c10::Half)
FUSEDNORM_CPU_NORM_BWD_ROWS(float, c10::Half)
