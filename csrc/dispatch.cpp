// torch's Python-level dispatch to the capture mode, in C (flybatch/capture/dispatch.py rebinds
// it).
//
// The torch functions written in Python (most of torch.nn.functional: F.embedding,
// F.cross_entropy, F.softmax...; torch.functional; Tensor methods of torch/_tensor.py such as
// `split`) reach a torch function mode through torch.overrides.handle_torch_function, which
// is Python too: the overloaded arguments found in a loop, a contextlib manager that pops the
// mode and pushes it back, the mode's call. That costs more than recording the call.
//
// `handle_torch_function` here is that function for the case a graph block makes common, the
// innermost mode being capture's own (capture._Capture): in torch's order, the overloaded
// arguments and their types; the mode popped, its __torch_function__ (capture.cpp) called, the
// mode pushed back (an exception too); then, only if the mode returned NotImplemented, each
// overloaded argument's __torch_function__, and torch's TypeError if none answers. In any
// other case (no mode on, another mode innermost) it calls torch's own function.
#include "store.h"

namespace flybatch {

// capture.cpp: `mode.__torch_function__(func, types, args, kwargs)` of a capture mode.
PyObject* capture_mode_call(PyObject* mode, PyObject* func, PyObject* types, PyObject* args,
                            PyObject* kwargs);

namespace {

PyObject* g_mode_class = nullptr;        // capture._Capture
PyObject* g_torch_handle = nullptr;      // torch.overrides.handle_torch_function
PyObject* g_disabled_impl = nullptr;     // torch._C._disabled_torch_function_impl
PyObject* g_subclasses_on = nullptr;     // torch._C._is_torch_function_enabled
PyObject* g_pop_mode = nullptr;          // torch._C._pop_torch_function_stack
PyObject* g_push_mode = nullptr;         // torch._C._push_on_torch_function_stack
PyObject* s_torch_function = nullptr;    // "__torch_function__"
PyObject* s_self_attr = nullptr;         // "__self__"
PyObject* s_module_attr = nullptr;       // "__module__"
PyObject* s_name_attr = nullptr;         // "__name__"

// getattr(x, name) as a new reference, or NULL (no error set) where x has no such attribute.
PyObject* optional_attr(PyObject* x, PyObject* name) {
  PyObject* value = PyObject_GetAttr(x, name);
  if (value) return value;
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw PythonError{};
  PyErr_Clear();
  return nullptr;
}

// torch.overrides._get_overloaded_args: the arguments whose type has a __torch_function__ other
// than torch's disabled one (a torch.Tensor does; a Parameter does not), one per type, in
// order, except that a subclass goes before the first of its base classes already listed.
PyObject* overloaded_args(PyObject* relevant) {  // a new list
  Owned out{PyList_New(0)};
  Owned on{PyObject_CallNoArgs(g_subclasses_on)};  // off under DisableTorchFunctionSubclass
  if (on.get() != Py_True) return out.release();
  Owned items{PySequence_Fast(relevant, "relevant_args must be iterable")};
  std::vector<PyTypeObject*> types;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.get()); ++i) {
    PyObject* arg = PySequence_Fast_GET_ITEM(items.get(), i);
    if (arg == Py_None || PyLong_CheckExact(arg) || PyFloat_CheckExact(arg) || PyBool_Check(arg))
      continue;  // (their types have no __torch_function__ and cannot be given one)
    PyTypeObject* type = Py_TYPE(arg);
    if (std::find(types.begin(), types.end(), type) != types.end()) continue;
    PyObject* method = optional_attr(reinterpret_cast<PyObject*>(type), s_torch_function);
    if (!method) continue;
    const bool enabled = method != g_disabled_impl;
    Py_DECREF(method);
    if (!enabled) continue;
    Py_ssize_t at = static_cast<Py_ssize_t>(types.size());
    for (std::size_t k = 0; k < types.size(); ++k)
      if (PyType_IsSubtype(type, types[k])) {
        at = static_cast<Py_ssize_t>(k);
        break;
      }
    types.insert(types.begin() + at, type);
    if (PyList_Insert(out.get(), at, arg) < 0) throw PythonError{};
  }
  return out.release();
}

// The rest of torch's function once the mode returned NotImplemented: each overloaded
// argument's own __torch_function__, in order; torch's TypeError if none answers.
PyObject* call_overrides(PyObject* func, PyObject* overloaded, PyObject* types, PyObject* args,
                         PyObject* kwargs, PyObject* mode) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(overloaded); ++i) {
    PyObject* arg = PyList_GET_ITEM(overloaded, i);
    Owned method{PyObject_GetAttr(arg, s_torch_function)};
    PyObject* self = optional_attr(method.get(), s_self_attr);
    Py_XDECREF(self);
    if (self == arg && method.get() != g_disabled_impl &&
        PyErr_WarnEx(PyExc_DeprecationWarning,
                     "Defining your `__torch_function__ as a plain method is deprecated and "
                     "will be an error in future, please define it as a classmethod.", 1) < 0)
      throw PythonError{};
    PyObject* call[4] = {func, types, args, kwargs};
    PyObject* result = checked(PyObject_Vectorcall(method.get(), call, 4, nullptr));
    if (result != Py_NotImplemented) return result;
    Py_DECREF(result);
  }
  Owned module{PyObject_GetAttr(func, s_module_attr)}, name{PyObject_GetAttr(func, s_name_attr)};
  Owned kinds{PyList_New(PyList_GET_SIZE(overloaded))};
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(overloaded); ++i)
    PyList_SET_ITEM(kinds.get(), i,
                    Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(PyList_GET_ITEM(overloaded, i)))));
  raise(PyExc_TypeError,
        "no implementation found for '%S.%S' on types that implement __torch_function__: %R "
        "nor in mode %S", module.get(), name.get(), kinds.get(), mode);
}

