// Torch-native capture, the per-call part (flybatch/capture/): a recorded torch call taken
// apart in one pass over its arguments.
//
// `take_apart(graph, args, kwargs, weights)` returns
//   (args template, kwargs template, nodes, operands, params, weight, key)
// where every tensor operand (an Expression, or a torch.Tensor resolved to its node as the op
// rules resolve operands: parameters by a C map, anything else, a tensor written in place with
// an expression (`Graph.shadows`) among them, through `Graph._operand`) is replaced by a
// `_Slot(i)` in the templates; `operands[i]` is its (shape, dtype), `params[i]` whether it is
// a parameter node and `weight[i]` whether it came from an argument named in `weights`; `key` is
// a flat tuple of the call's constants and structure ("#" per operand, "(" / "[" ... ")" around
// sequences, "|" before the keywords), constants other than int / str / None keyed by
// capture's `_key`. Called for every recorded torch call: the Python version cost ~3 us.
//
// With a handler, the call's plan (capture.direct._PLANS, keyed by handler, key, operands, params)
// is looked up in the same pass: a `_Plan` appends its node here (`append_planned`), anything else
// stored there (NotImplemented, a recipe the handler applies itself) is returned as it is.
#include "rules.h"
#include "store.h"

#include <cstring>
#include <memory>
#include <string_view>

namespace flybatch {

i64 operand_node(Store* g, PyObject* x);  // rules.cpp: an operand's node (may call Python)

// Records func(*args, **kwargs) (a dict), capture.torch_call; defined below, after the rules.
PyObject* record_torch_call(PyObject* func, PyObject* args, PyObject* kwargs);

namespace {

PyObject* g_slot_type = nullptr;        // capture.calls._Slot
PyObject* g_key_of = nullptr;           // capture._key
PyObject* g_parameter_op = nullptr;     // graph.PARAMETER
PyObject* g_node_of_tensor = nullptr;   // Graph._operand (shadowed tensors)
PyObject* g_plans = nullptr;            // capture.direct._PLANS
PyObject* g_plan_type = nullptr;        // capture.direct._Plan
// _Slot(0), _Slot(1)...: a slot is never changed once made, so calls share them (making one
// is a Python call, ~0.1 us, and most calls have a few operands).
constexpr Py_ssize_t kSharedSlots = 16;
PyObject* g_slots[kSharedSlots] = {};
PyObject* s_fast = nullptr;             // "fast"
PyObject* s_add = nullptr;              // "add"
PyObject* s_shadows = nullptr;          // "shadows"
PyObject* s_dtype = nullptr;            // "dtype"
PyObject* s_hash = nullptr;             // "#"
PyObject* s_open_tuple = nullptr;       // "("
PyObject* s_open_list = nullptr;        // "["
PyObject* s_close = nullptr;            // ")"
PyObject* s_bar = nullptr;              // "|"
PyObject* s_slice = nullptr;            // "slice"
PyObject* s_float = nullptr;            // "float"
PyObject* s_bool = nullptr;             // "bool"
PyObject* s_requires_grad = nullptr;    // "requires_grad"
PyObject* s_is_leaf = nullptr;          // "is_leaf"
PyObject* s_shadow_storages = nullptr;  // "shadow_storages"
PyObject* s_untyped_storage = nullptr;  // "untyped_storage"
PyObject* s_data_ptr = nullptr;         // "data_ptr"
PyObject* s_write_through = nullptr;    // "write_through"
PyObject* s_dunder = nullptr;           // "__"
PyObject* g_index_input_op = nullptr;   // graph.INDEX_INPUT
PyObject* g_index_dtypes = nullptr;     // graph._INDEX_DTYPES (a frozenset)
PyObject* s_is_cpu = nullptr;           // "is_cpu"
PyObject* s_shape_attr = nullptr;       // "shape"
PyObject* s_index_input = nullptr;      // "index input"
PyObject* s_item = nullptr;             // "item"

void append(PyObject* list, PyObject* item) {  // borrows item
  if (PyList_Append(list, item) < 0) throw PythonError{};
}

// isinstance(x, torch.Tensor), without the metaclass's __instancecheck__ call (~500
// instructions) for the common cases: a tensor (or subclass) by its type, and the plain scalars
// and containers that fill argument lists (torch.Tensor's metaclass makes no virtual
// subclasses).
bool is_tensor(PyObject* x) {
  if (PyType_IsSubtype(Py_TYPE(x), reinterpret_cast<PyTypeObject*>(g_tensor_type))) return true;
  if (PyLong_CheckExact(x) || PyFloat_CheckExact(x) || x == Py_None || PyBool_Check(x) ||
      PyUnicode_CheckExact(x) || PyList_CheckExact(x) || PyTuple_CheckExact(x) ||
      PyDict_CheckExact(x) || PySlice_Check(x) || PyObject_TypeCheck(x, &ExpressionBase))
    return false;
  const int tensor = PyObject_IsInstance(x, g_tensor_type);
  if (tensor < 0) throw PythonError{};
  return tensor;
}

// Graph.dtype (a new reference): the graph's `_dtype` once fixed, without calling the property
// (a Python call, twice per recorded call otherwise); the property while it is not.
PyObject* graph_dtype(PyObject* graph) {
  PyObject* fixed = graph_fixed_dtype(reinterpret_cast<Store*>(graph));
  if (fixed != Py_None) return Py_NewRef(fixed);
  return checked(PyObject_GetAttr(graph, s_dtype));
}

// A one-element integer tensor on the CPU (a class target, a row, `torch.tensor([label])` made
// afresh at every call): its node, an INDEX_INPUT holding the int the tensor holds now, as
// Graph.input_node makes it, without input_node's Python (~2 us per target). Read only while
// no torch function mode is on (a call is recorded with the capture mode off torch's stack),
// so that reading the tensor dispatches to nothing (index_input; -1 where it does not apply).
// `index_value` reads what such a tensor holds (its shape, all ones, its dtype and value)
// without making its node, which the planned path makes only where the call's plan is known.
struct IndexValue {
  PyObject* shape = nullptr;  // owned, as are dtype and value once set
  PyObject* dtype = nullptr;
  PyObject* value = nullptr;
  IndexValue() = default;
  IndexValue(IndexValue&& o) noexcept
      : shape(std::exchange(o.shape, nullptr)), dtype(std::exchange(o.dtype, nullptr)),
        value(std::exchange(o.value, nullptr)) {}
  IndexValue(const IndexValue&) = delete;
  ~IndexValue() {
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(value);
  }
};

bool index_value(PyObject* x, IndexValue& out) {  // false: not an index input
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(g_tensor_type) ||
      torch_function_mode_enabled())
    return false;
  Owned dtype{PyObject_GetAttr(x, s_dtype)};
  const int index = PySet_Contains(g_index_dtypes, dtype.get());
  if (index < 0) throw PythonError{};
  if (!index || Owned{PyObject_GetAttr(x, s_is_cpu)}.get() != Py_True) return false;
  Owned size{PyObject_GetAttr(x, s_shape_attr)};
  Owned shape{PySequence_Tuple(size.get())};
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape.get()); ++i)
    if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape.get(), i)) != 1) {
      if (PyErr_Occurred()) throw PythonError{};
      return false;  // not one element
    }
  // (`x.item()`: an int for these dtypes, in a third of the time of int(x))
  Owned item{PyObject_CallMethodNoArgs(x, s_item)};
  out.value = checked(PyNumber_Long(item.get()));
  out.shape = shape.release();
  out.dtype = dtype.release();
  return true;
}

i64 add_index_input(PyObject* graph, const IndexValue& v) {
  Store* g = reinterpret_cast<Store*>(graph);
  check_open(g);
  SmallInts<8> dims;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v.shape); ++i)
    dims.push(PyLong_AsLongLong(PyTuple_GET_ITEM(v.shape, i)));
  const i64 value = PyLong_AsLongLong(v.value);
  if (PyErr_Occurred()) throw PythonError{};
  const std::int32_t op = op_code(g_index_input_op);
  const std::int32_t shape = intern_shape(g, dims.data(), dims.size());
  Key key;  // (the signature Graph.input_node gives it: its shape and dtype)
  key.push(op);
  key.push(shape);
  key.push(reinterpret_cast<i64>(v.dtype));
  const i64 sig = signature(g, key, /*no_grad=*/false, [&] {
    return checked(PyTuple_Pack(3, s_index_input, v.shape, v.dtype));
  });
  Owned out{flybatch::append(g, op, nullptr, 0, shape, sig, Py_None, /*no_grad=*/false, value)};
  const i64 node = reinterpret_cast<Expression*>(out.get())->id;
  set_node_dtype(g, node, v.dtype);
  return node;
}

i64 index_input(PyObject* graph, PyObject* x) {
  IndexValue v;
  return index_value(x, v) ? add_index_input(graph, v) : -1;
}

constexpr i64 kDeferredNode = -2;  // an index input whose node is not made yet

// One pass over one call.
struct TakeApart {
  Store* g;
  PyObject* graph;       // g as an object
  PyObject* shadows;     // the graph's dict, or NULL when empty
  PyObject* nodes;       // lists, filled as operands are met
  PyObject* operands;
  PyObject* params;
  PyObject* weight;
  PyObject* key;
  std::int32_t parameter_code;
  // Where set (the planned path), index inputs are read but their nodes not made: each is
  // (its position among the operands, what it holds), its node made once the plan is known.
  std::vector<std::pair<Py_ssize_t, IndexValue>>* deferred = nullptr;

  i64 tensor_node(PyObject* x) {
    if (shadows) {
      PyObject* id = PyLong_FromVoidPtr(x);
      if (!id) throw PythonError{};
      const int shadowed = PyDict_Contains(shadows, id);
      Py_DECREF(id);
      if (shadowed < 0) throw PythonError{};
      if (shadowed) {
        Owned node{PyObject_CallFunctionObjArgs(g_node_of_tensor, graph, x, nullptr)};
        const i64 v = PyLong_AsLongLong(node.get());
        if (v == -1 && PyErr_Occurred()) throw PythonError{};
        return v;
      }
    }
    if (deferred) {
      IndexValue v;
      if (!index_value(x, v)) return operand_node(g, x);
      deferred->emplace_back(PyList_GET_SIZE(nodes), std::move(v));
      return kDeferredNode;
    }
    const i64 index = index_input(graph, x);
    return index >= 0 ? index : operand_node(g, x);
  }

  PyObject* slot(i64 node, bool from_weight) {  // new reference: the _Slot
    append(key, s_hash);
    const Py_ssize_t at = PyList_GET_SIZE(nodes);
    Owned id{PyLong_FromLongLong(node)};
    append(nodes, id.get());
    append(weight, from_weight ? Py_True : Py_False);
    if (at < kSharedSlots && g_slots[at]) return Py_NewRef(g_slots[at]);
    Owned index{PyLong_FromSsize_t(at)};
    PyObject* made = PyObject_CallOneArg(g_slot_type, index.get());
    if (made && at < kSharedSlots) g_slots[at] = Py_NewRef(made);
    return made;
  }

