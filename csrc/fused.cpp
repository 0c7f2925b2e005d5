// The nodes of fb.nn's fused modules (flybatch/nn.py: `_core.fused(module, spec, inputs)`,
// `_core.FusedSpec`, and `_core.State`, which nn.State subclasses). A stage of op creation
// beside the op rules (rules.cpp): a fused node resolves its operands, checks its shapes and
// interns its signature with the rules' helpers (rules.h), and a State's `h` and `c` are
// nodes of the slice rule.
//
// A fused module (nn.py: LSTMCell, GRUCell, TreeLSTMCell) describes each kind of node it makes
// once, as a FusedSpec: the op, the parameters it reads, the shapes its inputs must have, its
// output shape and attr. A call is then ONE C entry, `fused(module, spec, inputs)`: children
// States unwrapped, the module's parameter nodes found in the graph's entry for it, shapes
// checked as ints, the signature (op, module tag, attr, input shapes) interned, the node
// appended and, for a recurrent cell, wrapped in a State. Nothing of it allocates a Python
// object per call but the handles it returns.
#include "rules.h"

#include <structmember.h>

#include <vector>

namespace flybatch {

namespace {

// The node a state's `h` or `c` reads: rows [start, start + hidden) of its `[h; c]`, made on
// first use, as `fb.slice_rows(hc, start, start + hidden)` makes it.
struct StateObject {
  PyObject_HEAD
  PyObject* hc;  // the Expression [h; c]
  Py_ssize_t hidden;
  PyObject* half[2];  // the h and c nodes, NULL until read
};

PyObject* state_half(PyObject* self, void* which) {
  StateObject* s = reinterpret_cast<StateObject*>(self);
  PyObject*& half = s->half[which ? 1 : 0];
  if (half) return Py_NewRef(half);
  PyObject* start = PyLong_FromSsize_t(which ? s->hidden : 0);
  PyObject* stop = start ? PyLong_FromSsize_t((which ? 2 : 1) * s->hidden) : nullptr;
  PyObject* out = nullptr;
  if (stop) out = slice_rows(s->hc, start, stop);
  Py_XDECREF(start);
  Py_XDECREF(stop);
  if (out) half = Py_NewRef(out);
  return out;
}

// A State of `type` (StateType or a subclass) holding `hc`; steals nothing.
PyObject* new_state(PyTypeObject* type, PyObject* hc, Py_ssize_t hidden) {
  StateObject* s = reinterpret_cast<StateObject*>(type->tp_alloc(type, 0));
  if (!s) return nullptr;
  s->hc = Py_NewRef(hc);
  s->hidden = hidden;
  return reinterpret_cast<PyObject*>(s);
}

PyObject* state_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"hc", "hidden", nullptr};
  PyObject* hc;
  Py_ssize_t hidden;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!n:State", const_cast<char**>(names),
                                   &ExpressionBase, &hc, &hidden))
    return nullptr;
  return new_state(type, hc, hidden);
}

int state_traverse(PyObject* self, visitproc visit, void* arg) {
  StateObject* s = reinterpret_cast<StateObject*>(self);
  Py_VISIT(s->hc);
  Py_VISIT(s->half[0]);
  Py_VISIT(s->half[1]);
  return 0;
}

int state_clear(PyObject* self) {
  StateObject* s = reinterpret_cast<StateObject*>(self);
  Py_CLEAR(s->hc);
  Py_CLEAR(s->half[0]);
  Py_CLEAR(s->half[1]);
  return 0;
}

void state_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  state_clear(self);
  Py_TYPE(self)->tp_free(self);  // (a heap subclass's reference to its type: subtype_dealloc)
}

PyObject* state_h(PyObject* self, void*) { return state_half(self, nullptr); }

PyObject* state_c(PyObject* self, void*) { return state_half(self, self); }

