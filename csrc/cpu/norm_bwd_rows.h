#pragma once
// norm_bwd_rows_for (declared in norm_entry.h): the backward's row kernels of one (T, D)
// pair, its flags made compile-time. Included by the norm_bwd_rows_<dy dtype>.cpp files
// alone, each of which instantiates it with FUSEDNORM_CPU_NORM_BWD_ROWS.

#include "cpu/norm_entry.h"

namespace fusednorm::cpu::entry {

template <typename T, typename D>
void norm_bwd_rows_for(const NormBwdArgs<T, acc_type<T>, D>& args, bool centered, bool weight,
                       bool param_grads, bool input_grad, acc_type<T>* partial_w,
                       acc_type<T>* partial_b, int64_t blocks) {
  dispatch_bools(centered, weight, [&](auto c, auto w) {
    dispatch_bools(param_grads, input_grad, [&](auto grads, auto ig) {
      norm_bwd_rows<T, acc_type<T>, decltype(c)::value, decltype(w)::value,
                    decltype(grads)::value, decltype(ig)::value>(args, partial_w, partial_b,
                                                                  blocks);
    });
  });
}

}  // namespace fusednorm::cpu::entry

// The instantiation for input type T and dy type D.
#define FUSEDNORM_CPU_NORM_BWD_ROWS(T, D)                                                    \
  template void fusednorm::cpu::entry::norm_bwd_rows_for<T, D>(                              \
      const fusednorm::cpu::NormBwdArgs<T, fusednorm::cpu::acc_type<T>, D>&, bool, bool, bool, \
      bool, fusednorm::cpu::acc_type<T>*, fusednorm::cpu::acc_type<T>*, int64_t);
