// The node store (`_core.Store`, which graph.Graph subclasses) and the Expression handle
// (`_core.Expression`, whose Python methods live on graph.Expression, a subclass with no
// __dict__). Appending a node writes a few ints to columns and allocates one 32-byte handle;
// the scheduler and executor read the columns as zero-copy buffers (`Store.view`).
#include "store.h"

#include <dlfcn.h>
#include <structmember.h>

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <string>

namespace flybatch {

// ---- errors ------------------------------------------------------------------------------------
void raise(PyObject* type, const char* format, ...) {
  va_list args;
  va_start(args, format);
  PyErr_FormatV(type, format, args);
  va_end(args);
  throw PythonError{};
}

PyObject* g_graph_error = nullptr;
PyObject* g_current_graph = nullptr;
PyObject* g_shape_error = nullptr;
PyObject* g_tensor_type = nullptr;
PyObject* g_mode_enabled = nullptr;
PyObject* g_expression_type = nullptr;

// The two thread-local flags read per op call, torch.is_grad_enabled and
// torch._C._is_torch_function_mode_enabled, are each a Python function returning one C++
// function of torch's libraries. Called through Python they cost ~40-60 ns each (a call and
// torch's error guard around it), a tenth of a node's build; so `configure` looks the C++
// functions up in the libraries torch has loaded and the core calls them directly (~2 ns). Not
// found (a torch built otherwise), the Python functions serve as before.
using TorchFlag = bool (*)();
TorchFlag g_grad_mode = nullptr;      // c10::GradMode::is_enabled
TorchFlag g_function_mode = nullptr;  // at::impl::torch_function_mode_enabled
// So is the length of the mode stack, at::impl::PythonTorchFunctionTLS::stack_len (its Python
// stand-in torch._C._len_torch_function_stack).
using StackLen = std::int64_t (*)();
StackLen g_stack_len = nullptr;
PyObject* g_stack_len_py = nullptr;
// So is torch.autocast's flag of a device type, at::autocast::is_autocast_enabled(DeviceType)
// (c10::DeviceType is an enum class of int8_t: CPU 0, CUDA 1); its Python stand-in is
// torch._C._is_any_autocast_enabled (any device type).
using AutocastFlag = bool (*)(std::int8_t);
AutocastFlag g_autocast = nullptr;
PyObject* g_any_autocast = nullptr;

namespace {
void* loaded_symbol(const char* library, const char* symbol) {
  void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);  // only if torch loaded it
  if (!handle) return nullptr;
  void* f = dlsym(handle, symbol);
  dlclose(handle);  // torch's own load keeps the library
  return f;
}

TorchFlag loaded_function(const char* library, const char* symbol) {
  return reinterpret_cast<TorchFlag>(loaded_symbol(library, symbol));
}
}  // namespace

std::int64_t torch_function_stack_len() {
  if (g_stack_len) return g_stack_len();
  PyObject* n = PyObject_CallNoArgs(g_stack_len_py);
  if (!n) throw PythonError{};
  const long long v = PyLong_AsLongLong(n);
  Py_DECREF(n);
  if (v == -1 && PyErr_Occurred()) throw PythonError{};
  return v;
}

bool torch_function_mode_enabled() {
  if (g_function_mode) return g_function_mode();
  PyObject* on = PyObject_CallNoArgs(g_mode_enabled);
  if (!on) throw PythonError{};
  Py_DECREF(on);
  return on == Py_True;
}

namespace {

PyObject* g_is_grad_enabled = nullptr;  // torch.is_grad_enabled
// The op table: op code -> ops.Op, shared by every graph (ops are module constants).
std::vector<PyObject*> g_ops;
std::unordered_map<PyObject*, std::int32_t> g_op_codes;

i64 as_int(PyObject* x) {
  const long long v = PyLong_AsLongLong(x);
  if (v == -1 && PyErr_Occurred()) throw PythonError{};
  return v;
}

// ---- Block: a column's storage, exported as a buffer -------------------------------------------
void block_dealloc(PyObject* self) {
  PyMem_RawFree(reinterpret_cast<Block*>(self)->data);
  Py_TYPE(self)->tp_free(self);
}

int block_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  Block* b = reinterpret_cast<Block*>(self);
  if (flags & PyBUF_WRITABLE) {
    PyErr_SetString(PyExc_BufferError, "the node store's columns are read-only");
    return -1;
  }
  // The shape of each export lives with the export: later ones may show more items.
  Py_ssize_t* shape = static_cast<Py_ssize_t*>(PyMem_Malloc(sizeof(Py_ssize_t)));
  if (!shape) {
    PyErr_NoMemory();
    return -1;
  }
  *shape = b->exported;
  view->obj = Py_NewRef(self);
  view->buf = b->data;
  view->len = b->exported * b->itemsize;
  view->readonly = 1;
  view->itemsize = b->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>(b->format) : nullptr;
  view->ndim = 1;
  view->shape = (flags & PyBUF_ND) ? shape : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &view->itemsize : nullptr;
  view->suboffsets = nullptr;
  view->internal = shape;
  return 0;
}

void block_releasebuffer(PyObject*, Py_buffer* view) { PyMem_Free(view->internal); }

PyBufferProcs kBlockBuffer = {block_getbuffer, block_releasebuffer};

PyTypeObject BlockType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;  // a static type; PyType_Ready fills in the rest
  t.tp_name = "flybatch._core.Block";
  t.tp_basicsize = sizeof(Block);
  t.tp_dealloc = block_dealloc;
  t.tp_as_buffer = &kBlockBuffer;
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "Storage of one column of a node store (exported as a read-only buffer).";
  return t;
}();

}  // namespace

Block* new_block(Py_ssize_t itemsize, const char* format, Py_ssize_t capacity) {
  Block* b = PyObject_New(Block, &BlockType);
  if (!b) throw PythonError{};
  b->itemsize = itemsize;
  b->capacity = capacity;
  b->exported = 0;
  b->format = format;
  b->data = static_cast<char*>(PyMem_RawMalloc(capacity ? capacity * itemsize : 1));
  if (!b->data) {
    Py_DECREF(b);
    throw std::bad_alloc();
  }
  return b;
}

// ---- KeyTable ----------------------------------------------------------------------------------
std::uint64_t KeyTable::hash(const i64* key, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull ^ n;
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<std::uint64_t>(key[i])) * 0x100000001b3ull;
  return h ^ (h >> 32);  // the table indexes by the low bits: fold the high ones in
}

std::int32_t KeyTable::find(const i64* key, std::size_t n, std::uint64_t hash) const {
  if (slots_.empty()) return -1;
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t at = hash & mask;; at = (at + 1) & mask) {
    const std::int32_t id = slots_[at];
    if (id < 0) return -1;
    if (hashes_[id] != hash || length(id) != n) continue;
    const i64* k = this->key(id);
    std::size_t i = 0;
    while (i < n && k[i] == key[i]) ++i;  // short keys: a loop beats a call to memcmp
    if (i == n) return id;
  }
}