const char kHandleDoc[] =
    "handle_torch_function(public_api, relevant_args, *args, **kwargs)\n\n"
    "torch.overrides.handle_torch_function, in C where the innermost torch function mode is "
    "capture's own; torch's function otherwise (csrc/dispatch.cpp).";

PyObject* handle_torch_function(PyObject*, PyObject* const* argv, Py_ssize_t nargs,
                                PyObject* kwnames) {
  return guarded([&]() -> PyObject* {
    if (!g_torch_handle) raise(PyExc_RuntimeError, "configure_dispatch() was not called");
    auto torch_own = [&] { return checked(PyObject_Vectorcall(g_torch_handle, argv, nargs,
                                                              kwnames)); };
    if (nargs < 2 || !torch_function_mode_enabled()) return torch_own();
    Owned overloaded{overloaded_args(argv[1])};
    Owned mode{PyObject_CallNoArgs(g_pop_mode)};
    auto push_back = [&] {
      PyObject* pushed = PyObject_CallOneArg(g_push_mode, mode.get());
      Py_XDECREF(pushed);
      return pushed != nullptr;
    };
    if (Py_TYPE(mode.get()) != reinterpret_cast<PyTypeObject*>(g_mode_class)) {
      if (!push_back()) throw PythonError{};
      return torch_own();
    }
    const Py_ssize_t n_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject* result = nullptr;
    Owned types{PyTuple_New(PyList_GET_SIZE(overloaded.get()))};
    Owned args{PyTuple_New(nargs - 2)};
    Owned kwargs{PyDict_New()};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(overloaded.get()); ++i)
      PyTuple_SET_ITEM(types.get(), i, Py_NewRef(reinterpret_cast<PyObject*>(
                                           Py_TYPE(PyList_GET_ITEM(overloaded.get(), i)))));
    for (Py_ssize_t i = 2; i < nargs; ++i)
      PyTuple_SET_ITEM(args.get(), i - 2, Py_NewRef(argv[i]));
    bool filled = true;
    for (Py_ssize_t j = 0; j < n_kw && filled; ++j)
      filled = PyDict_SetItem(kwargs.get(), PyTuple_GET_ITEM(kwnames, j), argv[nargs + j]) == 0;
    if (filled)
      result = capture_mode_call(mode.get(), argv[0], types.get(), args.get(), kwargs.get());
    // The mode goes back on the stack whatever happened (torch's `finally`), the call's error
    // kept across the push.
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    const bool pushed = push_back();
    if (!pushed) {
      Py_XDECREF(result);
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      throw PythonError{};
    }
    PyErr_Restore(type, value, traceback);
    if (!result) throw PythonError{};
    if (result != Py_NotImplemented) return result;
    Py_DECREF(result);
    return call_overrides(argv[0], overloaded.get(), types.get(), args.get(), kwargs.get(),
                          mode.get());
  });
}

const char kConfigureDispatchDoc[] =
    "configure_dispatch(mode_class, torch_handle)\n\n"
    "The capture mode's class (capture._Capture) and torch's own "
    "torch.overrides.handle_torch_function, which handle_torch_function calls for any "
    "other mode.";

PyObject* configure_dispatch(PyObject*, PyObject* args) {
  PyObject *mode_class, *torch_handle;
  if (!PyArg_ParseTuple(args, "O!O:configure_dispatch", &PyType_Type, &mode_class,
                        &torch_handle))
    return nullptr;
  Owned torch_c{PyImport_ImportModule("torch._C")};
  PyObject* found[4] = {};
  const char* names[4] = {"_disabled_torch_function_impl", "_is_torch_function_enabled",
                          "_pop_torch_function_stack", "_push_on_torch_function_stack"};
  for (int i = 0; i < 4; ++i) {
    found[i] = PyObject_GetAttrString(torch_c.get(), names[i]);
    if (!found[i]) {
      for (int k = 0; k < i; ++k) Py_DECREF(found[k]);
      return nullptr;
    }
  }
  Py_XSETREF(g_disabled_impl, found[0]);
  Py_XSETREF(g_subclasses_on, found[1]);
  Py_XSETREF(g_pop_mode, found[2]);
  Py_XSETREF(g_push_mode, found[3]);
  Py_XSETREF(g_mode_class, Py_NewRef(mode_class));
  Py_XSETREF(g_torch_handle, Py_NewRef(torch_handle));
  Py_RETURN_NONE;
}

PyMethodDef kDispatchMethods[] = {
    {"handle_torch_function",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(handle_torch_function)),
     METH_FASTCALL | METH_KEYWORDS, kHandleDoc},
    {"configure_dispatch", configure_dispatch, METH_VARARGS, kConfigureDispatchDoc},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_dispatch(PyObject* module) {
  s_torch_function = PyUnicode_InternFromString("__torch_function__");
  s_self_attr = PyUnicode_InternFromString("__self__");
  s_module_attr = PyUnicode_InternFromString("__module__");
  s_name_attr = PyUnicode_InternFromString("__name__");
  return s_torch_function && s_self_attr && s_module_attr && s_name_attr &&
         PyModule_AddFunctions(module, kDispatchMethods) == 0;
}

}  // namespace flybatch