  // (shape, dtype) and parameter flag of every operand, once all are resolved: resolving a
  // parameter may fix the graph's dtype (the first floating one met), so it is read after.
  void describe_operands() {
    Owned dtype{graph_dtype(graph)};
    const Py_ssize_t n = PyList_GET_SIZE(nodes);
    std::size_t next_deferred = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* id = PyList_GET_ITEM(nodes, i);
      const i64 node = PyLong_AsLongLong(id);
      if (node == kDeferredNode) {
        const IndexValue& v = (*deferred)[next_deferred++].second;
        Owned operand{PyTuple_Pack(2, v.shape, v.dtype)};
        append(operands, operand.get());
        append(params, Py_False);
        continue;
      }
      PyObject* node_dtype = flybatch::node_dtype(g, node);  // borrowed
      PyObject* shape = (*g->shape_tuples)[g->nodes->shape[node]];
      Owned operand{PyTuple_Pack(2, shape, node_dtype ? node_dtype : dtype.get())};
      append(operands, operand.get());
      append(params, g->nodes->op[node] == parameter_code ? Py_True : Py_False);
    }
  }

  PyObject* templ(PyObject* x, bool from_weight) {  // new reference
    if (PyLong_CheckExact(x) || PyUnicode_CheckExact(x) || x == Py_None) {
      append(key, x);
      return Py_NewRef(x);
    }
    if (PyObject_TypeCheck(x, &ExpressionBase)) {
      Expression* e = reinterpret_cast<Expression*>(x);
      // (a view: its reshape node; another graph's expression raises)
      return slot(e->graph == g ? expression_node(e) : operand_node(g, x), from_weight);
    }
    if (is_tensor(x)) return slot(tensor_node(x), from_weight);
    const bool is_tuple = PyTuple_CheckExact(x), is_list = PyList_CheckExact(x);
    if (is_tuple || is_list) {
      append(key, is_tuple ? s_open_tuple : s_open_list);
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
      Owned out{is_tuple ? PyTuple_New(n) : PyList_New(n)};
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = templ(PySequence_Fast_GET_ITEM(x, i), from_weight);
        if (!item) throw PythonError{};
        if (is_tuple)
          PyTuple_SET_ITEM(out.get(), i, item);
        else
          PyList_SET_ITEM(out.get(), i, item);
      }
      append(key, s_close);
      return out.release();
    }
    if (PySlice_Check(x)) {  // ("slice", start, stop, step) when those are ints or None, as _key
      PySliceObject* sl = reinterpret_cast<PySliceObject*>(x);
      auto plain = [](PyObject* v) { return v == Py_None || PyLong_CheckExact(v); };
      if (plain(sl->start) && plain(sl->stop) && plain(sl->step)) {
        Owned k{PyTuple_Pack(4, s_slice, sl->start, sl->stop, sl->step)};
        append(key, k.get());
        return Py_NewRef(x);
      }
    }
    // A float or bool keyed as _key keys it, without its Python call: F.* functions pass
    // constants such as `label_smoothing=0.0` to every call.
    if (PyFloat_CheckExact(x) || PyBool_Check(x)) {
      const bool is_float = PyFloat_CheckExact(x);
      Owned part{is_float ? checked(PyObject_Repr(x)) : Py_NewRef(x)};
      Owned k{PyTuple_Pack(2, is_float ? s_float : s_bool, part.get())};
      append(key, k.get());
      return Py_NewRef(x);
    }
    Owned k{PyObject_CallOneArg(g_key_of, x)};
    append(key, k.get());
    return Py_NewRef(x);
  }
};

bool in_weights(PyObject* weights, PyObject* which) {
  if (weights == Py_None || PyTuple_GET_SIZE(weights) == 0) return false;
  const int found = PySequence_Contains(weights, which);
  if (found < 0) throw PythonError{};
  return found;
}

// The node of a call by its handler's plan over operand nodes `nodes`: `plan.fast` is (head,
// op, shape, dtype, attr, shared_at); the signature is the tuple `head` followed by the nodes of
// the shared operands. The first node of a plan in a graph is appended so; later ones, as that
// one was (LearntPlan), without the plan's tuple or a Python signature key (grad mode on).
PyObject* append_planned(Store* g, PyObject* plan, const i64* nodes, std::size_t n) {
  check_open(g);
  const bool grad = grad_enabled();
  auto learnt = g->learnt_plans->find(plan);
  if (grad && learnt != g->learnt_plans->end()) {
    const LearntPlan& known = *learnt->second;
    bool same = true;
    for (const auto& [at, node] : known.shared) same = same && at < n && nodes[at] == node;
    if (same) {
      Owned out{flybatch::append(g, known.op, nodes, n, known.shape, known.sig,
                                 known.attr ? known.attr : Py_None, /*no_grad=*/false)};
      if (known.own_dtype)
        set_node_dtype(g, reinterpret_cast<Expression*>(out.get())->id, known.own_dtype);
      return out.release();
    }
  }
  Owned fast{PyObject_GetAttr(plan, s_fast)};
  if (!PyTuple_Check(fast.get()) || PyTuple_GET_SIZE(fast.get()) != 6 ||
      !PyTuple_Check(PyTuple_GET_ITEM(fast.get(), 0)))
    raise(PyExc_TypeError, "append_planned: plan.fast must be a 6-tuple (head: a tuple)");
  PyObject* head = PyTuple_GET_ITEM(fast.get(), 0);
  const Py_ssize_t n_head = PyTuple_GET_SIZE(head);
  PyObject* shared_at = PyTuple_GET_ITEM(fast.get(), 5);
  const Py_ssize_t n_shared = PyTuple_GET_SIZE(shared_at);
  Owned sig{PyTuple_New(n_head + n_shared)};
  for (Py_ssize_t i = 0; i < n_head; ++i)
    PyTuple_SET_ITEM(sig.get(), i, Py_NewRef(PyTuple_GET_ITEM(head, i)));
  std::vector<std::pair<std::size_t, i64>> shared;
  for (Py_ssize_t i = 0; i < n_shared; ++i) {
    const Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(shared_at, i));
    if (at < 0 || static_cast<std::size_t>(at) >= n) raise(PyExc_IndexError, "plan.shared_at");
    shared.emplace_back(at, nodes[at]);
    PyTuple_SET_ITEM(sig.get(), n_head + i, checked(PyLong_FromLongLong(nodes[at])));
  }
  Owned args{PyTuple_New(static_cast<Py_ssize_t>(n))};
  for (std::size_t k = 0; k < n; ++k)
    PyTuple_SET_ITEM(args.get(), k, checked(PyLong_FromLongLong(nodes[k])));
  PyObject* graph = reinterpret_cast<PyObject*>(g);
  PyObject* add_args[6] = {graph, PyTuple_GET_ITEM(fast.get(), 1), args.get(),
                           PyTuple_GET_ITEM(fast.get(), 2),
                           sig.get(), PyTuple_GET_ITEM(fast.get(), 4)};
  Owned out{
      PyObject_VectorcallMethod(s_add, add_args, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr)};
  // Outputs not of the graph's floating dtype (indices, masks) are recorded per node.
  PyObject* dtype = PyTuple_GET_ITEM(fast.get(), 3);
  Owned fixed{graph_dtype(graph)};
  const i64 node = reinterpret_cast<Expression*>(out.get())->id;
  if (dtype != fixed.get()) set_node_dtype(g, node, dtype);
  // Learnt once the graph's dtype is fixed (a node's "own" dtype is relative to it).
  const Columns& c = *g->nodes;
  if (learnt == g->learnt_plans->end() && !c.no_grad[node] &&
      graph_fixed_dtype(g) != Py_None) {
    auto known = std::make_unique<LearntPlan>();
    known->op = c.op[node];
    known->shape = c.shape[node];
    known->sig = c.sig[node];
    known->attr = Py_XNewRef((*g->attrs)[node]);
    known->own_dtype = dtype != fixed.get() ? Py_NewRef(dtype) : nullptr;
    known->shared = std::move(shared);
    known->plan = Py_NewRef(plan);
    g->learnt_plans->emplace(plan, known.release());
  }
  return out.release();
}

PyObject* append_planned(PyObject* graph, PyObject* plan, PyObject* nodes) {
  if (!PyTuple_Check(nodes)) raise(PyExc_TypeError, "append_planned: nodes must be a tuple");
  SmallInts<8> ids;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(nodes); ++k) {
    const i64 id = PyLong_AsLongLong(PyTuple_GET_ITEM(nodes, k));
    if (id == -1 && PyErr_Occurred()) throw PythonError{};
    if (id < 0 || id >= n_nodes(reinterpret_cast<Store*>(graph)))
      raise(PyExc_IndexError, "append_planned: node %lld is not in this graph",
            static_cast<long long>(id));
    ids.push(id);
  }
  return append_planned(reinterpret_cast<Store*>(graph), plan, ids.data(), ids.size());
}

const char kAppendPlannedDoc[] =
    "append_planned(graph, plan, nodes) -> Expression\n\n"
    "The node of a capture `_Plan` over the operand nodes `nodes` (a tuple), as take_apart "
    "appends it on a hit.";

PyObject* append_planned_binding(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  return guarded([&]() -> PyObject* {
    if (argc != 3 || !PyObject_TypeCheck(argv[0], &StoreType))
      raise(PyExc_TypeError, "append_planned(graph, plan, nodes: tuple)");
    return append_planned(argv[0], argv[1], argv[2]);  // (which checks the graph is open)
  });
}

const char kTakeApartDoc[] =
    "take_apart(graph, args, kwargs, weights, handler=None)\n\n"
    "(args template, kwargs template, nodes, operands, params, weight, key) of a torch call "
    "recorded by the capture layer (see capture/calls.py `_Call`) in `graph` "
    "(None: the graph of its "
    "operands, as capture.calls._graph_of). With `handler`, and a plan of "
    "(handler, key, operands, params) in capture.direct._PLANS: the node appended by that plan if "
    "it is a `_Plan`, else the stored object itself (NotImplemented if the handler declined that "
    "key, or a recipe of the handler's own).";

// The graph of a call's operands, as capture.calls._graph_of finds it: the first expression's among
// the arguments (one level into a list or tuple), then the keywords'; else the current graph.
PyObject* graph_of_call(PyObject* args, PyObject* kwargs) {  // a new reference
  auto in = [](PyObject* x) -> PyObject* {
    if (PyObject_TypeCheck(x, &ExpressionBase))
      return reinterpret_cast<PyObject*>(reinterpret_cast<Expression*>(x)->graph);
    if (PyList_CheckExact(x) || PyTuple_CheckExact(x))
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(x); ++i)
        if (PyObject_TypeCheck(PySequence_Fast_GET_ITEM(x, i), &ExpressionBase))
          return reinterpret_cast<PyObject*>(
              reinterpret_cast<Expression*>(PySequence_Fast_GET_ITEM(x, i))->graph);
    return nullptr;
  };
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i)
    if (PyObject* g = in(PyTuple_GET_ITEM(args, i))) return Py_NewRef(g);
  PyObject *name, *value;
  Py_ssize_t pos = 0;
  while (kwargs != Py_None && PyDict_Next(kwargs, &pos, &name, &value))
    if (PyObject* g = in(value)) return Py_NewRef(g);
  return checked(PyObject_CallNoArgs(g_current_graph));
}