std::int32_t KeyTable::insert(const i64* key, std::size_t n, std::uint64_t hash) {
  const auto id = static_cast<std::int32_t>(size());
  pool_.insert(pool_.end(), key, key + n);
  start_.push_back(pool_.size());
  hashes_.push_back(hash);
  if (2 * hashes_.size() > slots_.size()) grow();  // (re)places every id, this one included
  else {
    const std::size_t mask = slots_.size() - 1;
    std::size_t at = hash & mask;
    while (slots_[at] >= 0) at = (at + 1) & mask;
    slots_[at] = id;
  }
  return id;
}

void KeyTable::grow() {
  slots_.assign(std::max<std::size_t>(16, 2 * slots_.size()), -1);
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t id = 0; id < hashes_.size(); ++id) {
    std::size_t at = hashes_[id] & mask;
    while (slots_[at] >= 0) at = (at + 1) & mask;
    slots_[at] = static_cast<std::int32_t>(id);
  }
}

// ---- the store ---------------------------------------------------------------------------------
i64 n_nodes(const Store* s) { return s->nodes->op.size(); }

std::size_t op_count() { return g_ops.size(); }
PyObject* op_object(std::int32_t code) { return g_ops[code]; }

void check_open(const Store* s) {
  if (s->closed)
    raise(g_graph_error, "this graph is closed; create a new one (fb.Graph() / fb.new_graph())");
}

PyObject* graph_node_dtypes(Store* s) {
  if (!s->node_dtypes || !PyDict_Check(s->node_dtypes))
    raise(PyExc_TypeError, "graph.node_dtypes must be a dict");
  return s->node_dtypes;
}

void set_node_dtype(Store* s, i64 node, PyObject* dtype) {
  Owned id{PyLong_FromLongLong(node)};
  if (!id.get() || PyDict_SetItem(graph_node_dtypes(s), id.get(), dtype) < 0) throw PythonError{};
  s->nodes->other_dtype.data()[node] = 1;
}

PyObject* node_dtype(Store* s, i64 node) {
  if (!s->nodes->other_dtype[node]) return nullptr;
  Owned id{PyLong_FromLongLong(node)};
  PyObject* dtype = PyDict_GetItemWithError(graph_node_dtypes(s), id.get());  // borrowed
  if (!dtype && PyErr_Occurred()) throw PythonError{};
  return dtype;
}

bool graph_has_shadows(Store* s) {
  if (!s->shadows || !PyDict_Check(s->shadows))
    raise(PyExc_TypeError, "graph.shadows must be a dict");
  return PyDict_GET_SIZE(s->shadows) != 0;
}

std::int32_t op_code(PyObject* op) {
  const auto found = g_op_codes.find(op);
  if (found != g_op_codes.end()) return found->second;
  // Held for the life of the process: ops are module constants, a handful in all.
  const auto code = static_cast<std::int32_t>(g_ops.size());
  g_ops.push_back(Py_NewRef(op));
  g_op_codes.emplace(op, code);
  return code;
}

std::int32_t intern_shape(Store* s, const i64* dims, std::size_t n) {
  const std::uint64_t h = KeyTable::hash(dims, n);
  std::int32_t id = s->shape_keys->find(dims, n, h);
  if (id >= 0) return id;
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (!tuple) throw PythonError{};
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* d = PyLong_FromLongLong(dims[i]);
    if (!d) {
      Py_DECREF(tuple);
      throw PythonError{};
    }
    PyTuple_SET_ITEM(tuple, i, d);
  }
  s->shape_tuples->push_back(tuple);
  return s->shape_keys->insert(dims, n, h);
}

const i64* shape_dims(const Store* s, std::int32_t id, std::size_t* n) {
  *n = s->shape_keys->length(id);
  return s->shape_keys->key(id);
}

bool autocast_enabled() {
  constexpr std::int8_t kCpu = 0, kCuda = 1;
  if (g_autocast) return g_autocast(kCpu) || g_autocast(kCuda);
  PyObject* on = PyObject_CallNoArgs(g_any_autocast);
  if (!on) throw PythonError{};
  Py_DECREF(on);
  return on == Py_True;
}

bool grad_enabled() {
  if (g_grad_mode) return g_grad_mode();
  PyObject* mode = PyObject_CallNoArgs(g_is_grad_enabled);
  if (!mode) throw PythonError{};
  Py_DECREF(mode);  // True or False: immortal enough to compare after the decref
  return mode == Py_True;
}

PyObject* new_expression(Store* s, i64 id) {
  PyTypeObject* type = g_expression_type ? reinterpret_cast<PyTypeObject*>(g_expression_type)
                                          : &ExpressionBase;
  // tp_alloc: the Python subclass is a heap type, and those are garbage-collected objects.
  Expression* e = reinterpret_cast<Expression*>(type->tp_alloc(type, 0));
  if (!e) return nullptr;
  e->graph = reinterpret_cast<Store*>(Py_NewRef(reinterpret_cast<PyObject*>(s)));
  e->id = id;
  e->view = -1;
  return reinterpret_cast<PyObject*>(e);
}

PyObject* append(Store* s, std::int32_t op, const i64* args, std::size_t n_args,
                 std::int32_t shape, i64 sig, PyObject* attr, bool no_grad, i64 index) {
  Columns& c = *s->nodes;
  const i64 node = n_nodes(s);
  // Depth counts pending inputs only: an input computed by an earlier forward is as available
  // as a leaf, so the next forward's scheduling should not wait for it.
  i64 depth = 0;
  for (std::size_t i = 0; i < n_args; ++i) {
    const i64 a = args[i];
    if (a >= s->n_done && c.depth[a] + 1 > depth) depth = c.depth[a] + 1;
    if (a < s->n_done && depth < 1) depth = 1;
  }
  if (s->origin_hook) {  // debug mode: where the node was written, before anything is stored
    PyObject* id = PyLong_FromLongLong(node);
    if (!id) throw PythonError{};
    PyObject* r = PyObject_CallOneArg(s->origin_hook, id);
    Py_DECREF(id);
    if (!r) throw PythonError{};
    Py_DECREF(r);
  }
  PyObject* handle = new_expression(s, node);
  if (!handle) throw PythonError{};
  try {
    if (c.arg_ptr.size() == 0) c.arg_ptr.push(0);
    for (std::size_t i = 0; i < n_args; ++i) c.arg_flat.push(args[i]);
    c.arg_ptr.push(c.arg_flat.size());
    c.sig.push(sig);
    c.depth.push(depth);
    c.shape.push(shape);
    c.no_grad.push(no_grad);
    c.other_dtype.push(0);
    c.index.push(index);
    s->attrs->push_back(attr == Py_None ? nullptr : Py_XNewRef(attr));
    c.op.push(op);  // last: n_nodes counts complete nodes only
  } catch (...) {
    Py_DECREF(handle);
    throw;
  }
  return handle;
}