PyGetSetDef kStateGetSet[] = {
    {"h", state_h, nullptr, "The output (hidden state): a slice node of [h; c], made once.",
     nullptr},
    {"c", state_c, nullptr, "The memory cell: a slice node of [h; c], made once.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMemberDef kStateMembers[] = {
    {"hc", T_OBJECT_EX, offsetof(StateObject, hc), READONLY, "the node [h; c]"},
    {"hidden", T_PYSSIZET, offsetof(StateObject, hidden), READONLY, "the size of h (and c)"},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject StateType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;
  t.tp_name = "flybatch._core.State";
  t.tp_basicsize = sizeof(StateObject);
  t.tp_dealloc = state_dealloc;
  t.tp_free = PyObject_GC_Del;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  t.tp_traverse = state_traverse;
  t.tp_clear = state_clear;
  t.tp_getset = kStateGetSet;
  t.tp_members = kStateMembers;
  t.tp_new = state_new;
  t.tp_doc = "State(hc, hidden): a recurrent cell's state, the node [h; c] (fb.nn.State).";
  return t;
}();

struct FusedSpec {
  PyObject_HEAD
  PyObject* args;   // the constructor's arguments (repr, pickling)
  PyObject* op;
  PyObject* name;   // op.name
  std::int32_t code;
  PyObject* params;                   // tuple of parameter names
  PyObject* expect;                   // tuple of the keyed inputs' shapes
  std::vector<std::vector<i64>>* expect_dims;
  std::vector<i64>* out_dims;
  PyObject* attr;
  std::vector<i64>* attr_key;         // the attr as key ints; NULL: key it by its Python value
  Py_ssize_t states;                  // the first `states` inputs must be States
  PyObject* child_shape;              // ragged: the shape of each child after the keyed inputs
  std::vector<i64>* child_dims;       // (NULL: a fixed number of inputs)
  PyTypeObject* state_type;           // wrap the node in this State type (NULL: an Expression)
};

std::vector<i64> int_list(PyObject* seq, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (!fast) throw PythonError{};
  Release r{fast};
  std::vector<i64> out(PySequence_Fast_GET_SIZE(fast));
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_ITEMS(fast)[i]);
    if (out[i] == -1 && PyErr_Occurred()) throw PythonError{};
  }
  return out;
}

std::vector<i64> dims_from(PyObject* shape, const char* what) {
  if (!PyTuple_Check(shape))
    raise(PyExc_TypeError, "FusedSpec: %s must be a tuple of ints, not %R", what, shape);
  return int_list(shape, what);
}

// The attr as ints when it is one of the usual ones (None, an int, a tuple of ints or bools:
// arities, flags; a bool keys as 0 or 1, as it hashes), else NULL.
std::vector<i64>* attr_key_of(PyObject* attr) {
  if (attr == Py_None) return new std::vector<i64>{-1};
  if (PyLong_CheckExact(attr)) {
    const long long v = PyLong_AsLongLong(attr);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    return v >= 0 ? new std::vector<i64>{v} : nullptr;  // arities are >= 0
  }
  if (!PyTuple_CheckExact(attr) || PyTuple_GET_SIZE(attr) == 0) return nullptr;
  std::vector<i64> key{-2 - PyTuple_GET_SIZE(attr)};  // its length, then its items
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attr); ++i) {
    PyObject* item = PyTuple_GET_ITEM(attr, i);
    const long long v = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
    if (v == -1 && (!PyLong_Check(item) || PyErr_Occurred())) {
      PyErr_Clear();  // an int too large for the key: the Python key
      return nullptr;
    }
    key.push_back(v);
  }
  return new std::vector<i64>(std::move(key));
}

void spec_free_fields(FusedSpec* s) {
  Py_CLEAR(s->args);
  Py_CLEAR(s->op);
  Py_CLEAR(s->name);
  Py_CLEAR(s->params);
  Py_CLEAR(s->expect);
  Py_CLEAR(s->attr);
  Py_CLEAR(s->child_shape);
  Py_CLEAR(s->state_type);
  delete s->expect_dims;
  delete s->out_dims;
  delete s->attr_key;
  delete s->child_dims;
  s->expect_dims = nullptr;
  s->out_dims = s->attr_key = s->child_dims = nullptr;
}

