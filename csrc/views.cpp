// Node-free views: a handle that presents another per-instance shape over the same node (the
// Expression's `view`), for the pure reshapes that per-instance torch code writes around the
// [1, n] row of a batch of one: `logits.unsqueeze(0)` before a loss, `x.view(1, -1)`,
// `x.reshape(1, n)[0]`. Recorded as reshape nodes, with the loss's target as an index input
// node, they were ~4.4k of a torch-native Tree-LSTM minibatch's ~43k nodes, each a C append, a
// place in a batch and a copy forward and back. A view is consumed without a node of its own
// where its consumer can read the node as it is:
// - unsqueeze / view / reshape of an expression (a view too): a view of the new shape;
// - `x[0]` (or `x[-1]`) of a view whose first dim is 1: a view of the rest, the node itself
//   where that is the node's shape (rules.cpp's `x[i]` asks here first);
// - F.cross_entropy of a [1, C] view of a [C] node and a one-element target tensor (a class
//   made by `torch.tensor([label])`): the fb op pick_neg_log_softmax of the node, the class
//   held as the node's constant (its kernel is F.cross_entropy: the same values and gradients),
//   instead of a reshape node, an index input node and a loss node.
// Anything else that reads a view's node (Expression.id, an op rule's operand, take_apart, a
// value request) gets its reshape node, made then by the reshape handler (capture.mappings), as
// it was made before views; the handle points at it from then on. That node is made with grad
// enabled, so a view is only made with grad enabled (eagerly a view taken under no_grad
// carries no gradient: it is recorded as a reshape node, as before).
#include "store.h"

namespace flybatch {

namespace {

PyObject* g_materialize = nullptr;      // capture.views._materialize(base, shape)
PyObject* g_pick_nls = nullptr;         // ops.pick_neg_log_softmax
PyObject* g_cross_entropy = nullptr;    // torch.nn.functional.cross_entropy
// Tensor.unsqueeze, torch.unsqueeze; Tensor.view, Tensor.reshape, torch.reshape (compared by
// identity: every recorded call asks)
PyObject* g_unsqueezes[2] = {};
PyObject* g_reshapes[3] = {};
PyObject* g_int64_dtype = nullptr;      // torch.int64
PyObject* s_reduction = nullptr;        // "reduction"
PyObject* s_ignore = nullptr;           // "ignore_index"
PyObject* s_weight = nullptr;           // "weight"
PyObject* s_size_average = nullptr;     // "size_average"
PyObject* s_reduce = nullptr;           // "reduce"
PyObject* s_smoothing = nullptr;        // "label_smoothing"
PyObject* s_sum = nullptr;              // "sum"
PyObject* s_mean = nullptr;             // "mean"
PyObject* s_none = nullptr;             // "none"
PyObject* s_dtype_name = nullptr;       // "dtype"
PyObject* s_shape_name = nullptr;       // "shape"
PyObject* s_is_cpu_name = nullptr;      // "is_cpu"
PyObject* s_item_name = nullptr;        // "item"

bool is_handle(PyObject* x) {
  return g_expression_type && Py_TYPE(x) == reinterpret_cast<PyTypeObject*>(g_expression_type);
}

// The dims of `x` (a view's or its node's) into `dims`.
void dims_of(const Expression* e, std::vector<i64>& dims) {
  std::size_t n = 0;
  const i64* d = shape_dims(e->graph, expression_shape_id(e), &n);
  dims.assign(d, d + n);
}

// The shape `sizes` (ints, one of them may be -1) asks for of `numel` elements, as view and
// reshape read it; false where they would raise (their handler raises torch's error).
bool requested_shape(PyObject* const* sizes, Py_ssize_t n, i64 numel, std::vector<i64>& out) {
  out.clear();
  Py_ssize_t inferred = -1;
  i64 known = 1;
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (!PyLong_CheckExact(sizes[k])) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(sizes[k], &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    if (v == -1 && inferred < 0) {
      inferred = k;
    } else if (v < 0) {
      return false;
    } else {
      known *= v;
    }
    out.push_back(v);
  }
  if (known == 0 || numel == 0) return false;  // (an empty tensor: the handler decides)
  if (inferred >= 0) {
    if (numel % known) return false;
    out[inferred] = numel / known;
  } else if (known != numel) {
    return false;
  }
  return true;
}

PyObject* view_of(Expression* e, const std::vector<i64>& dims) {
  return new_view(e->graph, e->id, intern_shape(e->graph, dims.data(), dims.size()));
}

// A reshape to `dims` of `e`: `e` itself where its shape stays (`x.view(x.shape) is x`, as the
// reshape handler gives it), else a view.
PyObject* reshaped_to(Expression* e, const std::vector<i64>& dims) {
  std::vector<i64> now;
  dims_of(e, now);
  if (now == dims) return Py_NewRef(reinterpret_cast<PyObject*>(e));
  return view_of(e, dims);
}

// unsqueeze / view / reshape of an expression: a view (NULL where the handler decides).
PyObject* reshaped(PyObject* func, PyObject* args, PyObject* kwargs) {
  const bool unsqueeze = func == g_unsqueezes[0] || func == g_unsqueezes[1];
  if (!unsqueeze && func != g_reshapes[0] && func != g_reshapes[1] && func != g_reshapes[2])
    return nullptr;
  Expression* e = reinterpret_cast<Expression*>(PyTuple_GET_ITEM(args, 0));
  if (PyDict_GET_SIZE(kwargs) || e->graph->closed || !grad_enabled() ||
      length_led(e->graph, e->id))
    return nullptr;
  std::vector<i64> dims, out;
  dims_of(e, dims);
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (unsqueeze) {
    if (n != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(args, 1))) return nullptr;
    const long long nd = static_cast<long long>(dims.size());
    long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(args, 1));
    if (d == -1 && PyErr_Occurred()) throw PythonError{};
    if (d < -(nd + 1) || d > nd) return nullptr;  // torch's error, from the handler
    if (d < 0) d += nd + 1;
    dims.insert(dims.begin() + d, 1);
    return view_of(e, dims);
  }
  if (n < 2) return nullptr;
  i64 numel = 1;
  for (i64 d : dims) numel *= d;
  PyObject* sizes = PyTuple_GET_ITEM(args, 1);
  const bool packed = n == 2 && (PyTuple_Check(sizes) || PyList_CheckExact(sizes));
  bool ok;
  if (packed) {
    ok = requested_shape(PySequence_Fast_ITEMS(sizes), PySequence_Fast_GET_SIZE(sizes), numel,
                         out);
  } else {
    ok = requested_shape(&PyTuple_GET_ITEM(args, 1), n - 1, numel, out);
  }
  return ok ? reshaped_to(e, out) : nullptr;
}