i64 python_sig(Store* s, PyObject* key) {
  PyObject* found = PyDict_GetItemWithError(s->sig_ids, key);
  if (found) return PyLong_AsLongLong(found);
  if (PyErr_Occurred()) throw PythonError{};
  const Py_ssize_t sig = PyList_GET_SIZE(s->sig_keys);
  PyObject* number = PyLong_FromSsize_t(sig);
  if (!number) throw PythonError{};
  const int failed =
      PyDict_SetItem(s->sig_ids, key, number) < 0 || PyList_Append(s->sig_keys, key) < 0;
  Py_DECREF(number);
  if (failed) throw PythonError{};
  return sig;
}

bool length_led(const Store* s, i64 node) {
  const auto sig = static_cast<std::size_t>(s->nodes->sig[node]);
  return sig < s->length_led->size() && (*s->length_led)[sig] &&
         s->shape_keys->length(s->nodes->shape[node]) > 0;  // (a scalar has no length)
}

void mark_length_led(Store* s, i64 sig) {
  auto& led = *s->length_led;
  if (static_cast<std::size_t>(sig) >= led.size()) led.resize(sig + 1, 0);
  led[sig] = 1;
}

namespace {

Store* as_store(PyObject* self) { return reinterpret_cast<Store*>(self); }

i64 node_arg(Store* s, PyObject* arg) {
  const i64 v = as_int(arg);
  if (v < 0 || v >= n_nodes(s)) raise(PyExc_IndexError, "node %lld is not in this graph", v);
  return v;
}

PyObject* store_new(PyTypeObject* type, PyObject*, PyObject*) {
  Store* s = reinterpret_cast<Store*>(type->tp_alloc(type, 0));
  if (!s) return nullptr;
  try {
    s->nodes = new Columns();
    s->attrs = new std::vector<PyObject*>();
    s->shape_keys = new KeyTable();
    s->shape_tuples = new std::vector<PyObject*>();
    s->sig_keys_c = new KeyTable();
    s->sig_of_key = new std::vector<i64>();
    s->length_led = new std::vector<std::uint8_t>();
    s->param_tags = new std::unordered_map<i64, PyObject*>();
    s->scalars = new std::unordered_map<std::uint64_t, i64>();
    s->table_tags = new std::unordered_map<PyObject*, PyObject*>();
    s->parameters = new std::unordered_map<PyObject*, i64>();
    s->table_shapes = new std::unordered_map<PyObject*, std::pair<i64, i64>>();
    for (auto& attrs : s->lookup_attrs) attrs = new std::unordered_map<PyObject*, PyObject*>();
    s->call_plans = new std::unordered_map<std::string_view, PlannedCall*>();
    s->learnt_plans = new std::unordered_map<PyObject*, LearntPlan*>();
    s->parameter_parts = new std::unordered_map<PyObject*, std::vector<std::pair<i64, i64>>>();
    s->embedding_tables = new std::unordered_map<PyObject*, std::pair<i64, i64>>();
  } catch (const std::bad_alloc&) {
    Py_DECREF(s);
    return PyErr_NoMemory();
  }
  s->sig_ids = PyDict_New();
  s->sig_keys = PyList_New(0);
  s->fixed_dtype = Py_NewRef(Py_None);
  s->node_dtypes = PyDict_New();
  s->shadows = PyDict_New();
  if (!s->sig_ids || !s->sig_keys || !s->node_dtypes || !s->shadows) {
    Py_DECREF(s);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(s);
}

void clear_attrs(Store* s) {
  if (!s->attrs) return;
  std::vector<PyObject*> attrs;
  attrs.swap(*s->attrs);  // emptied first: a freed attr may run code that reads the store
  s->attrs->assign(attrs.size(), nullptr);
  for (PyObject* a : attrs) Py_XDECREF(a);
}

// The per-object caches of the rules; their keys are held by graph.tags until close.
void clear_caches(Store* s) {
  if (s->param_tags) {
    std::unordered_map<i64, PyObject*> tags;
    tags.swap(*s->param_tags);
    for (auto& [node, tag] : tags) Py_DECREF(tag);
  }
  if (s->table_tags) {
    std::unordered_map<PyObject*, PyObject*> tags;
    tags.swap(*s->table_tags);
    for (auto& [table, tag] : tags) Py_DECREF(tag);
  }
  if (s->call_plans) {
    std::unordered_map<std::string_view, PlannedCall*> plans;
    plans.swap(*s->call_plans);
    for (auto& [form, planned] : plans) delete planned;
  }
  if (s->learnt_plans) {
    std::unordered_map<PyObject*, LearntPlan*> learnt;
    learnt.swap(*s->learnt_plans);
    for (auto& [plan, node] : learnt) delete node;
  }
  if (s->scalars) s->scalars->clear();
  if (s->parameters) s->parameters->clear();
  if (s->parameter_parts) s->parameter_parts->clear();
  if (s->embedding_tables) s->embedding_tables->clear();
  if (s->table_shapes) s->table_shapes->clear();
  for (auto* attrs : s->lookup_attrs) {
    if (!attrs) continue;
    std::unordered_map<PyObject*, PyObject*> held;
    held.swap(*attrs);
    for (auto& [table, attr] : held) Py_DECREF(attr);
  }
}

int store_traverse(PyObject* self, visitproc visit, void* arg) {
  Store* s = as_store(self);
  if (s->attrs)
    for (PyObject* a : *s->attrs) Py_VISIT(a);
  Py_VISIT(s->origin_hook);
  Py_VISIT(s->fixed_dtype);
  Py_VISIT(s->node_dtypes);
  Py_VISIT(s->shadows);
  return 0;
}

int store_clear(PyObject* self) {
  Store* s = as_store(self);
  clear_attrs(s);
  clear_caches(s);
  Py_CLEAR(s->origin_hook);
  Py_CLEAR(s->fixed_dtype);
  Py_CLEAR(s->node_dtypes);
  Py_CLEAR(s->shadows);
  return 0;
}

void store_dealloc(PyObject* self) {
  Store* s = as_store(self);
  PyObject_GC_UnTrack(self);
  store_clear(self);
  Py_CLEAR(s->sig_ids);
  Py_CLEAR(s->sig_keys);
  if (s->shape_tuples)
    for (PyObject* t : *s->shape_tuples) Py_DECREF(t);
  delete s->nodes;
  delete s->attrs;
  delete s->shape_keys;
  delete s->shape_tuples;
  delete s->sig_keys_c;
  delete s->sig_of_key;
  delete s->length_led;
  delete s->param_tags;
  delete s->scalars;
  delete s->table_tags;
  delete s->parameters;
  delete s->table_shapes;
  for (auto* attrs : s->lookup_attrs) delete attrs;
  delete s->call_plans;
  delete s->learnt_plans;
  delete s->parameter_parts;
  delete s->embedding_tables;
  Py_TYPE(self)->tp_free(self);
}

const char kAddDoc[] =
    "add(op, args, shape, sig_key, attr=None, index=0) -> Expression\n\n"
    "Append a node of `op` (an ops.Op) over the nodes `args`, of per-instance `shape`, in the\n"
    "batch class named by `sig_key` (a hashable key interned per graph), with `attr` for its\n"
    "kernel and `index` for its per-node int (an op with per_node_attrs). A node with inputs written under torch.no_grad() is marked and never batched with\n"
    "nodes that carry gradient. A padded op's nodes (lstm_layer) are length-led: their\n"
    "leading dim is a length. The ops themselves call the rules of rules.cpp instead.";

PyObject* store_add(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  if (argc < 4 || argc > 6) {
    PyErr_SetString(PyExc_TypeError, "add(op, args, shape, sig_key, attr=None, index=0)");
    return nullptr;
  }
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    check_open(s);
    PyObject* seq = PySequence_Fast(argv[1], "add: args must be a sequence of node ids");
    if (!seq) throw PythonError{};
    std::vector<i64> args(PySequence_Fast_GET_SIZE(seq));
    try {
      for (std::size_t i = 0; i < args.size(); ++i)
        args[i] = node_arg(s, PySequence_Fast_GET_ITEM(seq, i));
    } catch (...) {
      Py_DECREF(seq);
      throw;
    }
    Py_DECREF(seq);
    PyObject* shape_seq = PySequence_Fast(argv[2], "add: shape must be a tuple of ints");
    if (!shape_seq) throw PythonError{};
    std::vector<i64> dims(PySequence_Fast_GET_SIZE(shape_seq));
    try {
      for (std::size_t i = 0; i < dims.size(); ++i)
        dims[i] = as_int(PySequence_Fast_GET_ITEM(shape_seq, i));
    } catch (...) {
      Py_DECREF(shape_seq);
      throw;
    }
    Py_DECREF(shape_seq);
    // Grad mode is the one in force when the node is written, as eagerly: such a node runs
    // without grad and never shares a kernel with nodes that carry gradient.
    const bool no_grad = !args.empty() && !grad_enabled();
    PyObject* key = argv[3];
    const Py_ssize_t known_sigs = PyList_GET_SIZE(s->sig_keys);
    i64 sig;
    if (no_grad) {
      key = Py_BuildValue("(sO)", "no_grad", argv[3]);
      if (!key) throw PythonError{};
      try {
        sig = python_sig(s, key);
      } catch (...) {
        Py_DECREF(key);
        throw;
      }
      Py_DECREF(key);
    } else {
      sig = python_sig(s, key);
    }
    if (sig == known_sigs) {  // a new signature: a padded op's result is length-led
      PyObject* padded = PyObject_GetAttrString(argv[0], "padded");
      const int is_padded = padded ? PyObject_IsTrue(padded) : -1;
      Py_XDECREF(padded);
      if (is_padded < 0) throw PythonError{};
      if (is_padded) mark_length_led(s, sig);
    }
    const i64 index = argc == 6 ? as_int(argv[5]) : 0;
    return append(s, op_code(argv[0]), args.data(), args.size(),
                  intern_shape(s, dims.data(), dims.size()), sig, argc >= 5 ? argv[4] : Py_None,
                  no_grad, index);
  });
}