PyObject* spec_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"op",     "params",      "expect", "shape", "attr",
                                "states", "child_shape", "state",  nullptr};
  PyObject *op, *params, *expect, *shape, *attr = Py_None, *child_shape = Py_None,
                                          *state = Py_None;
  Py_ssize_t states = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!|OnOO:FusedSpec",
                                   const_cast<char**>(names), &op, &PyTuple_Type, &params,
                                   &PyTuple_Type, &expect, &PyTuple_Type, &shape, &attr, &states,
                                   &child_shape, &state))
    return nullptr;
  FusedSpec* s = reinterpret_cast<FusedSpec*>(type->tp_alloc(type, 0));
  if (!s) return nullptr;
  PyObject* out = guarded([&]() -> PyObject* {
    if (state != Py_None && (!PyType_Check(state) ||
                             !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(state), &StateType)))
      raise(PyExc_TypeError, "FusedSpec: state must be a subclass of _core.State, not %R", state);
    s->args = checked(Py_BuildValue("(OOOOOnOO)", op, params, expect, shape, attr, states,
                                    child_shape, state));
    s->op = Py_NewRef(op);
    s->name = checked(PyObject_GetAttrString(op, "name"));
    s->code = op_code(op);
    s->params = Py_NewRef(params);
    s->expect = Py_NewRef(expect);
    s->expect_dims = new std::vector<std::vector<i64>>;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(expect); ++k)
      s->expect_dims->push_back(dims_from(PyTuple_GET_ITEM(expect, k), "expect's shapes"));
    s->out_dims = new std::vector<i64>(dims_from(shape, "shape"));
    s->attr = Py_NewRef(attr);
    s->attr_key = attr_key_of(attr);
    s->states = states;
    s->child_shape = Py_NewRef(child_shape);
    if (child_shape != Py_None)
      s->child_dims = new std::vector<i64>(dims_from(child_shape, "child_shape"));
    s->state_type = state == Py_None ? nullptr
                                     : reinterpret_cast<PyTypeObject*>(Py_NewRef(state));
    if (s->state_type && s->out_dims->size() != 1)
      raise(PyExc_ValueError, "FusedSpec: a State is a vector [h; c], not of shape %R", shape);
    return reinterpret_cast<PyObject*>(s);
  });
  if (!out) Py_DECREF(s);
  return out;
}

void spec_dealloc(PyObject* self) {
  spec_free_fields(reinterpret_cast<FusedSpec*>(self));
  Py_TYPE(self)->tp_free(self);
}

PyObject* spec_repr(PyObject* self) {
  return PyUnicode_FromFormat("FusedSpec%R", reinterpret_cast<FusedSpec*>(self)->args);
}

// Pickled as its arguments; copied as itself (it holds no state, and its op is a constant).
PyObject* spec_reduce(PyObject* self, PyObject*) {
  return Py_BuildValue("(OO)", Py_TYPE(self), reinterpret_cast<FusedSpec*>(self)->args);
}

PyObject* spec_copy(PyObject* self, PyObject*) { return Py_NewRef(self); }