// take_apart, telling `planned` the `_Plan` it appended by (else leaving `*plan_used` NULL).
// With `defer`, the index inputs' nodes are made only where a `_Plan` appends the call's node:
// a call without one gives Ellipsis, having made no node (its handler takes it apart again).
PyObject* take_apart_call(PyObject* const* argv, Py_ssize_t argc, PyObject** plan_used,
                          bool defer = false) {
  return guarded([&]() -> PyObject* {
    if (argc < 4 || argc > 5 || !PyTuple_Check(argv[1]) ||
        !(argv[2] == Py_None || PyDict_Check(argv[2])) || !PyTuple_Check(argv[3]))
      raise(PyExc_TypeError,
            "take_apart(graph, args: tuple, kwargs: dict, weights: tuple, handler=None)");
    if (!g_slot_type) raise(PyExc_RuntimeError, "take_apart: configure_capture() was not called");
    Owned graph{argv[0] == Py_None ? graph_of_call(argv[1], argv[2]) : Py_NewRef(argv[0])};
    if (!PyObject_TypeCheck(graph.get(), &StoreType))
      raise(PyExc_TypeError, "take_apart: graph must be a flybatch Graph or None");
    Store* g = reinterpret_cast<Store*>(graph.get());
    check_open(g);
    TakeApart t{};
    t.g = g;
    t.graph = graph.get();
    t.shadows = graph_has_shadows(g) ? g->shadows : nullptr;
    Owned nodes{PyList_New(0)}, operands{PyList_New(0)}, params{PyList_New(0)},
        weight{PyList_New(0)}, key{PyList_New(0)};
    t.nodes = nodes.get();
    t.operands = operands.get();
    t.params = params.get();
    t.weight = weight.get();
    t.key = key.get();
    t.parameter_code = op_code(g_parameter_op);
    std::vector<std::pair<Py_ssize_t, IndexValue>> deferred;
    if (defer) t.deferred = &deferred;

    PyObject* args = argv[1];
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    Owned args_template{PyTuple_New(n)};
    for (Py_ssize_t i = 0; i < n; ++i) {
      Owned position{PyLong_FromSsize_t(i)};
      PyObject* item = t.templ(PyTuple_GET_ITEM(args, i), in_weights(argv[3], position.get()));
      if (!item) throw PythonError{};
      PyTuple_SET_ITEM(args_template.get(), i, item);
    }
    Owned kwargs_template{PyDict_New()};
    if (argv[2] != Py_None && PyDict_GET_SIZE(argv[2])) {
      append(key.get(), s_bar);
      PyObject *name, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(argv[2], &pos, &name, &value)) {
        append(key.get(), name);
        Owned item{t.templ(value, in_weights(argv[3], name))};
        if (PyDict_SetItem(kwargs_template.get(), name, item.get()) < 0) throw PythonError{};
      }
    }
    t.describe_operands();
    Owned key_tuple{PyList_AsTuple(key.get())};
    Owned operands_tuple{PyList_AsTuple(operands.get())},
        params_tuple{PyList_AsTuple(params.get())}, weight_tuple{PyList_AsTuple(weight.get())};
    auto make_deferred = [&] {  // their nodes, in the operands' order
      for (const auto& [at, v] : deferred) {
        Owned id{PyLong_FromLongLong(add_index_input(graph.get(), v))};
        if (PyList_SetItem(nodes.get(), at, id.release()) < 0) throw PythonError{};
      }
    };
    if (argc == 5 && argv[4] != Py_None) {  // a handler's call: its plan, if it has one
      Owned plan_key{PyTuple_Pack(4, argv[4], key_tuple.get(), operands_tuple.get(),
                                  params_tuple.get())};
      PyObject* plan = PyDict_GetItemWithError(g_plans, plan_key.get());  // borrowed
      if (!plan && PyErr_Occurred()) throw PythonError{};
      if (plan && Py_TYPE(plan) == reinterpret_cast<PyTypeObject*>(g_plan_type)) {
        make_deferred();
        Owned nodes_tuple{PyList_AsTuple(nodes.get())};
        PyObject* out = append_planned(graph.get(), plan, nodes_tuple.get());
        if (plan_used) *plan_used = Py_NewRef(plan);  // (a new reference)
        return out;
      }
      if (plan) return Py_NewRef(plan);  // NotImplemented, or a recipe the handler applies
    }
    if (!deferred.empty()) return Py_NewRef(Py_Ellipsis);
    Owned nodes_tuple{PyList_AsTuple(nodes.get())};
    return PyTuple_Pack(7, args_template.get(), kwargs_template.get(), nodes_tuple.get(),
                        operands_tuple.get(), params_tuple.get(), weight_tuple.get(),
                        key_tuple.get());
  });
}

PyObject* take_apart(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  return take_apart_call(argv, argc, nullptr);
}

const char kConfigureDoc[] =
    "configure_capture(slot_type, key_of, parameter_op, node_of_tensor, plans, plan_type, "
    "index_input_op, index_dtypes)\n\n"
    "What take_apart builds and calls: capture.calls._Slot, capture._key, "
    "graph.PARAMETER, Graph._operand, capture.direct._PLANS, capture.direct._Plan, "
    "graph.INDEX_INPUT, graph._INDEX_DTYPES.";

PyObject* configure_capture(PyObject*, PyObject* args) {
  PyObject *slot_type, *key_of, *parameter_op, *node_of_tensor, *plans, *plan_type,
      *index_input_op, *index_dtypes;
  if (!PyArg_ParseTuple(args, "OOOOO!O!OO!:configure_capture", &slot_type, &key_of,
                        &parameter_op, &node_of_tensor, &PyDict_Type, &plans, &PyType_Type,
                        &plan_type, &index_input_op, &PyFrozenSet_Type, &index_dtypes))
    return nullptr;
  Py_XSETREF(g_index_input_op, Py_NewRef(index_input_op));
  Py_XSETREF(g_index_dtypes, Py_NewRef(index_dtypes));
  Py_XSETREF(g_plans, Py_NewRef(plans));
  Py_XSETREF(g_plan_type, Py_NewRef(plan_type));
  if (slot_type != g_slot_type)
    for (PyObject*& slot : g_slots) Py_CLEAR(slot);
  Py_XSETREF(g_slot_type, Py_NewRef(slot_type));
  Py_XSETREF(g_key_of, Py_NewRef(key_of));
  Py_XSETREF(g_parameter_op, Py_NewRef(parameter_op));
  Py_XSETREF(g_node_of_tensor, Py_NewRef(node_of_tensor));
  Py_RETURN_NONE;
}

// ---- the capture mode's front end -------------------------------------------------------
// `_Capture.__torch_function__`: every torch call inside a graph block comes here first (~31k
// per Tree-LSTM minibatch), most of them to be recorded, the rest (`torch.tensor([3])`) to run
// as they are. Deciding which in Python cost ~0.5-1 us a call; here it is a few type checks.
// The rules (capture/mode.py's comments say why each is there):
//   * an Expression type among `types`: recorded;
//   * a property read (`__get__`) other than those that compute a tensor (T, mT, H, mH): runs,
//     but one in capture.mode._READS_VALUE (`data`, `requires_grad`) of a shadowed tensor is
//     recorded;
//   * a name in capture.mode._DESCRIBE or capture.mode._REBINDS: runs, and a rebind (a name in
//     _REBINDS, or `__set__` of an attribute in _REBOUND_ATTRIBUTES) first makes the live graphs
//     forget its tensor (capture._forget); but a name in capture.mode._READS_VALUE (`item`,
//     `tolist`, `__repr__`, `detach`...) on a tensor shadowed in the current graph is recorded: the
//     tensor's own storage still holds what it held before the graph wrote into it;
//   * otherwise recorded if a tensor among the arguments (positional, one level into a list or
//     tuple, keyword) is shadowed in the current graph (Graph.shadows, by id), or is a leaf
//     parameter that requires grad, unless the call writes in place or an optimizer's step runs
//     (capture.mode._thread.optimizer_step).
// A recorded call goes to torch_call(func, args, kwargs) (below); any other runs as
// func(*args, **kwargs) (torch has taken the mode off its stack while we run).
PyObject* g_describe = nullptr;         // capture.mode._DESCRIBE (a frozenset of names)
PyObject* g_reads_value = nullptr;      // capture.mode._READS_VALUE (names of _DESCRIBE)
PyObject* g_rebinds = nullptr;          // capture.mode._REBINDS
PyObject* g_recorded_properties = nullptr;  // capture.mode._RECORDED_PROPERTIES
PyObject* g_rebound_attributes = nullptr;   // capture.mode._REBOUND_ATTRIBUTES
PyObject* g_forget = nullptr;           // capture._forget
PyObject* g_before_write = nullptr;     // capture.mode._before_write
PyObject* g_current = nullptr;          // graph._current (a ContextVar)
PyObject* g_thread = nullptr;           // capture.mode._thread (a threading.local)
PyObject* g_handlers = nullptr;         // capture._HANDLERS: torch function -> its handler
PyObject* g_refuse_inplace = nullptr;   // capture.dispatch._refuse_inplace
PyObject* g_refuse_autocast = nullptr;  // capture.dispatch._refuse_autocast
PyObject* g_unhandled = nullptr;        // capture.dispatch._unhandled
PyObject* g_fb_unary = nullptr;         // capture._FB_UNARY: torch.tanh, Tensor.sigmoid... -> op
PyObject* g_planned = nullptr;          // capture._PLANNED: F.linear, Tensor.view... -> (handler, weights)
PyObject* g_recipe_type = nullptr;      // capture.direct._Recipe
PyObject* s_apply = nullptr;            // "apply"
PyObject* s_stacklevel = nullptr;       // "_stacklevel"
PyObject* s_inplace = nullptr;          // "inplace"
PyObject* s_out = nullptr;              // "out"
PyObject* s_name = nullptr;             // "__name__"
PyObject* s_self = nullptr;             // "__self__"
PyObject* s_optimizer_step = nullptr;   // "optimizer_step"
PyObject* s_closed = nullptr;           // "closed"
PyObject* s_base = nullptr;             // "_base"

// getattr(x, name, default) as a new reference.
PyObject* attr_or(PyObject* x, PyObject* name, PyObject* default_value) {
  PyObject* value = PyObject_GetAttr(x, name);
  if (value) return value;
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw PythonError{};
  PyErr_Clear();
  return Py_NewRef(default_value);
}

bool truth(PyObject* x) {
  const int t = PyObject_IsTrue(x);
  if (t < 0) throw PythonError{};
  return t;
}

bool contains(PyObject* set, PyObject* item) {
  const int found = PySet_Contains(set, item);
  if (found < 0) throw PythonError{};
  return found;
}

// The scan of a call's tensor arguments for a shadowed tensor or a parameter. What it needs of
// the current graph and thread is read at the first tensor (most calls that run as they are,
// `torch.tensor([3])`, have none).
struct Scan {
  bool inplace = false;         // the call writes into its first argument
  bool shadows_only = false;    // only a shadowed tensor makes the call recorded
  bool ready = false;
  PyObject* shadows = nullptr;  // owned: the current open graph's non-empty dict, or NULL
  PyObject* graph = nullptr;    // owned with shadows: that graph
  PyObject* storages = nullptr; // owned with shadows: its set of the shadowed storages
  bool params = false;          // parameters are recorded (no optimizer step runs)

  ~Scan() {
    Py_XDECREF(shadows);
    Py_XDECREF(graph);
    Py_XDECREF(storages);
  }

  void prepare() {
    ready = true;
    PyObject* graph = nullptr;
    if (PyContextVar_Get(g_current, Py_None, &graph) < 0) throw PythonError{};
    Owned held{graph};
    if (graph != Py_None) {
      const bool closed = PyObject_TypeCheck(graph, &StoreType)
                              ? reinterpret_cast<Store*>(graph)->closed
                              : truth(Owned{PyObject_GetAttr(graph, s_closed)}.get());
      if (!closed) {
        Owned s{PyObject_GetAttr(graph, s_shadows)};
        if (truth(s.get())) {
          Owned set{PyObject_GetAttr(graph, s_shadow_storages)};
          if (!PySet_Check(set.get())) raise(PyExc_TypeError, "graph.shadow_storages must be a set");
          shadows = s.release();
          storages = set.release();
          this->graph = Py_NewRef(graph);
        }
      }
    }
    Owned step{attr_or(g_thread, s_optimizer_step, Py_False)};
    params = !truth(step.get());
  }

  bool involves(PyObject* x) {  // x: a tensor argument
    if (!ready) prepare();
    if (!params && !shadows) return false;
    if (shadows) {
      Owned id{PyLong_FromVoidPtr(x)};
      const int shadowed = PySequence_Contains(shadows, id.get());
      if (shadowed < 0) throw PythonError{};
      if (shadowed) return true;
      // A view of a shadowed tensor taken before the write still shows the old values: the
      // call is recorded, and Graph._operand refuses it with a clear error.
      Owned base{PyObject_GetAttr(x, s_base)};
      if (base.get() != Py_None) {
        Owned base_id{PyLong_FromVoidPtr(base.get())};
        const int stale = PySequence_Contains(shadows, base_id.get());
        if (stale < 0) throw PythonError{};
        if (stale) return true;
      }
    }
    // A parameter (a leaf that requires grad): recorded, so its uses batch. A computed tensor
    // with grad (a value the graph returned, an eager result) runs eagerly, which is exactly
    // right, and a peek like `value.detach()` stays a tensor.
    if (params && !inplace && !shadows_only &&
        truth(Owned{PyObject_GetAttr(x, s_requires_grad)}.get()) &&
        truth(Owned{PyObject_GetAttr(x, s_is_leaf)}.get()))
      return true;
    if (shadows) write_through(x);
    return false;
  }

