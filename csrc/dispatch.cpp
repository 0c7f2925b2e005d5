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
#include <cstddef>
#include <vector>

#include "store.h"

namespace flybatch {

// capture.cpp: `mode.__torch_function__(func, types, args, kwargs)` of a capture mode.
PyObject* capture_mode_call(PyObject* mode, PyObject* func, PyObject* types, PyObject* args,
                            PyObject* kwargs);
// capture.cpp: what that mode does with a call that has an expression among its arguments
// (capture.torch_call: records it; a new reference, or the Python error unwinds).
PyObject* record_torch_call(PyObject* func, PyObject* args, PyObject* kwargs);
// capture.cpp: `tensor[part]`'s node where the current graph knows it (a parameter's part by
// an int, `U_f[0]`), else NULL with no error.
PyObject* known_parameter_part(PyObject* tensor, PyObject* part);
// capture.cpp: `func(x)` of one expression by the fb op it maps to (torch.sigmoid, x.tanh()),
// else NULL with no error.
PyObject* record_unary_call(PyObject* func, PyObject* x);

namespace {

PyObject* g_mode_class = nullptr;        // capture._Capture
PyObject* g_torch_handle = nullptr;      // torch.overrides.handle_torch_function
PyObject* g_disabled_impl = nullptr;     // torch._C._disabled_torch_function_impl
PyObject* g_subclasses_on = nullptr;     // torch._C._is_torch_function_enabled
PyObject* g_pop_mode = nullptr;          // torch._C._pop_torch_function_stack
PyObject* g_push_mode = nullptr;         // torch._C._push_on_torch_function_stack
PyObject* g_tensor_getitem = nullptr;    // torch.Tensor.__getitem__
PyObject* g_no_types = nullptr;          // (): the overloaded types of a call on plain tensors
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

// A vectorcall's arguments as torch gives them to a mode: an args tuple and a kwargs dict.
struct CallParts {
  Owned args;
  Owned kwargs;
  CallParts(PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames)
      : args(PyTuple_New(nargs)), kwargs(PyDict_New()) {
    for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(args.get(), i, Py_NewRef(argv[i]));
    for (Py_ssize_t j = 0; kwnames && j < PyTuple_GET_SIZE(kwnames); ++j)
      if (PyDict_SetItem(kwargs.get(), PyTuple_GET_ITEM(kwnames, j), argv[nargs + j]) < 0)
        throw PythonError{};
  }
};

// `mode` back on torch's stack after a call made with it popped, whatever the call did
// (torch's `finally`): returns the call's `result`, its error (result NULL) kept across the push.
PyObject* pushed_back(PyObject* mode, PyObject* result) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* pushed = PyObject_CallOneArg(g_push_mode, mode);
  if (!pushed) {
    Py_XDECREF(result);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    throw PythonError{};
  }
  Py_DECREF(pushed);
  PyErr_Restore(type, value, traceback);
  return result;
}

const char kHandleDoc[] =
    "handle_torch_function(public_api, relevant_args, *args, **kwargs)\n\n"
    "torch.overrides.handle_torch_function, in C where the innermost torch function mode is "
    "capture's own; torch's function otherwise (csrc/dispatch.cpp).";

// The torch function a Shortcut (below) stands for; any other object itself (borrowed).
PyObject* unwrapped(PyObject* func);

PyObject* handle_torch_function(PyObject*, PyObject* const* given, Py_ssize_t nargs,
                                PyObject* kwnames) {
  return guarded([&]() -> PyObject* {
    if (!g_torch_handle) raise(PyExc_RuntimeError, "configure_dispatch() was not called");
    // torch.nn.functional's functions pass themselves by their module-global name, a
    // Shortcut while capture is on: the mode, the handlers and other modes see torch's own.
    const Py_ssize_t n_all = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    std::vector<PyObject*> replaced;
    PyObject* const* argv = given;
    if (nargs >= 1 && unwrapped(given[0]) != given[0]) {
      replaced.assign(given, given + n_all);
      replaced[0] = unwrapped(given[0]);
      argv = replaced.data();
    }
    auto torch_own = [&] { return checked(PyObject_Vectorcall(g_torch_handle, argv, nargs,
                                                              kwnames)); };
    if (nargs < 2 || !torch_function_mode_enabled()) return torch_own();
    Owned overloaded{overloaded_args(argv[1])};
    Owned types{PyTuple_New(PyList_GET_SIZE(overloaded.get()))};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(overloaded.get()); ++i)
      PyTuple_SET_ITEM(types.get(), i, Py_NewRef(reinterpret_cast<PyObject*>(
                                           Py_TYPE(PyList_GET_ITEM(overloaded.get(), i)))));
    const CallParts call(argv + 2, nargs - 2, kwnames);  // (after func and relevant_args)
    // (everything made before the mode comes off the stack: an error can no longer skip its
    // push back)
    Owned mode{PyObject_CallNoArgs(g_pop_mode)};
    if (Py_TYPE(mode.get()) != reinterpret_cast<PyTypeObject*>(g_mode_class)) {
      Py_DECREF(checked(pushed_back(mode.get(), Py_NewRef(Py_None))));  // (not ours: back)
      return torch_own();
    }
    PyObject* result = capture_mode_call(mode.get(), argv[0], types.get(), call.args.get(),
                                         call.kwargs.get());
    result = checked(pushed_back(mode.get(), result));
    if (result != Py_NotImplemented) return result;
    Py_DECREF(result);
    return call_overrides(argv[0], overloaded.get(), types.get(), call.args.get(),
                          call.kwargs.get(), mode.get());
  });
}