PyMethodDef kSpecMethods[] = {
    {"__reduce__", spec_reduce, METH_NOARGS, nullptr},
    {"__copy__", spec_copy, METH_NOARGS, nullptr},
    {"__deepcopy__", spec_copy, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyMemberDef kSpecMembers[] = {
    {"op", T_OBJECT_EX, offsetof(FusedSpec, op), READONLY, nullptr},
    {"params", T_OBJECT_EX, offsetof(FusedSpec, params), READONLY, nullptr},
    {"expect", T_OBJECT_EX, offsetof(FusedSpec, expect), READONLY, nullptr},
    {"attr", T_OBJECT, offsetof(FusedSpec, attr), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject FusedSpecType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;
  t.tp_name = "flybatch._core.FusedSpec";
  t.tp_basicsize = sizeof(FusedSpec);
  t.tp_dealloc = spec_dealloc;
  t.tp_repr = spec_repr;
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_methods = kSpecMethods;
  t.tp_members = kSpecMembers;
  t.tp_new = spec_new;
  t.tp_doc =
      "FusedSpec(op, params, expect, shape, attr=None, states=0, child_shape=None,\n"
      "          state=None)\n\n"
      "One kind of node of a fused module: `op` over inputs of shapes `expect` and the module's\n"
      "parameters named `params`, of shape `shape`; batched by the module's tag, the input\n"
      "shapes and `attr`. The first `states` inputs are children States (their [h; c]). With\n"
      "`child_shape`, any number of children States of that shape follow the keyed inputs, and\n"
      "their nodes follow the parameters, out of the signature. `state`: a _core.State subclass\n"
      "that wraps the node (a recurrent cell's [h; c]), else the node is returned.";
  return t;
}();

// The graph's entry for `module` (nn.FusedModule._in_graph: (module, tag, table, lists)), a
// new reference.
PyObject* module_entry(Store* g, PyObject* module) {
  static PyObject* s_tags = PyUnicode_InternFromString("tags");
  static PyObject* s_in_graph = PyUnicode_InternFromString("_in_graph");
  PyObject* tags = checked(PyObject_GetAttr(reinterpret_cast<PyObject*>(g), s_tags));
  Release r1{tags};
  PyObject* id = checked(PyLong_FromVoidPtr(module));
  Release r2{id};
  PyObject* entry = PyDict_Check(tags) ? PyDict_GetItemWithError(tags, id) : nullptr;
  if (entry) return Py_NewRef(entry);
  if (PyErr_Occurred()) throw PythonError{};
  return checked(PyObject_CallMethodOneArg(module, s_in_graph, reinterpret_cast<PyObject*>(g)));
}

// The nodes of the spec's parameters in `entry`, cached in the entry's dict of lists by spec.
void push_params(FusedSpec* spec, PyObject* entry, std::vector<i64>& args) {
  PyObject* table = PyTuple_GET_ITEM(entry, 2);
  PyObject* lists = PyTuple_GET_ITEM(entry, 3);
  PyObject* nodes = PyDict_GetItemWithError(lists, reinterpret_cast<PyObject*>(spec));
  if (!nodes) {
    if (PyErr_Occurred()) throw PythonError{};
    const Py_ssize_t n = PyTuple_GET_SIZE(spec->params);
    Owned made(PyTuple_New(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* node = PyObject_GetItem(table, PyTuple_GET_ITEM(spec->params, i));
      PyTuple_SET_ITEM(made.get(), i, checked(node));
    }
    if (PyDict_SetItem(lists, reinterpret_cast<PyObject*>(spec), made.get()) < 0)
      throw PythonError{};
    nodes = made.get();  // held by the dict
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(nodes); ++i) {
    const long long node = PyLong_AsLongLong(PyTuple_GET_ITEM(nodes, i));
    if (node == -1 && PyErr_Occurred()) throw PythonError{};
    args.push_back(node);
  }
}

PyObject* fused_call(PyObject* module, FusedSpec* spec, PyObject* inputs_in) {
  PyObject* inputs = checked(PySequence_Fast(inputs_in, "fused: inputs must be a sequence"));
  Release r1{inputs};
  const std::size_t n = PySequence_Fast_GET_SIZE(inputs);
  const std::size_t keyed = spec->expect_dims->size();
  if (spec->child_dims ? n < keyed : n != keyed)
    raise(PyExc_TypeError, "%U takes %zu inputs, got %zu", spec->name, keyed, n);
  // Children States read as their [h; c]: the first `states` inputs, and a ragged op's tail.
  std::vector<PyObject*> operands(PySequence_Fast_ITEMS(inputs),
                                  PySequence_Fast_ITEMS(inputs) + n);
  for (std::size_t i = 0; i < n; ++i) {
    if (!(static_cast<Py_ssize_t>(i) < spec->states || (spec->child_dims && i >= keyed)))
      continue;
    if (!PyObject_TypeCheck(operands[i], &StateType))
      raise(PyExc_TypeError, "%s: a child must be an fb.nn.State, not %s; make one with "
                             "fb.nn.State.of(h=..., c=...)", Py_TYPE(module)->tp_name,
            Py_TYPE(operands[i])->tp_name);
    operands[i] = reinterpret_cast<StateObject*>(operands[i])->hc;
  }
  GraphRef ref(graph_of(operands.data(), n));
  Store* g = ref.g;
  std::vector<i64> args;
  args.reserve(n + PyTuple_GET_SIZE(spec->params));
  for (std::size_t i = 0; i < keyed; ++i) {
    const i64 node = node_of(g, operands[i]);
    const Dims dims = dims_of(g, node);
    const std::vector<i64>& want = (*spec->expect_dims)[i];
    if (!(dims == Dims{want.data(), want.size()}))
      shape_error("%U: argument %zu has shape %R, expected %R", spec->name, i,
                  shape_tuple(g, node), PyTuple_GET_ITEM(spec->expect, i));
    args.push_back(node);
  }
  Owned entry(module_entry(g, module));
  push_params(spec, entry.get(), args);
  for (std::size_t i = keyed; i < n; ++i) {  // a ragged op's children
    const i64 node = node_of(g, operands[i]);
    const std::vector<i64>& want = *spec->child_dims;
    if (!(dims_of(g, node) == Dims{want.data(), want.size()}))
      shape_error("%U: child %zu has [h; c] of shape %R, expected %R", spec->name, i - keyed,
                  shape_tuple(g, node), spec->child_shape);
    args.push_back(node);
  }
  PyObject* tag = PyTuple_GET_ITEM(entry.get(), 1);
  const bool no_grad = !grad_enabled();
  auto python_key = [&] {
    PyObject* shapes = shapes_tuple(g, args.data(), keyed);
    PyObject* key = Py_BuildValue("(OONO)", spec->name, tag, shapes, spec->attr);
    if (!key) throw PythonError{};
    return key;
  };
  i64 sig;
  if (spec->attr_key) {
    Key key;
    key.push(spec->code);
    key.push(PyLong_AsLongLong(PyTuple_GET_ITEM(tag, 1)));
    for (const i64 k : *spec->attr_key) key.push(k);
    for (std::size_t i = 0; i < keyed; ++i) key.push(g->nodes->shape[args[i]]);
    key.push(no_grad);
    sig = signature(g, key, no_grad, python_key);
  } else {  // an attr of another kind: its whole Python key, every time
    PyObject* key = python_key();
    if (no_grad) key = new_tuple({PyUnicode_FromString("no_grad"), key});
    Release r2{key};
    sig = python_sig(g, key);
  }
  check_open(g);
  const std::vector<i64>& out = *spec->out_dims;
  PyObject* node = append(g, spec->code, args.data(), args.size(),
                          intern_shape(g, out.data(), out.size()), sig, spec->attr, no_grad);
  if (!spec->state_type) return node;
  Release r3{node};
  return checked(new_state(spec->state_type, node, out[0] / 2));
}

const char kFusedDoc[] =
    "fused(module, spec, inputs) -> Expression | State\n\n"
    "One node of fused module `module` of the kind `spec` (a FusedSpec) over `inputs`: its\n"
    "shapes checked, its parameters' nodes read from the graph's entry for the module\n"
    "(nn.FusedModule._in_graph), batched with the module's other nodes of equal spec and\n"
    "input shapes.";

PyObject* fused(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 3 || !PyObject_TypeCheck(argv[1], &FusedSpecType)) {
    PyErr_SetString(PyExc_TypeError, "fused(module, spec: FusedSpec, inputs)");
    return nullptr;
  }
  return creating_nodes([&] {
    return fused_call(argv[0], reinterpret_cast<FusedSpec*>(argv[1]), argv[2]);
  });
}

PyMethodDef kFusedFunctions[] = {
    {"fused", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fused)), METH_FASTCALL,
     kFusedDoc},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool register_fused(PyObject* module) {
  return PyType_Ready(&StateType) == 0 && PyType_Ready(&FusedSpecType) == 0 &&
         PyModule_AddObjectRef(module, "State", reinterpret_cast<PyObject*>(&StateType)) == 0 &&
         PyModule_AddObjectRef(module, "FusedSpec",
                               reinterpret_cast<PyObject*>(&FusedSpecType)) == 0 &&
         PyModule_AddFunctions(module, kFusedFunctions) == 0;
}

}  // namespace flybatch
