// The node store of a graph and the Expression handle (store.cpp), shared with the op rules
// (rules.cpp). A graph is a `_core.Store` (graph.py subclasses it): one entry per node in
// columns (struct of arrays), node ids in creation order, which is a topological order.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flybatch {

using i64 = std::int64_t;

// A Python exception is set: unwind to the binding, which returns NULL.
struct PythonError {};

[[noreturn]] void raise(PyObject* type, const char* format, ...);

// Runs a binding's body, turning C++ exceptions into Python ones (the binding returns NULL).
template <class Body>
PyObject* guarded(Body&& body) {
  try {
    return body();
  } catch (const PythonError&) {
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// A new reference, or the Python error unwinds.
inline PyObject* checked(PyObject* object) {
  if (!object) throw PythonError{};
  return object;
}

// Owns a new reference until released into a container that steals it.
class Owned {
 public:
  explicit Owned(PyObject* object) : object_(checked(object)) {}
  ~Owned() { Py_XDECREF(object_); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  PyObject* get() const { return object_; }
  PyObject* release() { return std::exchange(object_, nullptr); }

 private:
  PyObject* object_;
};

// ---- own time: flybatch's part of a graph's build ----------------------------------------------
// A graph's build time (between its forwards) is the user's per-instance Python plus flybatch's
// op calls. To report the two apart (the bench's `build_user`), every entry from Python into op
// creation is an OwnTimeScope: the rules and operators (rules.cpp), the fused-module nodes
// (fused.cpp), the capture's front end (capture.cpp), and the Python functions and fb.nn
// modules wrapped by `_core.own_time` (store.cpp). Only the outermost of nested scopes reads
// the clock, and only while measuring is on (`_core.measure_own_time`): off, a scope costs one
// branch. One interpreter lock, so plain statics suffice.
struct OwnTime {
  static inline bool measuring = false;
  static inline int depth = 0;          // open counted scopes
  static inline i64 total_ns = 0;       // summed over outermost scopes since the module loaded
  static inline i64 since_ns = 0;       // when the outermost open scope began
  static i64 now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

class OwnTimeScope {
 public:
  OwnTimeScope() : counted_(OwnTime::measuring) {
    if (counted_ && OwnTime::depth++ == 0) OwnTime::since_ns = OwnTime::now_ns();
  }
  ~OwnTimeScope() {
    if (counted_ && --OwnTime::depth == 0) OwnTime::total_ns += OwnTime::now_ns() - OwnTime::since_ns;
  }
  OwnTimeScope(const OwnTimeScope&) = delete;
  OwnTimeScope& operator=(const OwnTimeScope&) = delete;

 private:
  const bool counted_;  // measuring when the scope opened (it may be switched inside)
};

// The storage of a column is a Python object (a `Block`, which exports it as a read-only
// buffer) so that a numpy view of a column stays valid however the column grows: growing copies
// into a new block, and the view keeps the old one alive.
struct Block {
  PyObject_HEAD
  char* data;
  Py_ssize_t itemsize;
  Py_ssize_t capacity;
  Py_ssize_t exported;  // items the next buffer export shows (set just before it)
  const char* format;
};

Block* new_block(Py_ssize_t itemsize, const char* format, Py_ssize_t capacity);

template <class T>
class Column {
 public:
  explicit Column(const char* format) : format_(format) {}
  ~Column() { Py_XDECREF(reinterpret_cast<PyObject*>(block_)); }
  Column(const Column&) = delete;
  Column& operator=(const Column&) = delete;

  T operator[](i64 i) const { return data_[i]; }
  T* data() const { return data_; }
  i64 size() const { return size_; }
  void push(T x) {
    if (size_ == capacity_) grow();
    data_[size_++] = x;
  }
  void pop(i64 n) { size_ -= n; }  // undoes the last n pushes of a node that failed
  // Grows to `n` items, the new ones `fill` (a column written in place, not pushed to).
  void extend_to(i64 n, T fill) {
    while (capacity_ < n) grow();
    std::fill(data_ + size_, data_ + std::max(n, size_), fill);
    size_ = std::max(n, size_);
  }
  // A read-only memoryview of the first `n` items (zero copy).
  PyObject* view(i64 n) const {
    if (!block_) block_ = new_block(sizeof(T), format_, 0);
    block_->exported = n;
    return PyMemoryView_FromObject(reinterpret_cast<PyObject*>(block_));
  }

 private:
  void grow() {
    const i64 capacity = capacity_ ? 2 * capacity_ : 1024;
    Block* block = new_block(sizeof(T), format_, capacity);  // throws on failure
    if (size_) std::memcpy(block->data, data_, size_ * sizeof(T));
    Py_XDECREF(reinterpret_cast<PyObject*>(block_));
    block_ = block;
    data_ = reinterpret_cast<T*>(block->data);
    capacity_ = capacity;
  }

  const char* format_;
  mutable Block* block_ = nullptr;
  T* data_ = nullptr;
  i64 size_ = 0, capacity_ = 0;
};

// A few ints on the stack, more on the heap (a signature's key, a recorded call's form): built
// per op call, where a heap allocation costs as much as a dict lookup.
template <std::size_t kSmall>
class SmallInts {
 public:
  void push(i64 x) {
    if (n_ < kSmall) small_[n_] = x;
    else {
      if (n_ == kSmall) big_.assign(small_, small_ + kSmall);
      big_.push_back(x);
    }
    ++n_;
  }
  const i64* data() const { return n_ <= kSmall ? small_ : big_.data(); }
  std::size_t size() const { return n_; }
  i64 operator[](std::size_t i) const { return data()[i]; }

 private:
  i64 small_[kSmall];
  std::vector<i64> big_;
  std::size_t n_ = 0;
};

// Interns sequences of ints (shapes, signature keys) as dense ids 0, 1, 2... Looked up once or
// more per node created, so the index is open addressing over one array of ids (linear probing,
// at most half full) rather than a node-based map: a lookup touches one or two cache lines.
class KeyTable {
 public:
  // The id of key[0..n), or -1 if it is not interned yet.
  std::int32_t find(const i64* key, std::size_t n, std::uint64_t hash) const;
  std::int32_t insert(const i64* key, std::size_t n, std::uint64_t hash);
  const i64* key(std::int32_t id) const { return pool_.data() + start_[id]; }
  std::size_t length(std::int32_t id) const { return start_[id + 1] - start_[id]; }
  std::size_t size() const { return start_.size() - 1; }
  static std::uint64_t hash(const i64* key, std::size_t n);

 private:
  void grow();

  std::vector<i64> pool_;
  std::vector<std::size_t> start_{0};
  std::vector<std::uint64_t> hashes_;  // per id: its key's hash (compared before the key)
  std::vector<std::int32_t> slots_;    // ids by hash, -1 for empty; a power of two long
};

// The columns of a store and what they are named by Python (`Store.view`, `Store.column`).
struct Columns {
  Column<std::int32_t> op{"i"};      // index into the global op table (register_op)
  Column<i64> sig{"q"};              // interned signature, per graph
  Column<i64> depth{"q"};            // longest path from a leaf through pending nodes
  Column<i64> arg_ptr{"q"};          // n + 1 entries: inputs of v are arg_flat[ptr[v]..ptr[v+1])
  Column<i64> arg_flat{"q"};
  Column<std::int32_t> shape{"i"};   // interned shape id, per graph
  Column<std::uint8_t> no_grad{"B"};  // written under torch.no_grad()
  // 1: the node's value is not of the graph's floating dtype; its dtype is in `node_dtypes`
  // (set_node_dtype), read by C without a dict lookup for the common floating node.
  Column<std::uint8_t> other_dtype{"B"};
  Column<i64> index{"q"};            // the per-node int of ops that take one (pick, lookup)
  // Where a node's value lives once scheduled: row `row` of the result of batch `batch` (-1:
  // not scheduled). Written by the scheduler for a forward's nodes, so they are grown to the
  // node count before it runs (Store.grow_positions), not pushed per node. 32 bits: a forward
  // holds fewer than 2^31 nodes (schedule refuses more), and a graph fewer batches.
  Column<std::int32_t> batch{"i"};
  Column<std::int32_t> row{"i"};
  Column<std::int32_t> batch_size{"i"};  // one entry per batch, not per node: its rows
};

struct PlannedCall;
struct LearntPlan;

struct Store {
  PyObject_HEAD
  Columns* nodes;
  std::vector<PyObject*>* attrs;     // per node, NULL for none (the common case)
  KeyTable* shape_keys;              // shape dims -> shape id
  std::vector<PyObject*>* shape_tuples;
  KeyTable* sig_keys_c;              // signature keys built by the rules (rules.cpp)
  std::vector<i64>* sig_of_key;      // their signature ints
  // Per signature int: its nodes' leading dim is a length, which the signature leaves out
  // (written n: a stack's rows, a padded op's result as long as its input). Their batch result
  // may be stored padded, and elementwise ops of them batch across lengths too (rules.cpp).
  // Missing entries (signatures past its end) are 0.
  std::vector<std::uint8_t>* length_led;
  PyObject* sig_ids;                 // dict: Python signature key -> int (Graph.add)
  PyObject* sig_keys;                // list: int -> Python key (signatures.describe)
  PyObject* origin_hook;             // debug mode: called with each new node id
  // What the rules (rules.cpp) look up per op call without asking Python, filled on first use
  // of each object by a callback and dropped at close (no node can be added after).
  std::unordered_map<i64, PyObject*>* param_tags;        // parameter node -> ("P", k)
  std::unordered_map<std::uint64_t, i64>* scalars;       // bits of a float -> constant node
  std::unordered_map<PyObject*, PyObject*>* table_tags;  // embedding table -> ("P", k)
  std::unordered_map<PyObject*, i64>* parameters;        // parameter tensor -> its node
  // embedding table -> (rows, cols) as first seen. Like `parameters`, trusted without asking
  // the tensor again while a torch function mode is on (see torch_function_mode_enabled).
  std::unordered_map<PyObject*, std::pair<i64, i64>>* table_shapes;
  std::unordered_map<PyObject*, PyObject*>* lookup_attrs[2];  // table -> (table, sparse, ())
  // capture.cpp: the plan (a capture.direct._Plan) of a planned torch call by the call's form in
  // this graph (its function, operands' shape ids / dtypes / parameter nodes, int constants).
  std::unordered_map<std::string_view, PlannedCall*>* call_plans;
  std::unordered_map<PyObject*, LearntPlan*>* learnt_plans;  // _Plan -> its node, learnt
  // A constant part of a parameter by an int (`U_f[0]`, Graph.parameter_view_node): tensor ->
  // (int, node) pairs, trusted as the parameters are (forgotten on a rebind; see `parameters`).
  std::unordered_map<PyObject*, std::vector<std::pair<i64, i64>>>* parameter_parts;
  // F.embedding's tables (capture.cpp's embedding_row): table -> (rows, cols), checked once to
  // be a matrix that requires grad, trusted as the parameters are.
  std::unordered_map<PyObject*, std::pair<i64, i64>>* embedding_tables;
  i64 n_done;                        // nodes computed by earlier forwards
  int closed;
  // Graph state the capture reads at every recorded call, held here so that C reads it without
  // an attribute lookup; Python sees them as the graph's attributes `_dtype` (None until the
  // graph's floating dtype is fixed), `node_dtypes` and `shadows` (graph.py says what they hold).
  PyObject* fixed_dtype;
  PyObject* node_dtypes;
  PyObject* shadows;
};

// The plan of a planned torch call's form (capture.cpp's `planned`): a capture.direct._Plan,
// or a recipe (owned). The map's string_view key points into `form`.
struct PlannedCall {
  std::string form;
  PyObject* plan = nullptr;
  bool is_plan = false;
  ~PlannedCall() { Py_XDECREF(plan); }
};

// A capture.direct._Plan's node as it appended it the first time in this graph
// (capture.cpp's `append_planned`): a later node of the plan is the same but for its inputs,
// where the nodes of its shared operands (parameters, in its signature) are the same too.
// Not learnt from a node written under no_grad (a signature of its own).
struct LearntPlan {
  PyObject* plan = nullptr;          // owned: its address is the key
  std::int32_t op = 0, shape = 0;
  i64 sig = 0;
  PyObject* attr = nullptr;          // the node's kernel attr (owned; NULL for none)
  PyObject* own_dtype = nullptr;     // the node's dtype where not the graph's (owned; or NULL)
  std::vector<std::pair<std::size_t, i64>> shared;  // (operand position, its node)
  ~LearntPlan() {
    Py_XDECREF(plan);
    Py_XDECREF(attr);
    Py_XDECREF(own_dtype);
  }
};

// The store's `node_dtypes` dict and whether `shadows` holds any (borrowed; TypeError where
// Python rebound them to something else).
PyObject* graph_node_dtypes(Store* s);
// Node `node` holds values of `dtype`, not of the graph's floating dtype (Store.set_node_dtype).
void set_node_dtype(Store* s, i64 node, PyObject* dtype);
// The dtype of `node` where it is not the graph's floating dtype (borrowed), else NULL.
PyObject* node_dtype(Store* s, i64 node);
inline bool of_other_dtype(const Store* s, i64 node) { return s->nodes->other_dtype[node]; }
bool graph_has_shadows(Store* s);
// The graph's floating dtype once fixed, else None (borrowed).
inline PyObject* graph_fixed_dtype(const Store* s) {
  return s->fixed_dtype ? s->fixed_dtype : Py_None;
}

struct Expression {
  PyObject_HEAD
  Store* graph;
  i64 id;
  // A node-free view (views.cpp): the interned per-instance shape this handle presents over
  // node `id` (`x.unsqueeze(0)`, `x.view(1, -1)`), or -1 for the node's own shape.
  std::int32_t view;
};

extern PyTypeObject StoreType;
extern PyObject* g_graph_error;     // errors.GraphError
extern PyObject* g_current_graph;   // graph.current_graph
extern PyObject* g_shape_error;     // errors.ShapeError
extern PyObject* g_tensor_type;     // torch.Tensor
extern PyObject* g_expression_type; // graph.Expression: what new handles are
extern PyObject* g_mode_enabled;    // torch._C._is_torch_function_mode_enabled

// Whether torch function modes are on in this thread (the capture mode of a graph block): then
// a tensor attribute read costs a mode dispatch (~2 us), and the mode reports rebinds of
// requires_grad / data (Store.forget), so the rules may trust what they remember of a tensor.
bool torch_function_mode_enabled();
// The length of this thread's torch function mode stack (torch._C._len_torch_function_stack).
std::int64_t torch_function_stack_len();
// A tp_getattr that finds `__torch_function__` by an interned name (store.cpp says why).
PyObject* getattr_by_interned_torch_function(PyObject* self, char* name);
extern PyTypeObject ExpressionBase;

i64 n_nodes(const Store* s);
// The op table shared by every graph: how many op codes there are, and the ops.Op of a code
// (borrowed; ops are module constants, kept for the life of the process).
std::size_t op_count();
PyObject* op_object(std::int32_t code);
// The store's op code of `op` (an ops.Op), registering it on first sight.
std::int32_t op_code(PyObject* op);
std::int32_t intern_shape(Store* s, const i64* dims, std::size_t n);
const i64* shape_dims(const Store* s, std::int32_t id, std::size_t* n);
// Grad mode now (torch.is_grad_enabled, cached and called without arguments).
bool grad_enabled();
// Whether a torch.autocast region is on for the CPU or CUDA now (read per recorded torch call:
// such a call is refused, capture.dispatch._refuse_autocast).
bool autocast_enabled();
// The signature int of a Python key, interned on first sight (sig_ids, sig_keys).
i64 python_sig(Store* s, PyObject* key);
// Whether the leading dim of `node`'s shape is a length (its signature's `length_led` mark).
bool length_led(const Store* s, i64 node);
// Marks signature `sig` as length-led (a new signature whose key leaves its length out).
void mark_length_led(Store* s, i64 sig);
// Appends a node (its inputs already checked to be earlier nodes) and returns its handle.
PyObject* append(Store* s, std::int32_t op, const i64* args, std::size_t n_args,
                 std::int32_t shape, i64 sig, PyObject* attr, bool no_grad, i64 index = 0);
PyObject* new_expression(Store* s, i64 id);
// views.cpp: a handle presenting interned shape `shape` over node `id` with no node of its own
// (a plain handle where `shape` is the node's); a view's reshape node made where something
// reads its node (false with a Python error set on failure), and the handle's node and shape.
PyObject* new_view(Store* s, i64 id, std::int32_t shape);
bool materialize(Expression* e);
inline i64 expression_node(Expression* e) {  // throws PythonError (a guarded caller)
  if (e->view >= 0 && !materialize(e)) throw PythonError{};
  return e->id;
}
inline std::int32_t expression_shape_id(const Expression* e) {
  return e->view >= 0 ? e->view : e->graph->nodes->shape[e->id];
}
void check_open(const Store* s);

// The Expression operators (+ - * / @, unary -, x[i], x[a:b]), defined with the rules.
extern PyNumberMethods expression_number;
extern PyMappingMethods expression_mapping;

PyObject* register_store(PyObject* module);
bool register_rules(PyObject* module);
bool register_fused(PyObject* module);
bool register_capture(PyObject* module);
bool register_dispatch(PyObject* module);
bool register_lstm(PyObject* module);
bool register_tree_lstm(PyObject* module);
bool register_views(PyObject* module);
// views.cpp: a call that makes or reads a node-free view (unsqueeze / view / reshape of an
// expression, a one-element cross-entropy of a view), or NULL (no error) for any other call.
PyObject* view_call(PyObject* func, PyObject* args, PyObject* kwargs);
// views.cpp: `x[0]` of a view whose first dim is 1, a view of the rest; NULL (no error) else.
PyObject* view_getitem(PyObject* x, PyObject* index);

}  // namespace flybatch