  // x runs as it is: another tensor object of a storage the graph wrote into (`E.weight`
  // after `E.weight.data[1] = h`) first gets the write (Graph.write_through), so the call
  // reads it as eagerly. (A parameter recorded gets it when its node is made.)
  void write_through(PyObject* x) {
    Owned storage{checked(PyObject_CallMethodNoArgs(x, s_untyped_storage))};
    Owned pointer{checked(PyObject_CallMethodNoArgs(storage.get(), s_data_ptr))};
    if (contains(storages, pointer.get()))
      Owned done{checked(PyObject_CallMethodOneArg(graph, s_write_through, x))};
  }

  // An argument: a tensor, or a list / tuple holding tensors. Expressions in it, which torch
  // does not look for inside the data of a factory (`torch.tensor([score_a, score_b])`: no
  // overloaded types), involve the graph too, nested a few lists deep.
  bool any(PyObject* x, int depth = 0) {
    if (is_tensor(x)) return involves(x);
    if (PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(g_expression_type))) return true;
    if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
      // (a list may change under a Python call made here: index it afresh each time)
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(x); ++i) {
        PyObject* y = PySequence_Fast_GET_ITEM(x, i);
        Py_INCREF(y);
        Owned held{y};
        if (is_tensor(y) ? involves(y)
                         : PyObject_TypeCheck(y, reinterpret_cast<PyTypeObject*>(g_expression_type))
                               || (depth < 3 && (PyList_CheckExact(y) || PyTuple_CheckExact(y))
                                   && any(y, depth + 1)))
          return true;
      }
    }
    return false;
  }
};

bool name_is(PyObject* name, const char* text) {
  return PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, text) == 0;
}

// __name__ of func.__self__ (a property's descriptor), or "".
PyObject* owner_name(PyObject* func) {
  Owned empty{PyUnicode_FromString("")};
  Owned owner{attr_or(func, s_self, Py_None)};
  return attr_or(owner.get(), s_name, empty.get());
}

// Whether a graph block is open (an in-place write there may need capture.mode._before_write).
bool in_open_graph() {
  PyObject* graph = nullptr;
  if (PyContextVar_Get(g_current, Py_None, &graph) < 0) throw PythonError{};
  Owned held{graph};
  if (graph == Py_None) return false;
  return PyObject_TypeCheck(graph, &StoreType) ? !reinterpret_cast<Store*>(graph)->closed
                                               : !truth(Owned{PyObject_GetAttr(graph, s_closed)}.get());
}

// `writes` is set when the call writes in place into its first argument (`add_`,
// `__setitem__`, `nn.init.zeros_`), which a graph's pending nodes may read (see before_write).
bool involves_graph(PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs,
                    bool* writes) {
  {
    Owned seq{PySequence_Fast(types, "types must be a sequence")};
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.get()); ++i) {
      PyObject* t = PySequence_Fast_GET_ITEM(seq.get(), i);
      const int sub = PyType_Check(t) ? PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t),
                                            reinterpret_cast<PyTypeObject*>(g_expression_type))
                                      : PyObject_IsSubclass(t, g_expression_type);
      if (sub < 0) throw PythonError{};
      if (sub) return true;
    }
  }
  Owned empty{PyUnicode_FromString("")};
  Owned name{attr_or(func, s_name, empty.get())};
  if (name_is(name.get(), "__get__")) {
    Owned owner{owner_name(func)};
    if (contains(g_reads_value, owner.get())) {  // `data`, `requires_grad` of a shadowed tensor
      Scan scan{};
      scan.shadows_only = true;
      return PyTuple_GET_SIZE(args) && scan.any(PyTuple_GET_ITEM(args, 0));
    }
    if (!contains(g_recorded_properties, owner.get())) return false;
  } else {
    const bool rebinds = contains(g_rebinds, name.get());
    if (!rebinds && contains(g_reads_value, name.get())) {
      Scan scan{};
      scan.shadows_only = true;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i)
        if (scan.any(PyTuple_GET_ITEM(args, i))) return true;
      return false;
    }
    if (rebinds || contains(g_describe, name.get())) {
      bool forget = rebinds;
      if (!forget && name_is(name.get(), "__set__")) {
        Owned owner{owner_name(func)};
        forget = contains(g_rebound_attributes, owner.get());
      }
      if (forget) {
        if (PyTuple_GET_SIZE(args) < 1)
          raise(PyExc_IndexError, "tuple index out of range");  // as args[0]
        Owned done{PyObject_CallOneArg(g_forget, PyTuple_GET_ITEM(args, 0))};
      }
      return false;
    }
  }
  Scan scan{};
  if (PyUnicode_Check(name.get())) {  // `add_`, `__setitem__`; not `__add__`
    const Py_ssize_t n = PyUnicode_GET_LENGTH(name.get());
    const bool dunder = PyUnicode_Tailmatch(name.get(), s_dunder, 0, n, -1) == 1;
    const bool underscore = n > 0 && PyUnicode_READ_CHAR(name.get(), n - 1) == '_';
    scan.inplace = (underscore && !dunder) || name_is(name.get(), "__setitem__");
    *writes = scan.inplace;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i)
    if (scan.any(PyTuple_GET_ITEM(args, i))) return true;
  if (kwargs) {
    Owned values{PyDict_Values(kwargs)};  // a copy: a Python call may change the dict
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values.get()); ++i) {
      PyObject* x = PyList_GET_ITEM(values.get(), i);
      if (is_tensor(x) && scan.involves(x)) return true;
    }
  }
  return false;
}

// capture.torch_call, the head of every recorded call (the front end's, and those of
// Expression's methods): the keywords that are not part of the computation dropped, in-place
// writes into an expression refused, then the function's handler; a call without one, or whose
// handler declines it (NotImplemented), goes on in capture.dispatch._unhandled (in-place writes
// into tensors, out=, generic nodes). In Python this head cost ~0.3 us per recorded call.
// The fb op of a unary function (torch.sigmoid(x), x.tanh()) of one floating expression and
// nothing else, as capture.mappings._fb_unary maps it, without its Python frame (~6 such calls per
// Tree-LSTM node); NULL (no error) for any other call, which the handler decides.
PyObject* fb_unary(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 1 || PyDict_GET_SIZE(kwargs)) return nullptr;
  PyObject* x = PyTuple_GET_ITEM(args, 0);
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(g_expression_type)) return nullptr;
  PyObject* op = PyDict_GetItemWithError(g_fb_unary, func);  // borrowed
  if (!op) {
    if (PyErr_Occurred()) throw PythonError{};
    return nullptr;
  }
  Expression* e = reinterpret_cast<Expression*>(x);
  // not of the graph's floating dtype, which the fb op computes in
  if (of_other_dtype(e->graph, expression_node(e))) return nullptr;
  return checked(PyObject_CallOneArg(op, x));
}

// What a recipe (capture.direct._Recipe) gives for a call: `recipe.apply(args)`; for the pieces of
// a chunk / split / unbind (capture.indexing._Pieces, ~2.5k per Tree-LSTM minibatch), its method
// without its Python frames: each piece's plan appended over the expression's node, in a list or
// tuple.
PyObject* g_pieces_type = nullptr;      // capture.indexing._Pieces
PyObject* s_kind = nullptr;             // "kind"
PyObject* s_plans = nullptr;            // "plans"

PyObject* apply_recipe(PyObject* recipe, PyObject* args) {
  PyObject* x = PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, 0) : nullptr;
  if (Py_TYPE(recipe) != reinterpret_cast<PyTypeObject*>(g_pieces_type) || !x ||
      Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(g_expression_type))
    return checked(PyObject_CallMethodOneArg(recipe, s_apply, args));
  Owned kind{PyObject_GetAttr(recipe, s_kind)}, plans{PyObject_GetAttr(recipe, s_plans)};
  if (!PyList_CheckExact(plans.get()))
    return checked(PyObject_CallMethodOneArg(recipe, s_apply, args));
  Expression* e = reinterpret_cast<Expression*>(x);
  const i64 node = expression_node(e);
  const Py_ssize_t n = PyList_GET_SIZE(plans.get());
  Owned pieces{PyList_New(n)};
  for (Py_ssize_t i = 0; i < n; ++i) {
    Owned plan{Py_NewRef(PyList_GET_ITEM(plans.get(), i))};
    PyList_SET_ITEM(pieces.get(), i, append_planned(e->graph, plan.get(), &node, 1));
  }
  if (kind.get() == reinterpret_cast<PyObject*>(&PyList_Type)) return pieces.release();
  return checked(PyObject_CallOneArg(kind.get(), pieces.get()));
}

// The form of a planned call (see `planned`), as the bytes of a list of ints: a key of the
// graph's `call_plans`, which a call of the same form finds its plan in without take_apart's
// Python tuples (~9k instructions of the ~23k of a recorded F.linear).
constexpr i64 kListForm = -1, kTupleForm = -2, kIntForm = -3, kNodeForm = -4,
              kIndexForm = -5, kNameForm = -6, kNoneForm = -7, kBoolForm = -8, kFloatForm = -9,
              kTextForm = -10;

struct CallForm {
  SmallInts<40> text;      // the form: ints, a text's bytes packed 8 to an int
  SmallInts<8> nodes;      // the operand nodes, in take_apart's order
  bool known = true;       // every argument of a kind spelled out here
  bool ready = false;      // `describe` found the graph's dtype fixed

  std::string_view key() const {
    return {reinterpret_cast<const char*>(text.data()), text.size() * sizeof(i64)};
  }
  void add(i64 v) { text.push(v); }
  void add(i64 a, i64 b) { add(a); add(b); }
  void add_int(PyObject* v) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (value == -1 && PyErr_Occurred()) throw PythonError{};
    if (overflow) known = false;
    add(value);
  }
  void add_node(i64 node) {  // -1: of another graph (take_apart raises)
    if (node < 0) known = false;
    add(kNodeForm);
    nodes.push(node);
  }
  void add_text(i64 kind, PyObject* text) {  // a keyword's name, a str constant
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (!utf8) throw PythonError{};
    add(kind, size);
    for (Py_ssize_t at = 0; at < size; at += sizeof(i64)) {
      i64 word = 0;
      std::memcpy(&word, utf8 + at, std::min<std::size_t>(sizeof word, size - at));
      add(word);
    }
  }
  // A keyword's value: false where it is of a kind not spelled out (the handler decides).
  bool add_constant(PyObject* v) {
    if (v == Py_None) {
      add(kNoneForm);
    } else if (PyBool_Check(v)) {
      add(kBoolForm, v == Py_True);
    } else if (PyLong_CheckExact(v)) {
      add(kIntForm);
      add_int(v);
    } else if (PyFloat_CheckExact(v)) {  // by its bits: as exact as take_apart's repr
      const double d = PyFloat_AS_DOUBLE(v);
      i64 bits;
      std::memcpy(&bits, &d, sizeof bits);
      add(kFloatForm, bits);
    } else if (PyUnicode_CheckExact(v)) {
      add_text(kTextForm, v);
    } else {
      return false;
    }
    return true;
  }

  // Each operand node's shape id, dtype (its own, or the graph's) and whether it is a
  // parameter node: take_apart's operands and params. A shared parameter's node is in the
  // plan's signature, not its form: the nodes are spelled out too where they are parameters.
  bool describe(Store* g) {
    PyObject* fixed = graph_fixed_dtype(g);
    if (fixed == Py_None) return false;  // not fixed yet: an operand's dtype may change
    // A tensor the graph wrote into stands for a node of its own (take_apart asks Python)
    if (graph_has_shadows(g)) return false;
    add(reinterpret_cast<i64>(fixed));
    const std::int32_t parameter_code = op_code(g_parameter_op);
    for (std::size_t k = 0; k < nodes.size(); ++k) {
      const i64 node = nodes[k];
      if (node == kDeferredNode) continue;  // (its shape and dtype are in the form)
      PyObject* dtype = node_dtype(g, node);  // borrowed; NULL: the graph's
      const bool parameter = g->nodes->op[node] == parameter_code;
      add(g->nodes->shape[node], reinterpret_cast<i64>(dtype));
      add(parameter ? node : -1);
    }
    ready = true;
    return true;
  }
};

