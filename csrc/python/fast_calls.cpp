// fusednorm._fast: direct Python entries into the public ops, for the eager calls of
// fusednorm.functional. A call through torch.ops.fusednorm.<op> converts its arguments by
// the op's schema into a boxed stack (about 1.5-2 us on the benchmark machine, more than
// the rest of a small LayerNorm call), where PyTorch's own functions go through generated
// bindings.
// These entries read their arguments straight off the Python objects and call the op's
// typed dispatcher handle, so autograd, autocast, profiling, functorch and
// __torch_dispatch__ all apply exactly as through torch.ops.
//
// Every entry returns NotImplemented, and the caller takes the torch.ops path, whenever it
// would differ from that path: an argument of another type than the plain one (a Tensor
// subclass, a SymInt, a bool for an int), a __torch_function__ override or mode in effect,
// or any C++ error (the torch.ops path raises it again, with fusednorm's explanation).
// A Python exception raised inside the op (by a hook or a mode) propagates as is.
//
// Built as its own extension against the full Python API and libtorch_python (fusednorm._C
// is abi3 and links neither); its import is optional: without it every call takes the
// torch.ops path.

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <string>
#include <tuple>

#include "common/op_support.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

// Whether a torch.Tensor argument takes the fast path: a plain Tensor or Parameter (whose
// __torch_function__ is the default) with no TorchFunctionMode active, which is all that
// PyTorch's own has-torch-function test asks of these types.
bool plain_tensor(PyObject* obj) {
  return THPVariable_CheckExact(obj) && !at::impl::torch_function_mode_enabled();
}