PyObject* store_shape_of(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    return Py_NewRef((*s->shape_tuples)[(*s->nodes).shape[node_arg(s, arg)]]);
  });
}

PyObject* store_op_of(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* { return Py_NewRef(g_ops[s->nodes->op[node_arg(s, arg)]]); });
}

PyObject* store_attr_of(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    PyObject* a = (*s->attrs)[node_arg(s, arg)];
    return Py_NewRef(a ? a : Py_None);
  });
}

PyObject* store_args_of(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    const i64 v = node_arg(s, arg);
    const i64 begin = s->nodes->arg_ptr[v], end = s->nodes->arg_ptr[v + 1];
    PyObject* out = PyTuple_New(end - begin);
    if (!out) throw PythonError{};
    for (i64 e = begin; e < end; ++e) {
      PyObject* a = PyLong_FromLongLong(s->nodes->arg_flat[e]);
      if (!a) {
        Py_DECREF(out);
        throw PythonError{};
      }
      PyTuple_SET_ITEM(out, e - begin, a);
    }
    return out;
  });
}

const char kIndicesDoc[] =
    "indices(nodes) -> bytearray\n\n"
    "The per-node ints of `nodes` (an int64 array): the index of each pick, the row of each\n"
    "lookup, as int64 bytes (np.frombuffer(..., np.int64) reads them without a copy).";

PyObject* store_indices(PyObject* self, PyObject* nodes) {
  Store* s = as_store(self);
  Py_buffer view;
  if (PyObject_GetBuffer(nodes, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return nullptr;
  const char* format = view.format ? view.format : "B";
  const std::size_t f = std::strlen(format);
  if (view.itemsize != 8 || !f || (format[f - 1] != 'q' && format[f - 1] != 'l')) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "indices: nodes must be an int64 array");
    return nullptr;
  }
  const i64* ids = static_cast<const i64*>(view.buf);
  const Py_ssize_t n = view.len / 8;
  PyObject* out = PyByteArray_FromStringAndSize(nullptr, n * 8);
  if (out) {
    i64* dst = reinterpret_cast<i64*>(PyByteArray_AS_STRING(out));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= n_nodes(s)) {
        Py_CLEAR(out);
        PyErr_Format(PyExc_IndexError, "node %lld is not in this graph",
                     static_cast<long long>(ids[i]));
        break;
      }
      dst[i] = s->nodes->index[ids[i]];
    }
  }
  PyBuffer_Release(&view);
  return out;
}

PyObject* store_sig_of(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded(
      [&]() -> PyObject* { return PyLong_FromLongLong(s->nodes->sig[node_arg(s, arg)]); });
}

PyObject* store_is_no_grad(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded(
      [&]() -> PyObject* { return PyBool_FromLong(s->nodes->no_grad[node_arg(s, arg)]); });
}

PyObject* store_length_led(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* { return PyBool_FromLong(length_led(s, node_arg(s, arg))); });
}

enum ColumnName {
  kSigs, kDepths, kArgFlat, kOps, kArgPtr, kShapes, kNoGrad, kNodeBatch, kNodeRow, kBatchSizes,
  kUnknown
};

ColumnName column_name(PyObject* name) {
  static const char* names[] = {"sigs",    "depths",     "arg_flat", "ops",        "arg_ptr",
                                "shapes",  "no_grad",    "node_batch", "node_row", "batch_sizes"};
  const char* text = PyUnicode_AsUTF8(name);
  if (!text) throw PythonError{};
  for (int i = 0; i < kUnknown; ++i)
    if (std::strcmp(text, names[i]) == 0) return static_cast<ColumnName>(i);
  return kUnknown;
}