// A loss's class check (capture.losses._check_classes) for a target index holding `value`: whether
// the value is a class of `x` (an expression of 1 or 2 dims) or the call's ignore_index. False
// where the handler is to decide: it raises the error that names the op and shapes.
PyObject* s_ignore_index = nullptr;     // "ignore_index"

bool class_in_range(Store* g, const Expression* x, PyObject* value, PyObject* kwargs) {
  PyObject* shape = (*g->shape_tuples)[expression_shape_id(x)];
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
  if (ndim != 1 && ndim != 2) return true;  // (the handler checks none)
  long long ignore = -100;
  if (PyObject* given = PyDict_GetItemWithError(kwargs, s_ignore_index)) {  // borrowed
    if (!PyLong_CheckExact(given)) return false;
    ignore = PyLong_AsLongLong(given);
    if (ignore == -1 && PyErr_Occurred()) throw PythonError{};
  } else if (PyErr_Occurred()) {
    throw PythonError{};
  }
  const long long classes = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, ndim - 1));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (v == -1 && PyErr_Occurred()) throw PythonError{};
  return !overflow && (v == ignore || (0 <= v && v < classes));
}

// The call of a handler that only looks its plan up (capture._PLANNED: F.linear, the reshapes,
// chunk / split, the class losses), taken by that plan without the handler's Python frames
// (~7k F.linear calls per Tree-LSTM minibatch): a node, or a recipe's result. Only a call the
// handler would pass on as it is: no None, an expression first and no operand led by a length
// (the handler's row-wise plans), every other tensor a parameter the graph of that expression
// has met (the node it resolves to is made already: resolving the operands again in the
// handler, where this path declines, adds no node). An entry (handler, weights, "classes") (a
// class loss) takes keywords of constants too, and one-element index tensors (a target made by
// `torch.tensor([label])`), whose nodes are made only where the plan is known, the target
// checked as the handler checks it.
// NULL (no error) where the handler decides: any other call, a first sight, a declined key.
PyObject* planned(PyObject* func, PyObject* args, PyObject* kwargs) {
  PyObject* entry = PyDict_GetItemWithError(g_planned, func);  // borrowed
  if (!entry) {
    if (PyErr_Occurred()) throw PythonError{};
    return nullptr;
  }
  const bool loss = PyTuple_GET_SIZE(entry) == 3;
  if (PyDict_GET_SIZE(kwargs) && !loss) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n == 0 || Py_TYPE(PyTuple_GET_ITEM(args, 0)) !=
                    reinterpret_cast<PyTypeObject*>(g_expression_type))
    return nullptr;
  if (loss && n != 2) return nullptr;  // (F.nll_loss, F.cross_entropy pass the rest by name)
  Store* g = reinterpret_cast<Expression*>(PyTuple_GET_ITEM(args, 0))->graph;
  // The call's form, as far as its plan depends on it (take_apart's key, operands and
  // parameter flags): the handler, the graph's dtype, then per argument its kind and what
  // the plan reads of it. Empty where an argument is of a kind it does not spell out.
  CallForm form;
  std::vector<IndexValue> indices;  // the index tensors', in order, their nodes not made yet
  form.add(reinterpret_cast<i64>(PyTuple_GET_ITEM(entry, 0)));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(args, i);
    if (x == Py_None) return nullptr;
    if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {  // sizes, a shape: no operands
      form.add(PyList_CheckExact(x) ? kListForm : kTupleForm, PySequence_Fast_GET_SIZE(x));
      for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(x); ++k) {
        PyObject* v = PySequence_Fast_GET_ITEM(x, k);
        if (!PyLong_CheckExact(v)) return nullptr;
        form.add_int(v);
      }
    } else if (PyObject_TypeCheck(x, &ExpressionBase)) {
      Expression* e = reinterpret_cast<Expression*>(x);
      const i64 node = expression_node(e);
      if (length_led(e->graph, node)) return nullptr;
      form.add_node(e->graph == g ? node : -1);
    } else if (PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(g_tensor_type))) {
      const auto found = g->parameters->find(x);
      if (found != g->parameters->end()) {
        form.add_node(found->second);
        continue;
      }
      IndexValue v;
      if (!loss || !index_value(x, v)) return nullptr;
      if (i == 1 && !class_in_range(g, reinterpret_cast<Expression*>(PyTuple_GET_ITEM(args, 0)),
                                    v.value, kwargs))
        return nullptr;
      form.add(kIndexForm, PyTuple_GET_SIZE(v.shape));
      form.add(reinterpret_cast<i64>(v.dtype));
      form.nodes.push(kDeferredNode);
      indices.push_back(std::move(v));
    } else if (PyLong_CheckExact(x)) {
      form.add(kIntForm);
      form.add_int(x);
    } else {
      form.known = false;  // a float, a string...: take_apart keys it
    }
  }
  PyObject *name, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &name, &value)) {  // (in the call's order, as take_apart)
    if (!PyUnicode_Check(name)) return nullptr;
    form.add_text(kNameForm, name);
    if (!form.add_constant(value)) return nullptr;
  }
  PyObject* handler = PyTuple_GET_ITEM(entry, 0);
  PyObject* graph = reinterpret_cast<PyObject*>(g);
  if (form.known && form.describe(g)) {
    const auto found = g->call_plans->find(form.key());
    if (found != g->call_plans->end()) {
      check_open(g);  // (take_apart's check)
      PlannedCall& known = *found->second;
      if (!known.is_plan) return apply_recipe(Owned{Py_NewRef(known.plan)}.get(), args);
      SmallInts<8> nodes;
      std::size_t next_index = 0;
      for (std::size_t k = 0; k < form.nodes.size(); ++k)
        nodes.push(form.nodes[k] == kDeferredNode ? add_index_input(graph, indices[next_index++])
                                                  : form.nodes[k]);
      return append_planned(g, known.plan, nodes.data(), nodes.size());
    }
  }
  PyObject* call[5] = {Py_None, args, kwargs, PyTuple_GET_ITEM(entry, 1), handler};
  PyObject* plan = nullptr;  // set (a new reference) when take_apart appended by a _Plan
  Owned out{take_apart_call(call, 5, &plan, /*defer=*/true)};
  auto keep = [&](PyObject* found) {  // the form's plan or recipe, for the next call
    if (!form.known || !form.ready) return;
    auto planned = std::make_unique<PlannedCall>();
    planned->form.assign(form.key());
    planned->plan = Py_NewRef(found);
    planned->is_plan = Py_TYPE(found) == reinterpret_cast<PyTypeObject*>(g_plan_type);
    if (g->call_plans->emplace(planned->form, planned.get()).second) planned.release();
  };
  if (plan) {
    Owned held{plan};
    keep(plan);
    return out.release();
  }
  if (out.get() == Py_Ellipsis) return nullptr;  // no plan yet: nothing made
  if (PyObject_TypeCheck(out.get(), &ExpressionBase)) return out.release();
  const int recipe = PyObject_IsInstance(out.get(), g_recipe_type);
  if (recipe < 0) throw PythonError{};
  if (!recipe) return nullptr;  // NotImplemented, or the call's parts (no plan yet)
  keep(out.get());
  return apply_recipe(out.get(), args);
}

// `torch.tensor([i])` of one Python int (a word's or a label's index tensor, made afresh at
// every call of per-instance code: ~3.8k per Tree-LSTM minibatch), with no keyword but `device`
// and `dtype=torch.int64`, made as `torch.full((1,), i, ...)`: the same tensor (int64, one
// element, on the same device, no grad) in less than half the time, since torch.tensor's data
// conversion (nested sequences, arrays, dtype inference) costs ~20k instructions. A call that
// runs as it is (no tensor among its arguments); NULL (no error) for any other call.
PyObject* g_torch_tensor = nullptr;     // torch.tensor
PyObject* g_torch_full = nullptr;       // torch.full
PyObject* g_int64 = nullptr;            // torch.int64
PyObject* g_one_element = nullptr;      // (1,)
PyObject* s_device = nullptr;           // "device"

PyObject* index_tensor(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (func != g_torch_tensor || PyTuple_GET_SIZE(args) != 1) return nullptr;
  PyObject* data = PyTuple_GET_ITEM(args, 0);
  if (!PyList_CheckExact(data) || PyList_GET_SIZE(data) != 1) return nullptr;
  PyObject* value = PyList_GET_ITEM(data, 0);
  if (!PyLong_CheckExact(value)) return nullptr;  // (not a bool: a bool tensor)
  int overflow = 0;
  PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow) return nullptr;  // torch.tensor's own error
  PyObject *name, *given;
  Py_ssize_t pos = 0;
  while (kwargs && PyDict_Next(kwargs, &pos, &name, &given)) {
    const bool device = PyUnicode_Check(name) && PyUnicode_Compare(name, s_device) == 0;
    const bool int64 = PyUnicode_Check(name) && PyUnicode_Compare(name, s_dtype) == 0 &&
                       given == g_int64;
    if (!device && !int64) return nullptr;
  }
  Owned full_args{PyTuple_Pack(2, g_one_element, value)};
  return checked(PyObject_Call(g_torch_full, full_args.get(), kwargs));
}

// `U_f[0]`: an int part of a parameter that the current graph has taken already, its one node
// per graph (Graph.parameter_view_node) found without the handler's Python frames (~2.5k such
// calls per Tree-LSTM minibatch: the forget gates' weights of every node), where the handler
// (capture.indexing._tensor_getitem) would find it: a floating leaf that requires grad, not of 2
// dims (a table's row is a lookup of its own). NULL (no error) for any other call.
PyObject* g_tensor_getitem = nullptr;   // torch.Tensor.__getitem__
PyObject* s_leaf_nodes = nullptr;       // "_leaf_nodes"
PyObject* s_view = nullptr;             // "view"
PyObject* s_tuple = nullptr;            // "tuple"
PyObject* s_ndim = nullptr;             // "ndim"
PyObject* s_is_floating_point = nullptr;  // "is_floating_point"

PyObject* parameter_view(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (func != g_tensor_getitem || PyTuple_GET_SIZE(args) != 2 || PyDict_GET_SIZE(kwargs))
    return nullptr;
  PyObject *x = PyTuple_GET_ITEM(args, 0), *key = PyTuple_GET_ITEM(args, 1);
  if (!PyLong_CheckExact(key) ||
      !PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(g_tensor_type)) ||
      PyObject_TypeCheck(x, &ExpressionBase))
    return nullptr;
  PyObject* graph = nullptr;
  if (PyContextVar_Get(g_current, Py_None, &graph) < 0) throw PythonError{};
  Owned held{graph};
  if (!PyObject_TypeCheck(graph, &StoreType) || reinterpret_cast<Store*>(graph)->closed)
    return nullptr;
  Owned leaf_nodes{PyObject_GetAttr(graph, s_leaf_nodes)};
  if (!PyDict_Check(leaf_nodes.get())) return nullptr;
  Owned id{PyLong_FromVoidPtr(x)};
  Owned key_id{PyTuple_Pack(2, s_tuple, key)};
  Owned leaf_key{PyTuple_Pack(3, s_view, id.get(), key_id.get())};
  PyObject* node = PyDict_GetItemWithError(leaf_nodes.get(), leaf_key.get());  // borrowed
  if (!node) {
    if (PyErr_Occurred()) throw PythonError{};
    return nullptr;  // first sight: the handler makes the node
  }
  const i64 at = PyLong_AsLongLong(node);
  if (at == -1 && PyErr_Occurred()) throw PythonError{};
  if (!truth(Owned{PyObject_GetAttr(x, s_requires_grad)}.get()) ||
      !truth(Owned{PyObject_GetAttr(x, s_is_leaf)}.get()))
    return nullptr;
  Owned dtype{PyObject_GetAttr(x, s_dtype)};
  if (!truth(Owned{PyObject_GetAttr(dtype.get(), s_is_floating_point)}.get())) return nullptr;
  const long ndim = PyLong_AsLong(Owned{PyObject_GetAttr(x, s_ndim)}.get());
  if (ndim == -1 && PyErr_Occurred()) throw PythonError{};
  if (ndim < 1 || ndim == 2) return nullptr;
  return checked(new_expression(reinterpret_cast<Store*>(graph), at));
}

