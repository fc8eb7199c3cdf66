// The CPU backward's rows for double dy: norm_bwd_rows.h.

#include "cpu/norm_bwd_rows.h"

FUSEDNORM_CPU_NORM_BWD_ROWS(double, double)