bool tensor_arg(PyObject* obj, at::Tensor& out) {
  if (!plain_tensor(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

bool optional_tensor_arg(PyObject* obj, OptTensor& out) {
  if (obj == Py_None) {
    out = std::nullopt;
    return true;
  }
  if (!plain_tensor(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

// A tuple or list (torch.Size included) of Python ints.
bool int_list_arg(PyObject* obj, c10::SmallVector<int64_t, 4>& out) {
  if (!PyTuple_Check(obj) && !PyList_Check(obj)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    out.push_back(value);
  }
  return true;
}

bool float_arg(PyObject* obj, double& out) {
  if (PyFloat_CheckExact(obj)) {
    out = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  if (!PyLong_CheckExact(obj)) return false;
  out = PyLong_AsDouble(obj);
  if (out == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool optional_float_arg(PyObject* obj, std::optional<double>& out) {
  if (obj == Py_None) {
    out = std::nullopt;
    return true;
  }
  double value = 0;
  if (!float_arg(obj, value)) return false;
  out = value;
  return true;
}

bool string_arg(PyObject* obj, std::string& out) {
  if (!PyUnicode_CheckExact(obj)) return false;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(obj, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return false;
  }
  out.assign(data, static_cast<size_t>(size));
  return true;
}

bool bool_arg(PyObject* obj, bool& out) {
  if (obj != Py_True && obj != Py_False) return false;
  out = obj == Py_True;
  return true;
}

PyObject* not_implemented() {
  Py_RETURN_NOTIMPLEMENTED;
}

// Runs call() (which calls the op) without the GIL, as PyTorch's bindings do, and wraps
// what wrap() makes of its result. Each entry's call() keeps the op's typed handle in a
// function-local static, looked up on the first call (an error, so NotImplemented, should
// fusednorm._C not have registered the op).
// A Python exception raised inside the call (a saved-tensor hook, such as the one by which
// torch.utils.checkpoint stops its recomputation, a __torch_dispatch__ mode, an anomaly
// hook) is raised as is: running the op again through torch.ops would run that Python code
// a second time. Any other C++ error gives NotImplemented, and torch.ops raises it with
// fusednorm's explanation.
template <class Call, class Wrap>
PyObject* run(const Call& call, const Wrap& wrap) {
  decltype(call()) result;
  PyThreadState* saved = PyEval_SaveThread();
  try {
    result = call();
  } catch (python_error& e) {
    PyEval_RestoreThread(saved);
    e.restore();  // a no-op when the error was not persisted: then it is still set
    if (PyErr_Occurred() != nullptr) return nullptr;
    return not_implemented();
  } catch (...) {
    PyEval_RestoreThread(saved);
    if (PyErr_Occurred() != nullptr) return nullptr;  // raised by Python code in the call
    return not_implemented();
  }
  PyEval_RestoreThread(saved);
  return wrap(std::move(result));
}

template <class Outputs>
PyObject* wrap_first(Outputs&& outputs) {
  return THPVariable_Wrap(std::move(std::get<0>(outputs)));
}

// (out, sum): the add_* ops' differentiable outputs.
template <class Outputs>
PyObject* wrap_out_and_sum(Outputs&& outputs) {
  PyObject* pair = PyTuple_New(2);
  if (pair == nullptr) return nullptr;
  // PyTuple_SET_ITEM steals the references; a failed wrap leaves a NULL slot, which
  // tuple deallocation skips.
  PyTuple_SET_ITEM(pair, 0, THPVariable_Wrap(std::move(std::get<0>(outputs))));
  PyTuple_SET_ITEM(pair, 1, THPVariable_Wrap(std::move(std::get<1>(outputs))));
  if (PyTuple_GET_ITEM(pair, 0) == nullptr || PyTuple_GET_ITEM(pair, 1) == nullptr) {
    Py_DECREF(pair);
    return nullptr;
  }
  return pair;
}

bool arg_count(Py_ssize_t nargs, Py_ssize_t expected, const char* name) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "fusednorm._fast.%s takes %zd arguments (%zd given)", name,
               expected, nargs);
  return false;
}

using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// layer_norm(input, normalized_shape, weight, bias, eps, zero_centered_weight) -> out
PyObject* layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 6, "layer_norm")) return nullptr;
  at::Tensor input;
  c10::SmallVector<int64_t, 4> shape;
  OptTensor weight, bias;
  double eps = 0;
  bool zero_centered = false;
  if (!tensor_arg(args[0], input) || !int_list_arg(args[1], shape) ||
      !optional_tensor_arg(args[2], weight) || !optional_tensor_arg(args[3], bias) ||
      !float_arg(args[4], eps) || !bool_arg(args[5], zero_centered)) {
    return not_implemented();
  }
  using Sig = Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                      const OptTensor&, double, bool);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::layer_norm");
        return op.call(input, c10::fromIntArrayRefSlow(shape), weight, bias, eps,
                       zero_centered);
      },
      [](auto&& r) { return wrap_first(std::move(r)); });
}

// rms_norm(input, normalized_shape, weight, eps, zero_centered_weight) -> out
PyObject* rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 5, "rms_norm")) return nullptr;
  at::Tensor input;
  c10::SmallVector<int64_t, 4> shape;
  OptTensor weight;
  std::optional<double> eps;
  bool zero_centered = false;
  if (!tensor_arg(args[0], input) || !int_list_arg(args[1], shape) ||
      !optional_tensor_arg(args[2], weight) || !optional_float_arg(args[3], eps) ||
      !bool_arg(args[4], zero_centered)) {
    return not_implemented();
  }
  using Sig = Tensor2(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                      std::optional<double>, bool);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::rms_norm");
        return op.call(input, c10::fromIntArrayRefSlow(shape), weight, eps, zero_centered);
      },
      [](auto&& r) { return wrap_first(std::move(r)); });
}

// add_layer_norm(input, residual, normalized_shape, weight, bias, eps,
//                zero_centered_weight) -> (out, sum)
PyObject* add_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 7, "add_layer_norm")) return nullptr;
  at::Tensor input, residual;
  c10::SmallVector<int64_t, 4> shape;
  OptTensor weight, bias;
  double eps = 0;
  bool zero_centered = false;
  if (!tensor_arg(args[0], input) || !tensor_arg(args[1], residual) ||
      !int_list_arg(args[2], shape) || !optional_tensor_arg(args[3], weight) ||
      !optional_tensor_arg(args[4], bias) || !float_arg(args[5], eps) ||
      !bool_arg(args[6], zero_centered)) {
    return not_implemented();
  }
  using Sig = Tensor4(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                      const OptTensor&, const OptTensor&, double, bool);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::add_layer_norm");
        return op.call(input, residual, c10::fromIntArrayRefSlow(shape), weight, bias, eps,
                       zero_centered);
      },
      [](auto&& r) { return wrap_out_and_sum(std::move(r)); });
}