// `F.embedding(torch.tensor([word]), E)` (a leaf's word, ~1.1k per Tree-LSTM minibatch): a
// lookup node of shape `index_shape + (columns,)` holding the row, with no index input. It is
// `lookup_rows`, shared with the Python handler (capture/mappings.py `_embedding`), which
// takes every other call; taken here without the handler's Python frames and tensor reads
// (~4 us a call) where the handler would take it: a one-element integer index on the CPU, of
// at least one dim (a 0-d one is `fb.lookup` itself), into a 2-D leaf parameter, grad
// enabled, no padding_idx, max_norm or scale_grad_by_freq, the graph writing into no tensor.
PyObject* g_embedding = nullptr;        // torch.nn.functional.embedding
PyObject* g_lookup_op = nullptr;        // ops.LOOKUP
PyObject* s_padding_idx = nullptr;      // "padding_idx"
PyObject* s_max_norm = nullptr;         // "max_norm"
PyObject* s_norm_type = nullptr;        // "norm_type"
PyObject* s_scale_grad_by_freq = nullptr;  // "scale_grad_by_freq"
PyObject* s_sparse = nullptr;           // "sparse"

// The (rows, cols) of embedding table `table` (a TypeError where it is no matrix).
std::pair<i64, i64> table_size(PyObject* table) {
  Owned size{PyObject_GetAttr(table, s_shape_attr)};
  Owned dims{PySequence_Tuple(size.get())};
  if (PyTuple_GET_SIZE(dims.get()) != 2)
    raise(PyExc_TypeError, "F.embedding: the table must be a matrix");
  const long long rows = PyLong_AsLongLong(PyTuple_GET_ITEM(dims.get(), 0));
  const long long cols = PyLong_AsLongLong(PyTuple_GET_ITEM(dims.get(), 1));
  if ((rows == -1 || cols == -1) && PyErr_Occurred()) throw PythonError{};
  return {rows, cols};
}

// The lookup node of F.embedding's one-element index of shape `index_dims` holding `row`.
PyObject* lookup_row(Store* g, PyObject* table, std::pair<i64, i64> size, i64 row,
                     const i64* index_dims, std::size_t n_index, bool sparse) {
  if (!(0 <= row && row < size.first))
    raise(PyExc_IndexError, "F.embedding: index %lld out of range for a table of %lld rows",
          static_cast<long long>(row), static_cast<long long>(size.first));
  return lookup_node(g, op_code(g_lookup_op), table, size.second, row, sparse, nullptr,
                     index_dims, n_index);
}

// The lookup node of `row` of `table` for an index of shape `index_shape` (a tuple): as
// `fb.lookup` for a 0-d index, else a node of shape `index_shape + (columns,)`.
PyObject* lookup_rows(PyObject* graph, PyObject* table, PyObject* row, PyObject* index_shape,
                      bool sparse) {
  if (!PyObject_TypeCheck(graph, &StoreType))
    raise(PyExc_TypeError, "lookup_rows: graph must be a flybatch Graph");
  SmallInts<8> dims;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(index_shape); ++k)
    dims.push(PyLong_AsLongLong(PyTuple_GET_ITEM(index_shape, k)));
  const i64 at = PyLong_AsLongLong(row);
  if (PyErr_Occurred()) throw PythonError{};
  return lookup_row(reinterpret_cast<Store*>(graph), table, table_size(table), at, dims.data(),
                    dims.size(), sparse);
}

const char kLookupRowsDoc[] =
    "lookup_rows(graph, table, row, index_shape, sparse) -> Expression\n\n"
    "F.embedding of a one-element index of shape index_shape holding row: fb.lookup for a 0-d "
    "index, else a lookup node of shape index_shape + (columns,).";

PyObject* lookup_rows_binding(PyObject*, PyObject* args) {
  PyObject *graph, *table, *row, *index_shape;
  int sparse;
  if (!PyArg_ParseTuple(args, "OOO!O!p:lookup_rows", &graph, &table, &PyLong_Type, &row,
                        &PyTuple_Type, &index_shape, &sparse))
    return nullptr;
  return guarded([&] { return lookup_rows(graph, table, row, index_shape, sparse); });
}

PyObject* embedding_row(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (func != g_embedding || PyTuple_GET_SIZE(args) != 2) return nullptr;
  PyObject *input = PyTuple_GET_ITEM(args, 0), *table = PyTuple_GET_ITEM(args, 1);
  bool sparse = false;
  PyObject *name, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &name, &value)) {
    if (!PyUnicode_Check(name)) return nullptr;
    if (PyUnicode_Compare(name, s_sparse) == 0) {
      const int truth = PyObject_IsTrue(value);
      if (truth < 0) throw PythonError{};
      sparse = truth;
    } else if (PyUnicode_Compare(name, s_padding_idx) == 0 ||
               PyUnicode_Compare(name, s_max_norm) == 0) {
      if (value != Py_None) return nullptr;
    } else if (PyUnicode_Compare(name, s_scale_grad_by_freq) == 0) {
      if (value != Py_False) return nullptr;  // (the handler refuses True)
    } else if (PyUnicode_Compare(name, s_norm_type) != 0) {
      return nullptr;
    }
  }
  if (!grad_enabled() ||
      !PyObject_TypeCheck(table, reinterpret_cast<PyTypeObject*>(g_tensor_type)) ||
      PyObject_TypeCheck(table, &ExpressionBase))
    return nullptr;
  PyObject* graph = nullptr;
  if (PyContextVar_Get(g_current, Py_None, &graph) < 0) throw PythonError{};
  Owned held{graph};
  if (!PyObject_TypeCheck(graph, &StoreType) || reinterpret_cast<Store*>(graph)->closed ||
      graph_has_shadows(reinterpret_cast<Store*>(graph)))
    return nullptr;
  // A table met before in this graph is one checked then (forgotten on a rebind).
  Store* g = reinterpret_cast<Store*>(graph);
  const auto known = g->embedding_tables->find(table);
  std::pair<i64, i64> size;
  if (known != g->embedding_tables->end()) {
    size = known->second;
  } else {
    if (!truth(Owned{PyObject_GetAttr(table, s_requires_grad)}.get()) ||
        !truth(Owned{PyObject_GetAttr(table, s_is_leaf)}.get()) ||
        PyLong_AsLong(Owned{PyObject_GetAttr(table, s_ndim)}.get()) != 2) {
      if (PyErr_Occurred()) throw PythonError{};
      return nullptr;
    }
    size = table_size(table);
  }
  IndexValue v;
  if (!index_value(input, v) || PyTuple_GET_SIZE(v.shape) == 0) return nullptr;
  SmallInts<8> dims;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(v.shape); ++k) dims.push(1);  // (one element)
  const i64 row = PyLong_AsLongLong(v.value);
  if (row == -1 && PyErr_Occurred()) throw PythonError{};
  Owned out{lookup_row(g, table, size, row, dims.data(), dims.size(), sparse)};
  if (known == g->embedding_tables->end()) g->embedding_tables->emplace(table, size);  // (tagged)
  return out.release();
}

// torch.cat (torch.concat, torch.concatenate) of expressions of the graph's floating dtype,
// one graph's (a Tree-LSTM node's children's states, ~1.2k per minibatch): flybatch's concat
// along the per-instance dim, as the handler (capture.mappings._cat) maps it, without its Python
// frames. NULL (no error) for any other call, which the handler decides (or raises for).
PyObject* g_cat_handler = nullptr;      // capture.mappings._cat
PyObject* g_concat = nullptr;           // ops.concat
PyObject* s_dim = nullptr;              // "dim"
PyObject* g_dim_name = nullptr;         // ("dim",)

PyObject* concat_of_expressions(PyObject* func, PyObject* args, PyObject* kwargs) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n < 1 || n > 2 || PyDict_GET_SIZE(kwargs) > (n == 1 ? 1 : 0)) return nullptr;
  PyObject* handler = PyDict_GetItemWithError(g_handlers, func);  // borrowed
  if (!handler) {
    if (PyErr_Occurred()) throw PythonError{};
    return nullptr;
  }
  if (handler != g_cat_handler) return nullptr;
  PyObject* dim = n == 2 ? PyTuple_GET_ITEM(args, 1) : nullptr;
  if (PyDict_GET_SIZE(kwargs)) {
    dim = PyDict_GetItemWithError(kwargs, s_dim);  // borrowed
    if (!dim) {
      if (PyErr_Occurred()) throw PythonError{};
      return nullptr;  // another keyword: the handler declines it
    }
  }
  long long d = 0;
  if (dim) {
    if (!PyLong_CheckExact(dim)) return nullptr;
    int overflow = 0;
    d = PyLong_AsLongLongAndOverflow(dim, &overflow);
    if (overflow || (d == -1 && PyErr_Occurred())) return nullptr;
  }
  PyObject* tensors = PyTuple_GET_ITEM(args, 0);
  if (!(PyList_CheckExact(tensors) || PyTuple_CheckExact(tensors)) ||
      PySequence_Fast_GET_SIZE(tensors) == 0)
    return nullptr;
  PyObject* first = PySequence_Fast_GET_ITEM(tensors, 0);
  if (Py_TYPE(first) != reinterpret_cast<PyTypeObject*>(g_expression_type)) return nullptr;
  Store* g = reinterpret_cast<Expression*>(first)->graph;
  Owned list{PyList_New(PySequence_Fast_GET_SIZE(tensors))};
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(tensors); ++i) {
    PyObject* x = PySequence_Fast_GET_ITEM(tensors, i);
    if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(g_expression_type) ||
        reinterpret_cast<Expression*>(x)->graph != g)
      return nullptr;
    if (of_other_dtype(g, expression_node(reinterpret_cast<Expression*>(x))))
      return nullptr;  // not of the graph's floating dtype
    PyList_SET_ITEM(list.get(), i, Py_NewRef(x));
  }
  const i64 node = expression_node(reinterpret_cast<Expression*>(first));
  const long long ndim = PyTuple_GET_SIZE((*g->shape_tuples)[g->nodes->shape[node]]);
  if (ndim == 0 || d < -ndim || d >= ndim) return nullptr;  // generic / torch's error
  Owned per_instance{PyLong_FromLongLong(((d % ndim) + ndim) % ndim)};
  PyObject* call[2] = {list.get(), per_instance.get()};
  return checked(PyObject_Vectorcall(g_concat, call, 1, g_dim_name));
}

// `F.linear(input=x, weight=W)`, `torch.cat(tensors=[a, b])`: torch binds its arguments by
// name too, the handlers take the leading ones by position. A keyword that names the call's
// next positional parameter moves into place, again while one does (so `reduction="sum"` after
// two positional arguments stays a keyword, as the handlers take it; `inplace`, `out` and
// `_stacklevel` always stay keywords). A function's parameter
// names come once from capture.dispatch._positional_names (its signature, or for a C function
// the one torch.overrides gives it), kept per function.
PyObject* g_positional_names = nullptr;       // dict: func -> tuple of parameter names
PyObject* g_find_positional_names = nullptr;  // capture.dispatch._positional_names