// ---- shortcuts: torch's most called functions straight to the mode ------------------------------
// `torch.sigmoid(expr)` inside a graph block: torch's argument parser fails on the expression,
// gathers the overloaded arguments, pops the capture mode, calls it and pushes it back: ~0.55 us
// before the call is recorded (~0.3 us), per call of a per-instance model, whose graph block
// makes tens of thousands. While any thread captures, a `Shortcut` stands in for each of the
// functions such models call most (`torch.sigmoid`, `torch.cat`, `F.linear`...: the list and the
// rebinding are capture/mode.py's) and does what torch would, by a shorter route:
//   * no torch function mode on, or another mode innermost: torch's own function, as called;
//   * capture's mode innermost and an expression among the arguments (or in a list or tuple
//     argument, `torch.cat([h1, h2])`): recorded, the mode's first rule. With nothing else but
//     parameters and numbers beside it, as an Expression method's call is, with the mode left on
//     the stack; with a plain tensor too (a class target, a tensor the graph wrote into), with
//     the mode off the stack, as the mode reads those;
//   * capture's mode innermost and no expression (`torch.tensor([3])`, `F.embedding(i, E)`):
//     the mode's own __torch_function__ decides, the mode off the stack, as torch calls it.
// What a call records or returns is the same either way; `func` is always torch's own.
struct Shortcut {
  PyObject_HEAD
  PyObject* func;  // torch's own function
  vectorcallfunc vectorcall;
};
extern PyTypeObject ShortcutType, MethodShortcutType;

// Whether `match` holds for an argument, or for an item of a list or tuple argument.
template <class Match>
bool any_argument(PyObject* const* args, Py_ssize_t n, Match match) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* arg = args[i];
    if (match(arg)) return true;
    if (PyList_CheckExact(arg) || PyTuple_CheckExact(arg)) {
      PyObject* const* items = PySequence_Fast_ITEMS(arg);
      for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(arg); ++k)
        if (match(items[k])) return true;
    }
  }
  return false;
}

bool is_expression(PyObject* x) { return PyObject_TypeCheck(x, &ExpressionBase); }
bool is_plain_tensor(PyObject* x) {
  return Py_TYPE(x) == reinterpret_cast<PyTypeObject*>(g_tensor_type);
}

// This thread's mode stack length while capture's mode is its innermost; 0 while this thread
// does not capture (capture.mode.push / pop set it, set_capture_level). A mode pushed above
// capture's makes the stack longer: the shortcuts then take torch's own route to it.
thread_local std::int64_t t_capture_level = 0;

bool capture_innermost() {
  return t_capture_level > 0 && torch_function_mode_enabled() &&
         torch_function_stack_len() == t_capture_level;
}