// The class held by `target`, a plain int64 CPU tensor of shape (1,); false for anything else.
bool one_class(PyObject* target, long long& label) {
  if (Py_TYPE(target) != reinterpret_cast<PyTypeObject*>(g_tensor_type) ||
      torch_function_mode_enabled())  // (attribute reads would dispatch to the mode)
    return false;
  Owned dtype{PyObject_GetAttr(target, s_dtype_name)};
  if (dtype.get() != g_int64_dtype) return false;
  Owned cpu{PyObject_GetAttr(target, s_is_cpu_name)};
  if (cpu.get() != Py_True) return false;
  Owned size{PyObject_GetAttr(target, s_shape_name)};
  Owned shape{PySequence_Tuple(size.get())};
  if (PyTuple_GET_SIZE(shape.get()) != 1 ||
      PyLong_AsLongLong(PyTuple_GET_ITEM(shape.get(), 0)) != 1) {
    if (PyErr_Occurred()) throw PythonError{};
    return false;
  }
  Owned item{PyObject_CallMethodNoArgs(target, s_item_name)};
  label = PyLong_AsLongLong(item.get());
  if (label == -1 && PyErr_Occurred()) throw PythonError{};
  return true;
}

// F.cross_entropy(view [1, C] of a [C] node, torch.tensor([label]), reduction=..., ...): the
// node's pick_neg_log_softmax (a [1] view of it for reduction='none'); NULL where the handler
// decides (any other call, a class out of range or ignored, which it reports or zeroes).
PyObject* one_class_loss(PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 2) return nullptr;
  Expression* e = reinterpret_cast<Expression*>(PyTuple_GET_ITEM(args, 0));
  if (e->view < 0 || e->graph->closed) return nullptr;
  std::vector<i64> dims;
  dims_of(e, dims);
  std::size_t nd = 0;
  const i64* node_dims = shape_dims(e->graph, e->graph->nodes->shape[e->id], &nd);
  if (dims.size() != 2 || dims[0] != 1 || nd != 1 || node_dims[0] != dims[1]) return nullptr;
  long long ignore = -100;
  PyObject* reduction = s_mean;
  PyObject *name, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &name, &value)) {
    if (!PyUnicode_Check(name)) return nullptr;
    if (PyUnicode_Compare(name, s_reduction) == 0) {
      if (!PyUnicode_CheckExact(value)) return nullptr;
      reduction = value;
    } else if (PyUnicode_Compare(name, s_ignore) == 0) {
      if (!PyLong_CheckExact(value)) return nullptr;
      ignore = PyLong_AsLongLong(value);
      if (ignore == -1 && PyErr_Occurred()) throw PythonError{};
    } else if (PyUnicode_Compare(name, s_weight) == 0 ||
               PyUnicode_Compare(name, s_size_average) == 0 ||
               PyUnicode_Compare(name, s_reduce) == 0) {
      if (value != Py_None) return nullptr;  // (size_average, reduce: the legacy reduction)
    } else if (PyUnicode_Compare(name, s_smoothing) == 0) {
      if (!PyFloat_CheckExact(value) || PyFloat_AS_DOUBLE(value) != 0.0) return nullptr;
    } else {
      return nullptr;
    }
  }
  const bool none = PyUnicode_Compare(reduction, s_none) == 0;
  if (!none && PyUnicode_Compare(reduction, s_sum) != 0 &&
      PyUnicode_Compare(reduction, s_mean) != 0)
    return nullptr;
  long long label = 0;
  if (!one_class(PyTuple_GET_ITEM(args, 1), label) || label == ignore || label < 0 ||
      label >= dims[1])
    return nullptr;
  // the fb op computes in the graph's floating dtype: a node of another is the handler's
  if (of_other_dtype(e->graph, e->id)) return nullptr;
  Owned node{new_expression(e->graph, e->id)};
  Owned index{PyLong_FromLongLong(label)};
  PyObject* call[2] = {node.get(), index.get()};
  Owned loss{PyObject_Vectorcall(g_pick_nls, call, 2, nullptr)};
  if (!none) return loss.release();
  if (!is_handle(loss.get())) raise(PyExc_TypeError, "pick_neg_log_softmax: not an expression");
  const i64 one = 1;
  Expression* l = reinterpret_cast<Expression*>(loss.get());
  return new_view(l->graph, l->id, intern_shape(l->graph, &one, 1));
}

}  // namespace