const char kViewDoc[] =
    "view(name) -> memoryview\n\n"
    "Zero-copy, read-only view of a column over the nodes so far: 'sigs', 'depths', 'arg_flat'\n"
    "(int64); 'arg_ptr' (int64, n + 1 entries: the inputs of node v are\n"
    "arg_flat[arg_ptr[v]:arg_ptr[v + 1]]); 'ops', 'shapes' (int32 codes); 'no_grad' (uint8);\n"
    "'node_batch', 'node_row' (int32: where each scheduled node's value lives, batch -1 before;\n"
    "as many entries as grow_positions made room for) and 'batch_sizes' (int32, per batch).\n"
    "A view stays valid (and unchanged) after the store grows; take a new one to see more.";

PyObject* store_view(PyObject* self, PyObject* name) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    Columns& c = *s->nodes;
    const i64 n = n_nodes(s);
    switch (column_name(name)) {
      case kSigs: return c.sig.view(n);
      case kDepths: return c.depth.view(n);
      case kArgFlat: return c.arg_flat.view(n ? c.arg_ptr[n] : 0);
      case kArgPtr:
        if (c.arg_ptr.size() == 0) c.arg_ptr.push(0);
        return c.arg_ptr.view(n + 1);
      case kOps: return c.op.view(n);
      case kShapes: return c.shape.view(n);
      case kNoGrad: return c.no_grad.view(n);
      case kNodeBatch: return c.batch.view(c.batch.size());
      case kNodeRow: return c.row.view(c.row.size());
      case kBatchSizes: return c.batch_size.view(c.batch_size.size());
      default: raise(PyExc_KeyError, "no column %R", name);
    }
  });
}

PyObject* store_grow_positions(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    const i64 n = as_int(arg);
    if (n < 0 || n > n_nodes(s)) raise(PyExc_ValueError, "grow_positions: %lld nodes", n);
    s->nodes->batch.extend_to(n, -1);
    s->nodes->row.extend_to(n, 0);
    Py_RETURN_NONE;
  });
}

PyObject* store_position(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    const i64 v = node_arg(s, arg);
    const Columns& c = *s->nodes;
    if (v >= c.batch.size() || c.batch[v] < 0)
      raise(PyExc_ValueError, "node %lld is not scheduled", v);
    return Py_BuildValue("(ii)", c.batch[v], c.row[v]);
  });
}

const char kStackedRowsDoc[] =
    "stacked_rows(exprs) -> (batch, first, rows) or None\n\n"
    "Where the values of `exprs` (a list or tuple of this graph's computed expressions of one\n"
    "shape) lie when they are rows of ONE batch result: (batch, first, None) when they are its\n"
    "rows first, first + 1, ... in order, else (batch, first, rows) with `rows` their row numbers\n"
    "(an int64 bytearray). None in every other case (another sequence, an item that is not an\n"
    "expression of this graph, a pending node, two shapes, two batches): forward(stack=True)\n"
    "then takes its general path, which also raises the errors. One call, where the parser's\n"
    "read of 64 score vectors per step took three Python calls per expression.";

PyObject* store_stacked_rows(PyObject* self, PyObject* exprs) {
  Store* s = as_store(self);
  if (!PyList_CheckExact(exprs) && !PyTuple_CheckExact(exprs)) Py_RETURN_NONE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(exprs);
  PyObject* const* items = PySequence_Fast_ITEMS(exprs);
  const Columns& c = *s->nodes;
  std::int32_t batch = -1, shape = -1, first = 0;
  bool in_order = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyObject_TypeCheck(items[i], &ExpressionBase)) Py_RETURN_NONE;
    const Expression* e = reinterpret_cast<const Expression*>(items[i]);
    if (e->view >= 0) Py_RETURN_NONE;  // (a view's values are those of a reshape node)
    const i64 v = e->id;
    if (e->graph != s || v >= s->n_done || v >= c.batch.size() || c.batch[v] < 0) Py_RETURN_NONE;
    if (i == 0) {
      batch = c.batch[v], shape = c.shape[v], first = c.row[v];
    } else if (c.batch[v] != batch || c.shape[v] != shape) {
      Py_RETURN_NONE;
    }
    in_order = in_order && c.row[v] == first + i;
  }
  if (n == 0) Py_RETURN_NONE;
  if (in_order) return Py_BuildValue("(iiO)", batch, first, Py_None);
  PyObject* rows = PyByteArray_FromStringAndSize(nullptr, n * 8);
  if (!rows) return nullptr;
  i64* out = reinterpret_cast<i64*>(PyByteArray_AS_STRING(rows));
  for (Py_ssize_t i = 0; i < n; ++i)
    out[i] = c.row[reinterpret_cast<const Expression*>(items[i])->id];
  return Py_BuildValue("(iiN)", batch, first, rows);
}

PyObject* store_unschedule(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  Store* s = as_store(self);
  if (argc != 2) {
    PyErr_SetString(PyExc_TypeError, "unschedule(start, first_batch)");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    Columns& c = *s->nodes;
    const i64 start = as_int(argv[0]), first_batch = as_int(argv[1]);
    if (start < 0 || first_batch < 0 || first_batch > c.batch_size.size())
      raise(PyExc_ValueError, "unschedule: start %lld, first batch %lld", start, first_batch);
    for (i64 v = start; v < c.batch.size(); ++v) c.batch.data()[v] = -1;
    c.batch_size.pop(c.batch_size.size() - first_batch);
    Py_RETURN_NONE;
  });
}

PyObject* store_set_parameter_tag(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  Store* s = as_store(self);
  if (argc != 2 || !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "set_parameter_tag(node, tag): tag is a tuple");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    PyObject*& tag = (*s->param_tags)[node_arg(s, argv[0])];
    Py_XSETREF(tag, Py_NewRef(argv[1]));
    Py_RETURN_NONE;
  });
}

PyObject* store_parameter_tag(PyObject* self, PyObject* arg) {
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    const auto found = s->param_tags->find(node_arg(s, arg));
    return Py_NewRef(found == s->param_tags->end() ? Py_None : found->second);
  });
}

// A tensor whose requires_grad, data or size was rebound: its next use asks Python again.
PyObject* store_forget(PyObject* self, PyObject* tensor) {
  Store* s = as_store(self);
  if (s->parameters) s->parameters->erase(tensor);
  if (s->table_shapes) s->table_shapes->erase(tensor);
  if (s->parameter_parts) s->parameter_parts->erase(tensor);
  if (s->embedding_tables) s->embedding_tables->erase(tensor);
  Py_RETURN_NONE;
}

PyObject* store_set_node_dtype(PyObject* self, PyObject* args) {
  PyObject *node, *dtype;
  if (!PyArg_ParseTuple(args, "OO:set_node_dtype", &node, &dtype)) return nullptr;
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    set_node_dtype(s, node_arg(s, node), dtype);
    Py_RETURN_NONE;
  });
}

// Graph.parameter_view_node's node of `tensor[part]` for an int `part`, for the capture to find
// without Python (capture.cpp's known_parameter_part); the graph holds the tensor until close.
PyObject* store_remember_part(PyObject* self, PyObject* args) {
  PyObject *tensor, *node;
  long long part;
  if (!PyArg_ParseTuple(args, "OLO:remember_part", &tensor, &part, &node)) return nullptr;
  Store* s = as_store(self);
  return guarded([&]() -> PyObject* {
    (*s->parameter_parts)[tensor].emplace_back(part, node_arg(s, node));
    Py_RETURN_NONE;
  });
}

