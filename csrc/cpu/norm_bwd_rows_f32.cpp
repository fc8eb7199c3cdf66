// The CPU backward's rows for float dy: norm_bwd_rows.h.

#include "cpu/norm_bwd_rows.h"

FUSEDNORM_CPU_NORM_BWD_ROWS(float, float)