PyObject* new_view(Store* s, i64 id, std::int32_t shape) {
  PyObject* out = new_expression(s, id);
  if (out && shape != s->nodes->shape[id]) reinterpret_cast<Expression*>(out)->view = shape;
  return out;
}

bool materialize(Expression* e) {
  if (e->view < 0) return true;
  if (!g_materialize) {
    PyErr_SetString(PyExc_RuntimeError, "views: configure_views() was not called");
    return false;
  }
  PyObject* base = new_expression(e->graph, e->id);
  if (!base) return false;
  PyObject* shape = (*e->graph->shape_tuples)[e->view];
  PyObject* node = PyObject_CallFunctionObjArgs(g_materialize, base, shape, nullptr);
  Py_DECREF(base);
  if (!node) return false;
  if (!PyObject_TypeCheck(node, &ExpressionBase) ||
      reinterpret_cast<Expression*>(node)->graph != e->graph ||
      reinterpret_cast<Expression*>(node)->view >= 0) {
    Py_DECREF(node);
    PyErr_SetString(PyExc_TypeError, "views: the reshape of a view is not a node of its graph");
    return false;
  }
  e->id = reinterpret_cast<Expression*>(node)->id;
  e->view = -1;
  Py_DECREF(node);
  return true;
}

PyObject* view_call(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (!g_materialize || PyTuple_GET_SIZE(args) == 0 || !is_handle(PyTuple_GET_ITEM(args, 0)))
    return nullptr;
  if (func == g_cross_entropy) return one_class_loss(args, kwargs);
  return reshaped(func, args, kwargs);
}

