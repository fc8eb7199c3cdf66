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
// the JIT tracer running (torch.jit.trace, and the TorchScript-based ONNX exporter, for
// which fusednorm.functional traces the ops' ATen forms), or any C++ error (the torch.ops
// path raises it again, with fusednorm's explanation).
// A Python exception raised inside the op (by a hook or a mode) propagates as is.
//
// One entry per public op of csrc/op_table.h, generated from its signature there.
//
// Built as its own extension against the full Python API and libtorch_python (fusednorm._C
// is abi3 and links neither); its import is optional: without it every call takes the
// torch.ops path.

#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "ops/op_handles.h"

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

// None, or a torch.dtype (ScalarType?).
bool optional_dtype_arg(PyObject* obj, std::optional<at::ScalarType>& out) {
  if (obj == Py_None) {
    out = std::nullopt;
    return true;
  }
  if (!THPDtype_Check(obj)) return false;
  out = reinterpret_cast<THPDtype*>(obj)->scalar_type;
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

// One Python argument as the C++ type of the op's signature: parse() fills the value (an
// owning form for lists and strings), pass() gives what op.call takes. A false parse()
// means the argument is not of the plain type: NotImplemented.
template <class Arg>
struct ArgSlot;

template <>
struct ArgSlot<const at::Tensor&> {
  at::Tensor value;
  bool parse(PyObject* obj) { return tensor_arg(obj, value); }
  const at::Tensor& pass() const { return value; }
};

template <>
struct ArgSlot<const OptTensor&> {
  OptTensor value;
  bool parse(PyObject* obj) { return optional_tensor_arg(obj, value); }
  const OptTensor& pass() const { return value; }
};

template <>
struct ArgSlot<c10::SymIntArrayRef> {
  c10::SmallVector<int64_t, 4> value;
  bool parse(PyObject* obj) { return int_list_arg(obj, value); }
  c10::SymIntArrayRef pass() const { return c10::fromIntArrayRefSlow(value); }
};

template <>
struct ArgSlot<double> {
  double value = 0;
  bool parse(PyObject* obj) { return float_arg(obj, value); }
  double pass() const { return value; }
};

template <>
struct ArgSlot<std::optional<double>> {
  std::optional<double> value;
  bool parse(PyObject* obj) { return optional_float_arg(obj, value); }
  std::optional<double> pass() const { return value; }
};

template <>
struct ArgSlot<bool> {
  bool value = false;
  bool parse(PyObject* obj) { return bool_arg(obj, value); }
  bool pass() const { return value; }
};

template <>
struct ArgSlot<std::optional<at::ScalarType>> {
  std::optional<at::ScalarType> value;
  bool parse(PyObject* obj) { return optional_dtype_arg(obj, value); }
  std::optional<at::ScalarType> pass() const { return value; }
};

template <>
struct ArgSlot<c10::string_view> {
  std::string value;
  bool parse(PyObject* obj) { return string_arg(obj, value); }
  c10::string_view pass() const { return value; }
};

// The first kOutputs outputs of the op as Python objects: a Tensor, or a tuple of Tensors.
template <class Outputs, std::size_t... I>
PyObject* wrap_tuple(Outputs&& outputs, std::index_sequence<I...>) {
  PyObject* tuple = PyTuple_New(sizeof...(I));
  if (tuple == nullptr) return nullptr;
  // PyTuple_SET_ITEM steals the references; a failed wrap leaves a NULL slot, which tuple
  // deallocation skips.
  (PyTuple_SET_ITEM(tuple, I, THPVariable_Wrap(std::move(std::get<I>(outputs)))), ...);
  if (((PyTuple_GET_ITEM(tuple, I) == nullptr) || ...)) {
    Py_DECREF(tuple);
    return nullptr;
  }
  return tuple;
}

template <int kOutputs, class Outputs>
PyObject* wrap_outputs(Outputs&& outputs) {
  if constexpr (kOutputs == 1) {
    return THPVariable_Wrap(std::move(std::get<0>(outputs)));
  } else {
    return wrap_tuple(std::move(outputs), std::make_index_sequence<kOutputs>{});
  }
}

// The direct entry of the public op `Op` (an op_table.h row, below): its arguments read
// by their types in the op's signature, one typed call of its handle, its first
// kOutputs outputs.
template <class Op, class Signature = typename Op::Signature>
struct Entry;

template <class Op, class Result, class... Args>
struct Entry<Op, Result(Args...)> {
  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    constexpr Py_ssize_t kArgs = sizeof...(Args);
    if (nargs != kArgs) {
      PyErr_Format(PyExc_TypeError, "fusednorm._fast.%s takes %zd arguments (%zd given)",
                   Op::kName, kArgs, nargs);
      return nullptr;
    }
    return call_with(args, std::index_sequence_for<Args...>{});
  }

 private:
  template <std::size_t... I>
  static PyObject* call_with(PyObject* const* args, std::index_sequence<I...>) {
    if (torch::jit::tracer::isTracing()) return not_implemented();
    std::tuple<ArgSlot<Args>...> slots;
    if (!(std::get<I>(slots).parse(args[I]) && ...)) return not_implemented();
    return run([&] { return Op::handle().call(std::get<I>(slots).pass()...); },
               [](auto&& r) { return wrap_outputs<Op::kOutputs>(std::move(r)); });
  }
};

// One row type per public op of op_table.h, and its method entry; the docstring is the
// op's schema and how many of its outputs the entry returns.
#define FUSEDNORM_FAST_OP(op_name, schema, signature, outputs)                               \
  struct op_name##_row {                                                                     \
    using Signature = fusednorm::op_table::op_name;                                          \
    static constexpr const char* kName = #op_name;                                           \
    static constexpr int kOutputs = outputs;                                                 \
    static const auto& handle() { return fusednorm::public_ops::op_name(); }                 \
  };
FUSEDNORM_PUBLIC_OPS(FUSEDNORM_FAST_OP)
#undef FUSEDNORM_FAST_OP

#define FUSEDNORM_FAST_METHOD(op_name, schema, signature, outputs)                    \
  {#op_name,                                                                                 \
   reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Entry<op_name##_row>::call)), \
   METH_FASTCALL, schema "; returns its first " #outputs " output(s)"},

PyMethodDef methods[] = {
    FUSEDNORM_PUBLIC_OPS(FUSEDNORM_FAST_METHOD)
    {nullptr, nullptr, 0, nullptr},
};
#undef FUSEDNORM_FAST_METHOD

}  // namespace

PyMODINIT_FUNC PyInit__fast(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_fast",
      "Direct entries into fusednorm's ops (NotImplemented: take the torch.ops path).", -1,
      methods};
  return PyModule_Create(&module_def);
}