// add_rms_norm(input, residual, normalized_shape, weight, eps, zero_centered_weight)
//     -> (out, sum)
PyObject* add_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 6, "add_rms_norm")) return nullptr;
  at::Tensor input, residual;
  c10::SmallVector<int64_t, 4> shape;
  OptTensor weight;
  std::optional<double> eps;
  bool zero_centered = false;
  if (!tensor_arg(args[0], input) || !tensor_arg(args[1], residual) ||
      !int_list_arg(args[2], shape) || !optional_tensor_arg(args[3], weight) ||
      !optional_float_arg(args[4], eps) || !bool_arg(args[5], zero_centered)) {
    return not_implemented();
  }
  using Sig = Tensor3(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                      const OptTensor&, std::optional<double>, bool);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::add_rms_norm");
        return op.call(input, residual, c10::fromIntArrayRefSlow(shape), weight, eps,
                       zero_centered);
      },
      [](auto&& r) { return wrap_out_and_sum(std::move(r)); });
}

// gelu_ffn(input, weight1, bias1, weight2, bias2, approximate) -> out
PyObject* gelu_ffn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 6, "gelu_ffn")) return nullptr;
  at::Tensor input, weight1, weight2;
  OptTensor bias1, bias2;
  std::string approximate;
  if (!tensor_arg(args[0], input) || !tensor_arg(args[1], weight1) ||
      !optional_tensor_arg(args[2], bias1) || !tensor_arg(args[3], weight2) ||
      !optional_tensor_arg(args[4], bias2) || !string_arg(args[5], approximate)) {
    return not_implemented();
  }
  using Sig = Tensor2(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&,
                      const OptTensor&, c10::string_view);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::gelu_ffn");
        return op.call(input, weight1, bias1, weight2, bias2, approximate);
      },
      [](auto&& r) { return wrap_first(std::move(r)); });
}

// layer_norm_gelu_ffn(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
// approximate) -> out
PyObject* layer_norm_gelu_ffn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arg_count(nargs, 9, "layer_norm_gelu_ffn")) return nullptr;
  at::Tensor input, weight1, weight2;
  OptTensor ln_weight, ln_bias, bias1, bias2;
  double eps = 0;
  std::string approximate;
  if (!tensor_arg(args[0], input) || !optional_tensor_arg(args[1], ln_weight) ||
      !optional_tensor_arg(args[2], ln_bias) || !float_arg(args[3], eps) ||
      !tensor_arg(args[4], weight1) || !optional_tensor_arg(args[5], bias1) ||
      !tensor_arg(args[6], weight2) || !optional_tensor_arg(args[7], bias2) ||
      !string_arg(args[8], approximate)) {
    return not_implemented();
  }
  using Sig = Tensor4(const at::Tensor&, const OptTensor&, const OptTensor&, double,
                      const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&,
                      c10::string_view);
  return run(
      [&] {
        static const auto op = fusednorm::fusednorm_op<Sig>("fusednorm::layer_norm_gelu_ffn");
        return op.call(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
                       approximate);
      },
      [](auto&& r) { return wrap_first(std::move(r)); });
}

#define FAST_ENTRY(name, doc) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(name)), METH_FASTCALL, doc}

PyMethodDef methods[] = {
    FAST_ENTRY(layer_norm,
               "layer_norm(input, normalized_shape, weight, bias, eps, zero_centered_weight)"
               " -> out"),
    FAST_ENTRY(rms_norm,
               "rms_norm(input, normalized_shape, weight, eps, zero_centered_weight) -> out"),
    FAST_ENTRY(add_layer_norm,
               "add_layer_norm(input, residual, normalized_shape, weight, bias, eps,"
               " zero_centered_weight) -> (out, sum)"),
    FAST_ENTRY(add_rms_norm,
               "add_rms_norm(input, residual, normalized_shape, weight, eps,"
               " zero_centered_weight) -> (out, sum)"),
    FAST_ENTRY(gelu_ffn, "gelu_ffn(input, weight1, bias1, weight2, bias2, approximate) -> out"),
    FAST_ENTRY(layer_norm_gelu_ffn,
               "layer_norm_gelu_ffn(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, "
               "bias2, approximate) -> out"),
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMODINIT_FUNC PyInit__fast(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_fast",
      "Direct entries into fusednorm's ops (NotImplemented: take the torch.ops path).", -1,
      methods};
  return PyModule_Create(&module_def);
}