// How many of `kwargs`' keywords name `args`' next parameters, in order; `names` set to the
// function's parameter names (borrowed) where any do.
Py_ssize_t movable_keywords(PyObject* func, PyObject* args, PyObject* kwargs, PyObject** names) {
  if (!PyDict_GET_SIZE(kwargs) || !g_positional_names) return 0;
  PyObject* known = PyDict_GetItemWithError(g_positional_names, func);  // borrowed
  if (!known) {
    if (PyErr_Occurred()) throw PythonError{};
    Owned found{PyObject_CallOneArg(g_find_positional_names, func)};  // stores it too
    known = PyDict_GetItemWithError(g_positional_names, func);
    if (!known) {
      if (!PyErr_Occurred()) raise(PyExc_RuntimeError, "_positional_names did not store");
      throw PythonError{};
    }
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  Py_ssize_t moved = 0;
  while (n + moved < PyTuple_GET_SIZE(known)) {
    PyObject* name = PyTuple_GET_ITEM(known, n + moved);
    // (`inplace=`, `out=` stay keywords: record reads them as such, to refuse or redirect; and
    // `_stacklevel=`, which record drops)
    if (PyUnicode_Compare(name, s_inplace) == 0 || PyUnicode_Compare(name, s_out) == 0 ||
        PyUnicode_Compare(name, s_stacklevel) == 0)
      break;
    const int has = PyDict_Contains(kwargs, name);
    if (has < 0) throw PythonError{};
    if (!has) break;
    ++moved;
  }
  *names = known;
  return moved;
}

// `args` followed by the `moved` keywords of `kwargs` named next in `names`, which are taken out
// of `kwargs` (a dict of this call's own); a new reference.
PyObject* keywords_moved_in(PyObject* args, PyObject* kwargs, PyObject* names,
                            Py_ssize_t moved) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  Owned out{PyTuple_New(n + moved)};
  for (Py_ssize_t i = 0; i < n; ++i)
    PyTuple_SET_ITEM(out.get(), i, Py_NewRef(PyTuple_GET_ITEM(args, i)));
  for (Py_ssize_t k = 0; k < moved; ++k) {
    PyObject* name = PyTuple_GET_ITEM(names, n + k);
    PyObject* value = PyDict_GetItemWithError(kwargs, name);  // borrowed
    if (!value && !PyErr_Occurred()) raise(PyExc_KeyError, "keywords_moved_in: %R", name);
    if (!value) throw PythonError{};
    PyTuple_SET_ITEM(out.get(), n + k, Py_NewRef(value));
    if (PyDict_DelItem(kwargs, name) < 0) throw PythonError{};
  }
  return out.release();
}

PyObject* record(PyObject* func, PyObject* given_args, PyObject* given) {  // given: a dict
  // Inside a torch.autocast region (rare: one flag read, ~2 ns, per call) the batched kernel
  // would compute in the operands' dtype, not the region's: refused where the region is the
  // graph's device's.
  if (autocast_enabled()) Owned refused{checked(PyObject_CallOneArg(g_refuse_autocast, func))};
  const int stacklevel = PyDict_Contains(given, s_stacklevel);
  if (stacklevel < 0) throw PythonError{};
  PyObject* names = nullptr;
  const Py_ssize_t moved = movable_keywords(func, given_args, given, &names);
  // nn.LogSoftmax's warning depth (not part of the computation) taken out, and the keywords
  // of leading parameters put in place: in a copy of the caller's keywords, made only then
  Owned kwargs{stacklevel || moved ? PyDict_Copy(given) : Py_NewRef(given)};
  if (stacklevel && PyDict_DelItem(kwargs.get(), s_stacklevel) < 0) throw PythonError{};
  Owned in_place{moved ? keywords_moved_in(given_args, kwargs.get(), names, moved)
                       : Py_NewRef(given_args)};
  PyObject* args = in_place.get();
  PyObject* inplace = PyDict_GetItemWithError(kwargs.get(), s_inplace);  // borrowed
  if (!inplace && PyErr_Occurred()) throw PythonError{};
  if (inplace == Py_True && PyTuple_GET_SIZE(args)) {
    const int expression = PyObject_IsInstance(PyTuple_GET_ITEM(args, 0), g_expression_type);
    if (expression < 0) throw PythonError{};
    // Run as a generic node it would overwrite the batch holding its input's value.
    if (expression) {
      PyObject* refused = PyObject_CallOneArg(g_refuse_inplace, func);  // raises TypeError
      Py_XDECREF(refused);
      if (!PyErr_Occurred()) raise(PyExc_RuntimeError, "capture.dispatch._refuse_inplace returned");
      throw PythonError{};
    }
  }
  // `func(..., out=t)`: capture.dispatch._unhandled records it without `out`, then writes t
  PyObject* out_arg = PyDict_GetItemWithError(kwargs.get(), s_out);  // borrowed
  if (!out_arg && PyErr_Occurred()) throw PythonError{};
  const bool written_out = out_arg && out_arg != Py_None;
  if (PyObject* out = written_out ? nullptr : view_call(func, args, kwargs.get())) return out;
  if (PyObject* out = written_out ? nullptr : fb_unary(func, args, kwargs.get())) return out;
  if (PyObject* out = written_out ? nullptr : parameter_view(func, args, kwargs.get()))
    return out;
  if (PyObject* out = written_out ? nullptr : embedding_row(func, args, kwargs.get()))
    return out;
  if (PyObject* out = written_out ? nullptr : planned(func, args, kwargs.get())) return out;
  if (PyObject* out = written_out ? nullptr : concat_of_expressions(func, args, kwargs.get()))
    return out;
  PyObject* handler = written_out ? nullptr : PyDict_GetItemWithError(g_handlers, func);
  if (!handler && PyErr_Occurred()) throw PythonError{};
  if (handler) {
    Py_INCREF(handler);  // (a handler may change _HANDLERS while it runs)
    Owned held{handler};
    PyObject* out = checked(
        PyObject_Call(handler, args, PyDict_GET_SIZE(kwargs.get()) ? kwargs.get() : nullptr));
    if (out != Py_NotImplemented) return out;
    Py_DECREF(out);
  }
  PyObject* call[3] = {func, args, kwargs.get()};
  return checked(PyObject_Vectorcall(g_unhandled, call, 3, nullptr));
}

const char kTorchCallDoc[] =
    "torch_call(func, args, kwargs) -> Expression (or what the call returns)\n\n"
    "Records func(*args, **kwargs), a call that involves the graph, as nodes: by its handler "
    "in capture._HANDLERS, else capture.dispatch._unhandled (configure_front first).";

PyObject* torch_call(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  return guarded([&]() -> PyObject* {
    if (argc != 3 || !PyDict_Check(argv[2]))
      raise(PyExc_TypeError, "torch_call(func, args, kwargs: dict)");
    Owned args{PySequence_Tuple(argv[1])};
    return record_torch_call(argv[0], args.get(), argv[2]);
  });
}

PyObject* configure_positional(PyObject*, PyObject* args) {
  PyObject *names, *find;
  if (!PyArg_ParseTuple(args, "O!O:configure_positional", &PyDict_Type, &names, &find))
    return nullptr;
  Py_XSETREF(g_positional_names, Py_NewRef(names));
  Py_XSETREF(g_find_positional_names, Py_NewRef(find));
  Py_RETURN_NONE;
}

const char kTorchFunctionDoc[] =
    "__torch_function__(func, types, args=(), kwargs=None)\n\n"
    "Records the torch calls that involve the graph (capture.torch_call); runs every other "
    "call as it is (flybatch._core, capture.cpp).";

PyObject* torch_function(PyObject*, PyObject* const* argv, Py_ssize_t argc, PyObject* kwnames) {
  return guarded([&]() -> PyObject* {
    // (func, types, args=(), kwargs=None), by position (as torch calls it) or by name.
    static const char* const names[] = {"func", "types", "args", "kwargs"};
    PyObject* given[4] = {};
    const char* usage = "__torch_function__(func, types, args=(), kwargs=None)";
    if (argc > 4) raise(PyExc_TypeError, usage);
    std::copy(argv, argv + argc, given);
    for (Py_ssize_t j = 0; kwnames && j < PyTuple_GET_SIZE(kwnames); ++j) {
      int k = 0;
      while (k < 4 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, j), names[k]))
        ++k;
      if (k == 4 || given[k]) raise(PyExc_TypeError, usage);
      given[k] = argv[argc + j];
    }
    if (!given[0] || !given[1]) raise(PyExc_TypeError, usage);
    PyObject* func = given[0];
    Owned args{given[2] ? PySequence_Tuple(given[2]) : PyTuple_New(0)};
    PyObject* kwargs = given[3] && given[3] != Py_None ? given[3] : nullptr;
    if (kwargs && !PyDict_Check(kwargs)) raise(PyExc_TypeError, "kwargs must be a dict");
    if (kwargs && !PyDict_GET_SIZE(kwargs)) kwargs = nullptr;
    if (PyObject* made = index_tensor(func, args.get(), kwargs)) return made;
    {
      // Deciding and recording are flybatch's part of the build; a call that runs as it is
      // (the user's own eager torch work) is not. Torch's dispatch to the mode, before this
      // function, is not seen.
      OwnTimeScope own;
      bool writes = false;
      if (involves_graph(func, given[1], args.get(), kwargs, &writes)) {
        Owned given{kwargs ? Py_NewRef(kwargs) : PyDict_New()};
        return record(func, args.get(), given.get());
      }
      if (writes && in_open_graph()) {
        // The tensor written: the first argument, by position or (nn.init.normal_) by name.
        PyObject* target = Py_None;
        Py_ssize_t at = 0;
        PyObject* key = nullptr;
        if (PyTuple_GET_SIZE(args.get())) target = PyTuple_GET_ITEM(args.get(), 0);
        else if (kwargs) PyDict_Next(kwargs, &at, &key, &target);
        // What to call after the write (rows taken as views of the tensor), or None.
        Owned after{checked(PyObject_CallOneArg(g_before_write, target))};
        if (after.get() != Py_None) {
          Owned result{checked(PyObject_Call(func, args.get(), kwargs))};
          Owned done{checked(PyObject_CallNoArgs(after.get()))};
          return result.release();
        }
      }
    }
    return PyObject_Call(func, args.get(), kwargs);
  });
}

PyMethodDef kTorchFunction = {
    "__torch_function__",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(torch_function)),
    METH_FASTCALL | METH_KEYWORDS, kTorchFunctionDoc};

const char kConfigureFrontDoc[] =
    "configure_front(mode_class, describe, reads_value, rebinds, recorded_properties, "
    "rebound_attributes, forget, before_write, current, thread, handlers, refuse_inplace, "
    "refuse_autocast, unhandled, fb_unary, planned, recipe_type)\n\n"
    "Installs the front end as mode_class.__torch_function__ (capture._Capture), with what it "
    "and torch_call read and call (graph.Expression is the one `configure` was given): "
    "capture.mode._DESCRIBE, _READS_VALUE, _REBINDS, "
    "_RECORDED_PROPERTIES, _REBOUND_ATTRIBUTES, _forget, _before_write, graph._current, "
    "capture.mode._thread, "
    "_HANDLERS, _refuse_inplace, _refuse_autocast, _unhandled, _FB_UNARY, _PLANNED, _Recipe.";