PyObject* shortcut_call(PyObject* self, PyObject* const* args, std::size_t nargsf,
                        PyObject* kwnames) {
  PyObject* func = reinterpret_cast<Shortcut*>(self)->func;
  return guarded([&]() -> PyObject* {
    if (!capture_innermost()) return checked(PyObject_Vectorcall(func, args, nargsf, kwnames));
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (func == g_tensor_getitem && nargs == 2 && !kwnames)  // `U_f[0]`, seen before
      if (PyObject* part = known_parameter_part(args[0], args[1])) return part;
    if (nargs == 1 && !kwnames)  // torch.sigmoid(x)
      if (PyObject* out = record_unary_call(func, args[0])) return out;
    if (PyErr_Occurred()) throw PythonError{};
    const Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    const bool expression = any_argument(args, n, is_expression);
    if (expression && !any_argument(args, n, is_plain_tensor)) {
      CallParts call(args, nargs, kwnames);
      return record_torch_call(func, call.args.get(), call.kwargs.get());
    }
    Owned mode{PyObject_CallNoArgs(g_pop_mode)};
    const bool ours = Py_TYPE(mode.get()) == reinterpret_cast<PyTypeObject*>(g_mode_class);
    PyObject* result = !ours ? Py_NewRef(Py_NotImplemented) : guarded([&]() -> PyObject* {
      CallParts call(args, nargs, kwnames);
      if (expression) return record_torch_call(func, call.args.get(), call.kwargs.get());
      return capture_mode_call(mode.get(), func, g_no_types, call.args.get(), call.kwargs.get());
    });
    result = checked(pushed_back(mode.get(), result));
    if (result != Py_NotImplemented) return result;
    // The mode declined (torch asks the overloaded arguments next), or the stack's innermost
    // mode was another's after all: torch's own route.
    Py_DECREF(result);
    return checked(PyObject_Vectorcall(func, args, nargsf, kwnames));
  });
}

PyObject* unwrapped(PyObject* func) {
  const bool shortcut = Py_TYPE(func) == &ShortcutType || Py_TYPE(func) == &MethodShortcutType;
  return shortcut ? reinterpret_cast<Shortcut*>(func)->func : func;
}

PyObject* shortcut_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* func;
  if (kwargs && PyDict_GET_SIZE(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "Shortcut(func) takes no keyword arguments");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "O:Shortcut", &func)) return nullptr;
  if (!PyCallable_Check(func)) {
    PyErr_SetString(PyExc_TypeError, "Shortcut(func): func must be callable");
    return nullptr;
  }
  auto* self = reinterpret_cast<Shortcut*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->func = Py_NewRef(func);
  self->vectorcall = shortcut_call;
  return reinterpret_cast<PyObject*>(self);
}

void shortcut_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  Py_CLEAR(reinterpret_cast<Shortcut*>(self)->func);
  Py_TYPE(self)->tp_free(self);
}

int shortcut_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<Shortcut*>(self)->func);
  return 0;
}

// Everything but `__wrapped__` is the function's own: its __name__, __doc__, __module__,
// __qualname__, its pickling by reference.
PyObject* shortcut_getattro(PyObject* self, PyObject* name) {
  PyObject* func = reinterpret_cast<Shortcut*>(self)->func;
  if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0)
    return Py_NewRef(func);
  return PyObject_GetAttr(func, name);
}

PyObject* shortcut_repr(PyObject* self) {
  return PyUnicode_FromFormat("<flybatch shortcut to %R>", reinterpret_cast<Shortcut*>(self)->func);
}

// The three types of a torch function standing in (the same layout): a function (Shortcut), a
// method set on a class (MethodShortcut: bound to the instance as a function is; CPython calls
// it unbound, self first, with no bound-method object), the Tensor method of an expression
// (RecordedMethod).
PyObject* method_shortcut_get(PyObject* self, PyObject* obj, PyObject*) {
  if (!obj || obj == Py_None) return Py_NewRef(self);
  return PyMethod_New(self, obj);
}