// `x[0]` / `x[-1]` of a view whose first dim is 1, with grad enabled: a view of the rest. NULL
// (no error) for anything else, which the `x[i]` rule decides (under no_grad: a pick node
// without gradient, as eagerly, where the view would be its base's node itself).
PyObject* view_getitem(PyObject* x, PyObject* index) {
  if (!is_handle(x) || !PyLong_CheckExact(index)) return nullptr;
  Expression* e = reinterpret_cast<Expression*>(x);
  if (e->view < 0 || e->graph->closed) return nullptr;
  try {
    if (!grad_enabled()) return nullptr;
  } catch (const PythonError&) {
    return nullptr;  // (the error stays set: the caller returns it)
  }
  const long long at = PyLong_AsLongLong(index);
  if (at == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return nullptr;
  }
  std::vector<i64> dims;
  dims_of(e, dims);
  if (dims.empty() || dims[0] != 1 || (at != 0 && at != -1)) return nullptr;
  dims.erase(dims.begin());
  return view_of(e, dims);
}

namespace {

const char kConfigureViewsDoc[] =
    "configure_views(materialize, pick_neg_log_softmax, cross_entropy, unsqueezes, reshapes, "
    "int64)\n\n"
    "What node-free views call and recognise: the function making a view's reshape node "
    "(base, shape) -> Expression, the fb op a one-class cross-entropy becomes, F.cross_entropy, "
    "the unsqueeze functions (2) and the view / reshape functions (3), tuples, and torch.int64.";

PyObject* configure_views(PyObject*, PyObject* args) {
  PyObject *materialize_fn, *pick, *cross_entropy, *unsqueezes, *reshapes, *int64;
  if (!PyArg_ParseTuple(args, "OOOO!O!O:configure_views", &materialize_fn, &pick,
                        &cross_entropy, &PyTuple_Type, &unsqueezes, &PyTuple_Type, &reshapes,
                        &int64))
    return nullptr;
  if (PyTuple_GET_SIZE(unsqueezes) != 2 || PyTuple_GET_SIZE(reshapes) != 3) {
    PyErr_SetString(PyExc_TypeError, "configure_views: 2 unsqueeze and 3 reshape functions");
    return nullptr;
  }
  Py_XSETREF(g_materialize, Py_NewRef(materialize_fn));
  Py_XSETREF(g_pick_nls, Py_NewRef(pick));
  Py_XSETREF(g_cross_entropy, Py_NewRef(cross_entropy));
  for (Py_ssize_t k = 0; k < 2; ++k)
    Py_XSETREF(g_unsqueezes[k], Py_NewRef(PyTuple_GET_ITEM(unsqueezes, k)));
  for (Py_ssize_t k = 0; k < 3; ++k)
    Py_XSETREF(g_reshapes[k], Py_NewRef(PyTuple_GET_ITEM(reshapes, k)));
  Py_XSETREF(g_int64_dtype, Py_NewRef(int64));
  Py_RETURN_NONE;
}

PyObject* is_view(PyObject*, PyObject* x) {
  return PyBool_FromLong(PyObject_TypeCheck(x, &ExpressionBase) &&
                         reinterpret_cast<Expression*>(x)->view >= 0);
}

PyMethodDef kViewMethods[] = {
    {"configure_views", configure_views, METH_VARARGS, kConfigureViewsDoc},
    {"is_view", is_view, METH_O,
     "is_view(x) -> bool: whether x is a node-free view (its node not made yet)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_views(PyObject* module) {
  struct Name {
    PyObject** slot;
    const char* text;
  };
  const Name names[] = {{&s_reduction, "reduction"}, {&s_ignore, "ignore_index"},
                        {&s_weight, "weight"},       {&s_smoothing, "label_smoothing"},
                        {&s_size_average, "size_average"}, {&s_reduce, "reduce"},
                        {&s_sum, "sum"},             {&s_mean, "mean"},
                        {&s_none, "none"},           {&s_dtype_name, "dtype"},
                        {&s_shape_name, "shape"},    {&s_is_cpu_name, "is_cpu"},
                        {&s_item_name, "item"}};
  for (const Name& n : names)
    if (!(*n.slot = PyUnicode_InternFromString(n.text))) return false;
  return PyModule_AddFunctions(module, kViewMethods) == 0;
}

}  // namespace flybatch