PyObject* store_close(PyObject* self, PyObject*) {
  Store* s = as_store(self);
  s->closed = 1;
  clear_attrs(s);
  clear_caches(s);
  PyObject* fresh = PyDict_New();  // the keys go; sig_keys stays so that stats() can describe
  if (!fresh) return nullptr;
  Py_SETREF(s->sig_ids, fresh);
  Py_RETURN_NONE;
}

PyMethodDef kStoreMethods[] = {
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(store_add)), METH_FASTCALL,
     kAddDoc},
    {"shape_of", store_shape_of, METH_O, "shape_of(node) -> tuple: the node's per-instance shape"},
    {"op_of", store_op_of, METH_O, "op_of(node) -> Op"},
    {"attr_of", store_attr_of, METH_O, "attr_of(node): what the node's kernel gets (or None)"},
    {"args_of", store_args_of, METH_O, "args_of(node) -> tuple: the node's input node ids"},
    {"indices", store_indices, METH_O, kIndicesDoc},
    {"sig_of", store_sig_of, METH_O, "sig_of(node) -> int: the node's interned signature"},
    {"is_no_grad", store_is_no_grad, METH_O, "is_no_grad(node): written under torch.no_grad()"},
    {"length_led", store_length_led, METH_O,
     "length_led(node): whether the node's leading dim is a length (its signature writes it n,\n"
     "so the ops of it may batch across lengths)"},
    {"view", store_view, METH_O, kViewDoc},
    {"grow_positions", store_grow_positions, METH_O,
     "grow_positions(n): room in the node_batch/node_row columns for nodes 0..n-1 (the\n"
     "scheduler writes where each node of a forward lives there; new entries are unscheduled)"},
    {"position", store_position, METH_O,
     "position(node) -> (batch, row): where a scheduled node's value lives"},
    {"stacked_rows", store_stacked_rows, METH_O, kStackedRowsDoc},
    {"unschedule", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(store_unschedule)),
     METH_FASTCALL,
     "unschedule(start, first_batch): forget the positions of nodes start.. and the batches\n"
     "first_batch.. (a forward that failed leaves the graph as it was before it)"},
    {"set_parameter_tag",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(store_set_parameter_tag)),
     METH_FASTCALL, "set_parameter_tag(node, tag): products sharing this parameter batch by tag"},
    {"parameter_tag", store_parameter_tag, METH_O,
     "parameter_tag(node): the node's tag if it is a parameter, else None"},
    {"set_node_dtype", store_set_node_dtype, METH_VARARGS,
     "set_node_dtype(node, dtype): node `node` holds values of `dtype`, not of the graph's\n"
     "floating dtype (node_dtypes[node] = dtype, marked for C readers too)"},
    {"remember_part", store_remember_part, METH_VARARGS,
     "remember_part(tensor, part, node): node `node` is `tensor[part]` (an int part of a\n"
     "parameter, Graph.parameter_view_node), found in C by the next `tensor[part]`"},
    {"forget", store_forget, METH_O,
     "forget(tensor): drop what the rules cached about a tensor (whether it is a parameter,\n"
     "an embedding table's size); the capture mode calls it when requires_grad, .data or the\n"
     "size of a tensor is rebound inside a graph block"},
    {"close", store_close, METH_NOARGS,
     "close(): no node can be added any more; frees the attrs (the tensors held for kernels)"},
    {nullptr, nullptr, 0, nullptr},
};

PyObject* get_n_nodes(PyObject* self, void*) {
  return PyLong_FromLongLong(n_nodes(as_store(self)));
}
PyObject* get_n_done(PyObject* self, void*) { return PyLong_FromLongLong(as_store(self)->n_done); }
int set_n_done(PyObject* self, PyObject* value, void*) {
  if (!value) {
    PyErr_SetString(PyExc_AttributeError, "n_done cannot be deleted");
    return -1;
  }
  const long long n = PyLong_AsLongLong(value);
  if (n == -1 && PyErr_Occurred()) return -1;
  if (n < 0 || n > n_nodes(as_store(self))) {
    PyErr_SetString(PyExc_ValueError, "n_done must lie in 0..n_nodes");
    return -1;
  }
  as_store(self)->n_done = n;
  return 0;
}
PyObject* get_closed(PyObject* self, void*) { return PyBool_FromLong(as_store(self)->closed); }
PyObject* get_sig_ids(PyObject* self, void*) { return Py_NewRef(as_store(self)->sig_ids); }
PyObject* get_sig_keys(PyObject* self, void*) { return Py_NewRef(as_store(self)->sig_keys); }
PyObject* get_origin_hook(PyObject* self, void*) {
  PyObject* hook = as_store(self)->origin_hook;
  return Py_NewRef(hook ? hook : Py_None);
}
int set_origin_hook(PyObject* self, PyObject* value, void*) {
  Py_XSETREF(as_store(self)->origin_hook, value && value != Py_None ? Py_NewRef(value) : nullptr);
  return 0;
}