PyTypeObject wrapper_type(const char* name, const char* doc, bool method, newfunc make) {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;  // a static type; PyType_Ready fills in the rest
  t.tp_name = name;
  t.tp_basicsize = sizeof(Shortcut);
  t.tp_dealloc = shortcut_dealloc;
  t.tp_vectorcall_offset = offsetof(Shortcut, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_getattro = shortcut_getattro;
  t.tp_repr = shortcut_repr;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  if (method) {
    t.tp_descr_get = method_shortcut_get;
    t.tp_flags |= Py_TPFLAGS_METHOD_DESCRIPTOR;
  }
  t.tp_doc = doc;
  t.tp_traverse = shortcut_traverse;
  t.tp_new = make;
  return t;
}

PyTypeObject ShortcutType = wrapper_type(
    "flybatch._core.Shortcut",
    "Shortcut(func): func, with calls on flybatch expressions sent straight to the capture mode "
    "(csrc/dispatch.cpp).",
    false, shortcut_new);
PyTypeObject MethodShortcutType = wrapper_type(
    "flybatch._core.MethodShortcut",
    "MethodShortcut(method): a Shortcut that binds to instances as a method does.", true,
    shortcut_new);

PyObject* set_capture_level(PyObject*, PyObject* arg) {
  const long long level = PyLong_AsLongLong(arg);
  if (level == -1 && PyErr_Occurred()) return nullptr;
  t_capture_level = level;
  Py_RETURN_NONE;
}

// ---- recorded methods: the Tensor methods of an expression --------------------------------
// `h.chunk(3, -1)`, `logits.unsqueeze(0)`: a Tensor method called on an expression is recorded
// as its torch function would be (capture.torch_call), in one C call (a Python method frame
// and its own-time wrapper cost as much as the recording). Set on graph.Expression by
// capture/tensor_like.py; bound as a function is.
PyObject* recorded_method_call(PyObject* self, PyObject* const* args, std::size_t nargsf,
                               PyObject* kwnames) {
  PyObject* func = reinterpret_cast<Shortcut*>(self)->func;
  return guarded([&]() -> PyObject* {
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 1 && !kwnames)  // x.sigmoid()
      if (PyObject* out = record_unary_call(func, args[0])) return out;
    if (PyErr_Occurred()) throw PythonError{};
    CallParts call(args, nargs, kwnames);
    return record_torch_call(func, call.args.get(), call.kwargs.get());
  });
}

PyObject* recorded_method_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* self = shortcut_new(type, args, kwargs);
  if (self) reinterpret_cast<Shortcut*>(self)->vectorcall = recorded_method_call;
  return self;
}

PyTypeObject RecordedMethodType = wrapper_type(
    "flybatch._core.RecordedMethod",
    "RecordedMethod(tensor_method): the method of an expression that records "
    "tensor_method(self, ...) as a node (capture.torch_call).",
    true, recorded_method_new);

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
  Owned tensor_getitem{PyObject_GetAttrString(g_tensor_type, "__getitem__")};
  if (!tensor_getitem.get()) return nullptr;
  Py_XSETREF(g_tensor_getitem, tensor_getitem.release());
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
  if (!g_no_types && !(g_no_types = PyTuple_New(0))) return nullptr;
  Py_XSETREF(g_mode_class, Py_NewRef(mode_class));
  Py_XSETREF(g_torch_handle, Py_NewRef(torch_handle));
  Py_RETURN_NONE;
}

PyMethodDef kDispatchMethods[] = {
    {"handle_torch_function",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(handle_torch_function)),
     METH_FASTCALL | METH_KEYWORDS, kHandleDoc},
    {"configure_dispatch", configure_dispatch, METH_VARARGS, kConfigureDispatchDoc},
    {"set_capture_level", set_capture_level, METH_O,
     "set_capture_level(n): this thread's torch function mode stack length while the capture "
     "mode is its innermost (capture.mode.push; 0: not capturing)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_dispatch(PyObject* module) {
  s_torch_function = PyUnicode_InternFromString("__torch_function__");
  s_self_attr = PyUnicode_InternFromString("__self__");
  s_module_attr = PyUnicode_InternFromString("__module__");
  s_name_attr = PyUnicode_InternFromString("__name__");
  return s_torch_function && s_self_attr && s_module_attr && s_name_attr &&
         PyType_Ready(&ShortcutType) == 0 && PyType_Ready(&MethodShortcutType) == 0 &&
         PyType_Ready(&RecordedMethodType) == 0 &&
         PyModule_AddObjectRef(module, "RecordedMethod",
                               reinterpret_cast<PyObject*>(&RecordedMethodType)) == 0 &&
         PyModule_AddObjectRef(module, "Shortcut", reinterpret_cast<PyObject*>(&ShortcutType)) == 0 &&
         PyModule_AddObjectRef(module, "MethodShortcut",
                               reinterpret_cast<PyObject*>(&MethodShortcutType)) == 0 &&
         PyModule_AddFunctions(module, kDispatchMethods) == 0;
}

}  // namespace flybatch
