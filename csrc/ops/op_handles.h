#pragma once
// Typed dispatcher handles of every op in op_table.h, for the public ops of csrc/ops (and
// fusednorm._fast) to call: row_ops::<name>() for the backend ops on [M, N] rows,
// public_ops::<name>() for the public ops. Each is looked up once, on its first use.

#include "common/op_support.h"
#include "op_table.h"

#define FUSEDNORM_OP_HANDLE(name, schema, ...)                                              \
  inline const c10::TypedOperatorHandle<op_table::name>& name() {                           \
    static const auto op = fusednorm_op<op_table::name>("fusednorm::" #name);               \
    return op;                                                                               \
  }

namespace fusednorm::row_ops {
using OptTensor = std::optional<at::Tensor>;
FUSEDNORM_BACKEND_OPS(FUSEDNORM_OP_HANDLE)
}  // namespace fusednorm::row_ops

namespace fusednorm::public_ops {
FUSEDNORM_PUBLIC_OPS(FUSEDNORM_OP_HANDLE)
}  // namespace fusednorm::public_ops

#undef FUSEDNORM_OP_HANDLE