PyMemberDef kStoreMembers[] = {
    {"_dtype", T_OBJECT, offsetof(Store, fixed_dtype), 0,
     "the graph's floating dtype once fixed (Graph.dtype), else None"},
    {"node_dtypes", T_OBJECT_EX, offsetof(Store, node_dtypes), 0,
     "dict: node -> dtype, for the nodes not of the graph's floating dtype"},
    {"shadows", T_OBJECT_EX, offsetof(Store, shadows), 0,
     "dict: id -> (plain tensor written with an expression, that expression)"},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef kStoreGetSet[] = {
    {"n_nodes", get_n_nodes, nullptr, "nodes in the store", nullptr},
    {"n_done", get_n_done, set_n_done, "nodes computed by earlier forwards (ids below it)",
     nullptr},
    {"closed", get_closed, nullptr, "whether close() was called", nullptr},
    {"sig_ids", get_sig_ids, nullptr, "Python signature key -> int (this graph's table)", nullptr},
    {"sig_keys", get_sig_keys, nullptr, "int -> signature key (signatures.describe)", nullptr},
    {"origin_hook", get_origin_hook, set_origin_hook,
     "debug mode: called with each new node's id before it is stored", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// ---- the Expression handle ---------------------------------------------------------------------
PyObject* expression_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* graph;
  long long id;
  static const char* names[] = {"graph", "node", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!L:Expression", const_cast<char**>(names),
                                   &StoreType, &graph, &id))
    return nullptr;
  if (id < 0 || id >= n_nodes(as_store(graph))) {
    PyErr_Format(PyExc_IndexError, "node %lld is not in this graph", id);
    return nullptr;
  }
  Expression* e = reinterpret_cast<Expression*>(type->tp_alloc(type, 0));
  if (!e) return nullptr;
  e->graph = reinterpret_cast<Store*>(Py_NewRef(graph));
  e->id = id;
  e->view = -1;
  return reinterpret_cast<PyObject*>(e);
}

void expression_dealloc(PyObject* self) {
  Py_DECREF(reinterpret_cast<PyObject*>(reinterpret_cast<Expression*>(self)->graph));
  Py_TYPE(self)->tp_free(self);
}

PyObject* expression_shape(PyObject* self, void*) {
  const Expression* e = reinterpret_cast<Expression*>(self);
  return Py_NewRef((*e->graph->shape_tuples)[expression_shape_id(e)]);
}

// A view's node is its reshape node, made here on first read (views.cpp): code that reads `id`
// reads the node's shape, value and op next.
PyObject* expression_id(PyObject* self, void*) {
  Expression* e = reinterpret_cast<Expression*>(self);
  if (e->view >= 0 && !materialize(e)) return nullptr;
  return PyLong_FromLongLong(e->id);
}

PyMemberDef kExpressionMembers[] = {
    {"graph", T_OBJECT_EX, offsetof(Expression, graph), READONLY, "the graph of the node"},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef kExpressionGetSet[] = {
    {"shape", expression_shape, nullptr, "the per-instance shape", nullptr},
    {"id", expression_id, nullptr, "the node's id in its graph", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

const char kConfigureDoc[] =
    "configure(expression_type, graph_error, shape_error, is_grad_enabled, current_graph,\n"
    "          tensor_type, mode_enabled)\n\n"
    "What the core creates and calls: the Expression subclass of new handles, the errors of a\n"
    "closed graph and of shapes, torch's grad-mode query, the current graph of ops given no\n"
    "expression, torch.Tensor and torch's query whether a torch function mode is on. graph.py\n"
    "calls it once at import.";

PyObject* configure(PyObject*, PyObject* args) {
  PyObject *type, *error, *shape_error, *grad, *current, *tensor, *mode_enabled;
  if (!PyArg_ParseTuple(args, "O!OOOOOO:configure", &PyType_Type, &type, &error, &shape_error,
                        &grad, &current, &tensor, &mode_enabled))
    return nullptr;
  if (!PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &ExpressionBase) ||
      reinterpret_cast<PyTypeObject*>(type)->tp_basicsize != sizeof(Expression)) {
    PyErr_SetString(PyExc_TypeError, "configure: expression_type must subclass "
                                     "_core.Expression with __slots__ = ()");
    return nullptr;
  }
  reinterpret_cast<PyTypeObject*>(type)->tp_getattr = getattr_by_interned_torch_function;
  Py_XSETREF(g_expression_type, Py_NewRef(type));
  Py_XSETREF(g_graph_error, Py_NewRef(error));
  Py_XSETREF(g_is_grad_enabled, Py_NewRef(grad));
  Py_XSETREF(g_shape_error, Py_NewRef(shape_error));
  Py_XSETREF(g_current_graph, Py_NewRef(current));
  Py_XSETREF(g_tensor_type, Py_NewRef(tensor));
  Py_XSETREF(g_mode_enabled, Py_NewRef(mode_enabled));
  g_grad_mode = loaded_function("libc10.so", "_ZN3c108GradMode10is_enabledEv");
  g_function_mode =
      loaded_function("libtorch_cpu.so", "_ZN2at4impl27torch_function_mode_enabledEv");
  g_autocast = reinterpret_cast<AutocastFlag>(loaded_symbol(
      "libtorch_cpu.so", "_ZN2at8autocast19is_autocast_enabledEN3c1010DeviceTypeE"));
  g_stack_len = reinterpret_cast<StackLen>(
      loaded_symbol("libtorch_cpu.so", "_ZN2at4impl22PythonTorchFunctionTLS9stack_lenEv"));
  if (!g_any_autocast || !g_stack_len_py) {
    PyObject* torch_c = PyImport_ImportModule("torch._C");
    if (!torch_c) return nullptr;
    if (!g_any_autocast)
      g_any_autocast = PyObject_GetAttrString(torch_c, "_is_any_autocast_enabled");
    if (!g_stack_len_py)
      g_stack_len_py = PyObject_GetAttrString(torch_c, "_len_torch_function_stack");
    Py_DECREF(torch_c);
    if (!g_any_autocast || !g_stack_len_py) return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* op_table(PyObject*, PyObject*) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(g_ops.size()));
  if (!list) return nullptr;
  for (std::size_t i = 0; i < g_ops.size(); ++i) PyList_SET_ITEM(list, i, Py_NewRef(g_ops[i]));
  return list;
}

// ---- own_time: Python code whose time is flybatch's -------------------------------------------
// `_core.own_time(f)` wraps a Python function (an op written in Python, fb.nn's Module.__call__)
// so that its calls are OwnTimeScopes. A C callable (vectorcall, ~30 ns when not measuring)
// rather than a Python decorator, which would cost a Python frame per op call. It binds as a
// method (descriptor), and reads through to the function for __name__, __doc__ and the rest.
struct OwnTimed {
  PyObject_HEAD
  vectorcallfunc call;
  PyObject* function;
};

PyObject* own_timed_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf,
                               PyObject* kwnames) {
  OwnTimeScope own;
  return PyObject_Vectorcall(reinterpret_cast<OwnTimed*>(self)->function, args, nargsf, kwnames);
}

int own_timed_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<OwnTimed*>(self)->function);
  return 0;
}

int own_timed_clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<OwnTimed*>(self)->function);
  return 0;
}

void own_timed_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  own_timed_clear(self);
  PyObject_GC_Del(self);
}

PyObject* own_timed_get(PyObject* self, PyObject* instance, PyObject*) {
  if (!instance || instance == Py_None) return Py_NewRef(self);
  return PyMethod_New(self, instance);
}