PyObject* configure_front(PyObject*, PyObject* args) {
  PyObject *mode_class, *describe, *reads_value, *rebinds, *recorded, *rebound, *forget,
      *before_write, *current, *thread, *handlers, *refuse_inplace, *refuse_autocast, *unhandled,
      *fb_unary_ops, *planned_calls, *recipe_type;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OOO!OO!OOOO!O!O!:configure_front", &PyType_Type,
                        &mode_class, &PyFrozenSet_Type, &describe, &PyFrozenSet_Type,
                        &reads_value, &PyFrozenSet_Type, &rebinds, &PyFrozenSet_Type, &recorded,
                        &PyFrozenSet_Type, &rebound, &forget, &before_write,
                        &PyContextVar_Type, &current, &thread, &PyDict_Type, &handlers,
                        &refuse_inplace, &refuse_autocast, &unhandled, &PyDict_Type,
                        &fb_unary_ops, &PyDict_Type, &planned_calls, &PyType_Type, &recipe_type))
    return nullptr;
  Py_XSETREF(g_planned, Py_NewRef(planned_calls));
  Py_XSETREF(g_recipe_type, Py_NewRef(recipe_type));
  Py_XSETREF(g_fb_unary, Py_NewRef(fb_unary_ops));
  Py_XSETREF(g_describe, Py_NewRef(describe));
  Py_XSETREF(g_reads_value, Py_NewRef(reads_value));
  Py_XSETREF(g_rebinds, Py_NewRef(rebinds));
  Py_XSETREF(g_recorded_properties, Py_NewRef(recorded));
  Py_XSETREF(g_rebound_attributes, Py_NewRef(rebound));
  Py_XSETREF(g_forget, Py_NewRef(forget));
  Py_XSETREF(g_before_write, Py_NewRef(before_write));
  Py_XSETREF(g_current, Py_NewRef(current));
  Py_XSETREF(g_thread, Py_NewRef(thread));
  Py_XSETREF(g_handlers, Py_NewRef(handlers));
  Py_XSETREF(g_refuse_inplace, Py_NewRef(refuse_inplace));
  Py_XSETREF(g_refuse_autocast, Py_NewRef(refuse_autocast));
  Py_XSETREF(g_unhandled, Py_NewRef(unhandled));
  PyObject* torch = PyImport_ImportModule("torch");
  if (!torch) return nullptr;
  Py_XSETREF(g_torch_tensor, PyObject_GetAttrString(torch, "tensor"));
  Py_XSETREF(g_torch_full, PyObject_GetAttrString(torch, "full"));
  Py_XSETREF(g_int64, PyObject_GetAttrString(torch, "int64"));
  Py_XSETREF(g_tensor_getitem, PyObject_GetAttrString(g_tensor_type, "__getitem__"));
  Py_DECREF(torch);
  if (!g_torch_tensor || !g_torch_full || !g_int64 || !g_tensor_getitem) return nullptr;
  PyObject* mappings = PyImport_ImportModule("flybatch.capture.mappings");  // (their _cat)
  PyObject* indexing = mappings ? PyImport_ImportModule("flybatch.capture.indexing") : nullptr;
  PyObject* fb_ops = indexing ? PyImport_ImportModule("flybatch.ops") : nullptr;
  if (fb_ops) {
    Py_XSETREF(g_cat_handler, PyObject_GetAttrString(mappings, "_cat"));
    Py_XSETREF(g_pieces_type, PyObject_GetAttrString(indexing, "_Pieces"));
    Py_XSETREF(g_concat, PyObject_GetAttrString(fb_ops, "concat"));
    Py_XSETREF(g_lookup_op, PyObject_GetAttrString(fb_ops, "LOOKUP"));
  }
  Py_XDECREF(mappings);
  Py_XDECREF(indexing);
  Py_XDECREF(fb_ops);
  if (!g_cat_handler || !g_concat || !g_pieces_type || !g_lookup_op)
    return nullptr;
  PyObject* functional = PyImport_ImportModule("torch.nn.functional");
  if (!functional) return nullptr;
  Py_XSETREF(g_embedding, PyObject_GetAttrString(functional, "embedding"));
  Py_DECREF(functional);
  if (!g_embedding) return nullptr;
  // A method descriptor, so that the mode's instances bind it as they would a Python method.
  PyObject* method =
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(mode_class), &kTorchFunction);
  if (!method) return nullptr;
  const int set = PyObject_SetAttrString(mode_class, "__torch_function__", method);
  Py_DECREF(method);
  if (set < 0) return nullptr;
  // (torch calls a mode's __torch_function__ by C string: store.cpp)
  reinterpret_cast<PyTypeObject*>(mode_class)->tp_getattr = getattr_by_interned_torch_function;
  Py_RETURN_NONE;
}

PyMethodDef kCaptureMethods[] = {
    {"take_apart", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(take_apart)),
     METH_FASTCALL, kTakeApartDoc},
    {"append_planned",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(append_planned_binding)),
     METH_FASTCALL, kAppendPlannedDoc},
    {"configure_capture", configure_capture, METH_VARARGS, kConfigureDoc},
    {"configure_front", configure_front, METH_VARARGS, kConfigureFrontDoc},
    {"configure_positional", configure_positional, METH_VARARGS,
     "configure_positional(names, find): the dict of each torch function's positional parameter "
     "names, and find(func), which adds a function's (keywords of leading parameters are "
     "recorded as positional arguments)"},
    {"torch_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(torch_call)),
     METH_FASTCALL, kTorchCallDoc},
    {"lookup_rows", lookup_rows_binding, METH_VARARGS, kLookupRowsDoc},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// A unary call of one expression (torch.sigmoid(x), x.tanh()) with nothing else, by the fb op it
// maps to, as `record` takes it, without the call's tuple and dict (~9k a Tree-LSTM minibatch);
// NULL (no error) for any other, which goes the whole way (an autocast region's refusal too).
PyObject* record_unary_call(PyObject* func, PyObject* x) {
  if (Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(g_expression_type) || !g_fb_unary)
    return nullptr;
  return guarded([&]() -> PyObject* {
    PyObject* op = PyDict_GetItemWithError(g_fb_unary, func);  // borrowed
    if (!op) {
      if (PyErr_Occurred()) throw PythonError{};
      return nullptr;
    }
    if (autocast_enabled()) return nullptr;
    OwnTimeScope own;  // recording a call is flybatch's part of the build
    Expression* e = reinterpret_cast<Expression*>(x);
    if (of_other_dtype(e->graph, expression_node(e))) return nullptr;
    return checked(PyObject_CallOneArg(op, x));
  });
}

// `U_f[0]` inside a graph block: a part of a parameter by an int that the current graph has
// made its node of (Graph.parameter_view_node, Store.remember_part): that node's handle,
// without the capture's Python. NULL (no error) for anything else.
PyObject* known_parameter_part(PyObject* tensor, PyObject* part) {
  if (!PyLong_CheckExact(part)) return nullptr;
  return guarded([&]() -> PyObject* {
    PyObject* graph = nullptr;
    if (PyContextVar_Get(g_current, Py_None, &graph) < 0) throw PythonError{};
    Owned held{graph};
    if (!PyObject_TypeCheck(graph, &StoreType)) return nullptr;
    Store* g = reinterpret_cast<Store*>(graph);
    if (g->closed || graph_has_shadows(g)) return nullptr;
    const auto found = g->parameter_parts->find(tensor);
    if (found == g->parameter_parts->end()) return nullptr;
    int overflow = 0;
    const long long k = PyLong_AsLongLongAndOverflow(part, &overflow);
    if (overflow || (k == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return nullptr;
    }
    for (const auto& [known, node] : found->second)
      if (known == k) return checked(new_expression(g, node));
    return nullptr;
  });
}

PyObject* record_torch_call(PyObject* func, PyObject* args, PyObject* kwargs) {
  OwnTimeScope own;  // recording a call is flybatch's part of the build
  if (!g_handlers) raise(PyExc_RuntimeError, "torch_call: configure_front() was not called");
  return record(func, args, kwargs);
}

PyObject* capture_mode_call(PyObject* mode, PyObject* func, PyObject* types, PyObject* args,
                            PyObject* kwargs) {
  PyObject* call[4] = {func, types, args, kwargs};
  return torch_function(mode, call, 4, nullptr);
}

bool register_capture(PyObject* module) {
  s_shadows = PyUnicode_InternFromString("shadows");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_hash = PyUnicode_InternFromString("#");
  s_open_tuple = PyUnicode_InternFromString("(");
  s_open_list = PyUnicode_InternFromString("[");
  s_close = PyUnicode_InternFromString(")");
  s_bar = PyUnicode_InternFromString("|");
  s_slice = PyUnicode_InternFromString("slice");
  s_float = PyUnicode_InternFromString("float");
  s_bool = PyUnicode_InternFromString("bool");
  s_fast = PyUnicode_InternFromString("fast");
  s_add = PyUnicode_InternFromString("add");
  s_name = PyUnicode_InternFromString("__name__");
  s_self = PyUnicode_InternFromString("__self__");
  s_optimizer_step = PyUnicode_InternFromString("optimizer_step");
  s_closed = PyUnicode_InternFromString("closed");
  s_base = PyUnicode_InternFromString("_base");
  s_requires_grad = PyUnicode_InternFromString("requires_grad");
  s_is_leaf = PyUnicode_InternFromString("is_leaf");
  s_shadow_storages = PyUnicode_InternFromString("shadow_storages");
  s_untyped_storage = PyUnicode_InternFromString("untyped_storage");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_write_through = PyUnicode_InternFromString("write_through");
  s_dunder = PyUnicode_InternFromString("__");
  s_is_cpu = PyUnicode_InternFromString("is_cpu");
  s_shape_attr = PyUnicode_InternFromString("shape");
  s_index_input = PyUnicode_InternFromString("index input");
  s_ignore_index = PyUnicode_InternFromString("ignore_index");
  s_item = PyUnicode_InternFromString("item");
  s_stacklevel = PyUnicode_InternFromString("_stacklevel");
  s_out = PyUnicode_InternFromString("out");
  s_inplace = PyUnicode_InternFromString("inplace");
  s_apply = PyUnicode_InternFromString("apply");
  s_device = PyUnicode_InternFromString("device");
  s_dim = PyUnicode_InternFromString("dim");
  s_kind = PyUnicode_InternFromString("kind");
  s_plans = PyUnicode_InternFromString("plans");
  g_dim_name = Py_BuildValue("(O)", s_dim);
  s_leaf_nodes = PyUnicode_InternFromString("_leaf_nodes");
  s_view = PyUnicode_InternFromString("view");
  s_tuple = PyUnicode_InternFromString("tuple");
  s_ndim = PyUnicode_InternFromString("ndim");
  s_is_floating_point = PyUnicode_InternFromString("is_floating_point");
  g_one_element = Py_BuildValue("(i)", 1);
  s_padding_idx = PyUnicode_InternFromString("padding_idx");
  s_max_norm = PyUnicode_InternFromString("max_norm");
  s_norm_type = PyUnicode_InternFromString("norm_type");
  s_scale_grad_by_freq = PyUnicode_InternFromString("scale_grad_by_freq");
  s_sparse = PyUnicode_InternFromString("sparse");
  if (!s_padding_idx || !s_max_norm ||
      !s_norm_type || !s_scale_grad_by_freq || !s_sparse)
    return false;
  return s_item && s_apply && s_device && s_dim && s_kind && s_plans && g_dim_name && g_one_element && s_leaf_nodes && s_view &&
         s_tuple && s_ndim && s_is_floating_point && s_is_cpu && s_shape_attr && s_index_input && s_stacklevel && s_out && s_inplace && s_name && s_self && s_optimizer_step && s_closed && s_base &&
         s_requires_grad && s_is_leaf && s_shadow_storages && s_untyped_storage && s_data_ptr &&
         s_write_through && s_dunder && s_slice && s_float && s_bool && s_fast && s_add && s_shadows &&
         s_dtype && s_hash && s_open_tuple && s_open_list &&
         s_close && s_bar &&
         PyModule_AddFunctions(module, kCaptureMethods) == 0;
}

}  // namespace flybatch