PyObject* own_timed_getattro(PyObject* self, PyObject* name) {
  PyObject* found = PyObject_GenericGetAttr(self, name);
  if (found || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
  PyErr_Clear();
  return PyObject_GetAttr(reinterpret_cast<OwnTimed*>(self)->function, name);
}

// The function's own __doc__ (a data descriptor, so that it wins over the type's doc; the
// function's other attributes, __name__ and the rest, come through own_timed_getattro), and
// __wrapped__ (inspect.signature follows it).
PyObject* own_timed_doc(PyObject* self, void*) {
  return PyObject_GetAttrString(reinterpret_cast<OwnTimed*>(self)->function, "__doc__");
}

PyObject* own_timed_wrapped(PyObject* self, void*) {
  return Py_NewRef(reinterpret_cast<OwnTimed*>(self)->function);
}

PyGetSetDef kOwnTimedGetSet[] = {
    {"__doc__", own_timed_doc, nullptr, nullptr, nullptr},
    {"__wrapped__", own_timed_wrapped, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyObject* own_timed_repr(PyObject* self) {
  return PyUnicode_FromFormat("<own_time %R>", reinterpret_cast<OwnTimed*>(self)->function);
}

PyTypeObject OwnTimedType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;  // a static type; PyType_Ready fills in the rest
  t.tp_name = "flybatch._core.own_time";
  t.tp_basicsize = sizeof(OwnTimed);
  t.tp_dealloc = own_timed_dealloc;
  t.tp_vectorcall_offset = offsetof(OwnTimed, call);
  t.tp_call = PyVectorcall_Call;
  t.tp_getattro = own_timed_getattro;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
               Py_TPFLAGS_METHOD_DESCRIPTOR;
  t.tp_traverse = own_timed_traverse;
  t.tp_clear = own_timed_clear;
  t.tp_descr_get = own_timed_get;
  t.tp_getset = kOwnTimedGetSet;
  t.tp_repr = own_timed_repr;
  t.tp_new = [](PyTypeObject* type, PyObject* args, PyObject* kwargs) -> PyObject* {
    PyObject* function;
    if ((kwargs && PyDict_GET_SIZE(kwargs)) ||
        !PyArg_ParseTuple(args, "O:own_time", &function))
      return nullptr;
    if (!PyCallable_Check(function)) {
      PyErr_SetString(PyExc_TypeError, "own_time: expected a callable");
      return nullptr;
    }
    OwnTimed* self = PyObject_GC_New(OwnTimed, type);
    if (!self) return nullptr;
    self->call = own_timed_vectorcall;
    self->function = Py_NewRef(function);
    PyObject_GC_Track(self);
    return reinterpret_cast<PyObject*>(self);
  };
  t.tp_doc =
      "own_time(function): `function`, its calls counted as flybatch's own time (see "
      "measure_own_time). For the ops written in Python and fb.nn modules.";
  return t;
}();

PyObject* measure_own_time(PyObject*, PyObject* on) {
  const int measuring = PyObject_IsTrue(on);
  if (measuring < 0) return nullptr;
  PyObject* before = PyBool_FromLong(OwnTime::measuring);
  OwnTime::measuring = measuring;
  return before;
}

PyObject* own_time_ns(PyObject*, PyObject*) {
  i64 total = OwnTime::total_ns;
  if (OwnTime::depth > 0) total += OwnTime::now_ns() - OwnTime::since_ns;  // a scope is open
  return PyLong_FromLongLong(total);
}

// An in-place write into an expression (`h += x`, capture/inplace.py `_write_into_expression`) as
// eager torch makes it: every reference to the same handle (`a = h`, a list holding h) sees
// the new value, so the handle is pointed at the node of the value written.
PyObject* rebind(PyObject*, PyObject* args) {
  PyObject *target, *value;
  if (!PyArg_ParseTuple(args, "O!O!:rebind", &ExpressionBase, &target, &ExpressionBase, &value))
    return nullptr;
  Expression* t = reinterpret_cast<Expression*>(target);
  const Expression* v = reinterpret_cast<Expression*>(value);
  if (t->graph != v->graph) {
    PyErr_SetString(PyExc_ValueError, "rebind: the expressions belong to different graphs");
    return nullptr;
  }
  t->id = v->id;
  t->view = v->view;
  Py_RETURN_NONE;
}

PyMethodDef kModuleMethods[] = {
    {"configure", configure, METH_VARARGS, kConfigureDoc},
    {"measure_own_time", measure_own_time, METH_O,
     "measure_own_time(on) -> bool: switch the own-time clock of op creation on or off; "
     "returns whether it was on"},
    {"own_time_ns", own_time_ns, METH_NOARGS,
     "own_time_ns() -> int: nanoseconds spent in flybatch's op creation while measuring, "
     "since the module loaded"},
    {"rebind", rebind, METH_VARARGS,
     "rebind(target, value): point the expression handle `target` at `value`'s node (an "
     "in-place write into an expression, seen through every reference to the handle)"},
    {"op_table", op_table, METH_NOARGS,
     "op_table() -> list[Op]: the op of each op code (Store.view('ops')), shared by all graphs"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyTypeObject StoreType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;  // a static type; PyType_Ready fills in the rest
  t.tp_name = "flybatch._core.Store";
  t.tp_basicsize = sizeof(Store);
  t.tp_dealloc = store_dealloc;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = "The node store of a graph: columns of ints, one entry per node (store.cpp).";
  t.tp_traverse = store_traverse;
  t.tp_clear = store_clear;
  t.tp_methods = kStoreMethods;
  t.tp_members = kStoreMembers;
  t.tp_getset = kStoreGetSet;
  t.tp_new = store_new;
  return t;
}();

PyTypeObject ExpressionBase = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;  // a static type; PyType_Ready fills in the rest
  t.tp_name = "flybatch._core.Expression";
  t.tp_basicsize = sizeof(Expression);
  t.tp_dealloc = expression_dealloc;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  t.tp_doc = "A handle on one node of a graph (graph.Expression adds its methods).";
  t.tp_members = kExpressionMembers;
  t.tp_as_number = &expression_number;
  t.tp_as_mapping = &expression_mapping;
  t.tp_getset = kExpressionGetSet;
  t.tp_new = expression_new;
  return t;
}();

PyObject* register_store(PyObject* module) {
  if (!module) return nullptr;
  if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&StoreType) < 0 ||
      PyType_Ready(&ExpressionBase) < 0 || PyType_Ready(&OwnTimedType) < 0 ||
      PyModule_AddObjectRef(module, "own_time", reinterpret_cast<PyObject*>(&OwnTimedType)) < 0 ||
      PyModule_AddObjectRef(module, "Store", reinterpret_cast<PyObject*>(&StoreType)) < 0 ||
      PyModule_AddObjectRef(module, "Expression",
                            reinterpret_cast<PyObject*>(&ExpressionBase)) < 0 ||
      PyModule_AddFunctions(module, kModuleMethods) < 0 || !register_rules(module) ||
      !register_fused(module) || !register_capture(module) || !register_dispatch(module) ||
      !register_lstm(module) || !register_tree_lstm(module) || !register_views(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

// torch asks for `__torch_function__` by C string: each argument of a call that is not a plain
// tensor (torch/csrc/utils/python_strings.h, PyObject_FastGetAttrString) and a mode at every
// dispatch to it (PyObject_CallMethod). Through the type's `tp_getattr` where it has one, else
// with a fresh str per lookup, which misses the type's attribute cache and is looked up dict by
// dict along the MRO (~1.1-1.3k instructions per recorded call). This `tp_getattr`, given to
// Expression and to the capture mode, looks that name up by an interned str, any other name as
// getattr would. Python's own attribute access goes through `tp_getattro` and never sees it.
PyObject* getattr_by_interned_torch_function(PyObject* self, char* name) {
  static PyObject* const interned = PyUnicode_InternFromString("__torch_function__");
  if (interned && std::strcmp(name, "__torch_function__") == 0)
    return PyObject_GetAttr(self, interned);
  PyObject* text = PyUnicode_FromString(name);
  if (!text) return nullptr;
  PyObject* value = PyObject_GetAttr(self, text);
  Py_DECREF(text);
  return value;
}

}  // namespace flybatch
