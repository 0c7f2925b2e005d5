// The helpers of the op rules (rules.cpp) that the fused-module nodes (fused.cpp) create their
// nodes with: resolving operands to nodes, checking shapes, keying and interning signatures.
// Shared so that a fused node's operands and signature follow the rules' own conventions (one
// operand resolution, one per-graph key table, one ShapeError format), not a copy of them.
#pragma once

#include "store.h"

#include <algorithm>
#include <initializer_list>
#include <utility>
#include <vector>

namespace flybatch {

// Every binding here creates nodes: its time is flybatch's part of the build (OwnTimeScope).
template <class Body>
PyObject* creating_nodes(Body&& body) {
  OwnTimeScope own;
  return guarded(std::forward<Body>(body));
}

struct Release {  // drops a reference at the end of a scope
  PyObject* o;
  ~Release() { Py_XDECREF(o); }
};

// The key of a signature as ints, without allocating for the usual few.
using Key = SmallInts<12>;

// A node's shape as dims (a view into the store's shape table).
struct Dims {
  const i64* d;
  std::size_t n;
  i64 operator[](std::size_t i) const { return d[i]; }
  bool operator==(const Dims& o) const { return n == o.n && std::equal(d, d + n, o.d); }
};

inline Dims dims_of(const Store* g, i64 node) {
  Dims out;
  out.d = shape_dims(g, g->nodes->shape[node], &out.n);
  return out;
}

inline PyObject* shape_tuple(const Store* g, i64 node) {
  return (*g->shape_tuples)[g->nodes->shape[node]];
}

// ---- operands ----------------------------------------------------------------------------------
// The graph of the first expression among `xs` (items of a list too), else the current graph.
// Returns a new reference.
Store* graph_of(PyObject* const* xs, std::size_t n);

// Owns a reference to a graph for the length of a rule call.
struct GraphRef {
  explicit GraphRef(Store* g) : g(g) {}
  ~GraphRef() { Py_DECREF(reinterpret_cast<PyObject*>(g)); }
  GraphRef(const GraphRef&) = delete;
  GraphRef& operator=(const GraphRef&) = delete;
  Store* g;
};

// The node of operand `x` in `g`: an Expression of `g` is its node; a parameter or a float this
// graph has seen is found in C; anything else goes through `Graph._operand` (the value rules).
// Raises GraphError for an expression of another (or a closed) graph.
i64 node_of(Store* g, PyObject* x);

PyObject* new_tuple(std::initializer_list<PyObject*> items);  // steals the items

// ---- signatures --------------------------------------------------------------------------------
// The signature int of `key` in `g`; `python_key()` (a new reference) is called only for a key
// this graph has not met.
// `led`: the key leaves out its nodes' own leading dim, a length (marked `length_led`).
template <class PythonKey>
i64 signature(Store* g, const Key& key, bool no_grad, PythonKey&& python_key, bool led = false) {
  const std::uint64_t h = KeyTable::hash(key.data(), key.size());
  const std::int32_t id = g->sig_keys_c->find(key.data(), key.size(), h);
  if (id >= 0) return (*g->sig_of_key)[id];
  PyObject* readable = python_key();
  if (no_grad) readable = new_tuple({PyUnicode_FromString("no_grad"), readable});
  i64 sig;
  try {
    sig = python_sig(g, readable);
  } catch (...) {
    Py_DECREF(readable);
    throw;
  }
  Py_DECREF(readable);
  if (led) mark_length_led(g, sig);
  g->sig_of_key->push_back(sig);
  g->sig_keys_c->insert(key.data(), key.size(), h);
  return sig;
}

// The shapes of `nodes` as a tuple of shape tuples (the readable part of a signature's key).
PyObject* shapes_tuple(const Store* g, const i64* nodes, std::size_t n);

// Raises fb.ShapeError with the message of `format` (PyErr_Format's): the op and the shapes.
[[noreturn]] void shape_error(const char* format, ...);

// ---- lookups ------------------------------------------------------------------------------------
// The graph's tag of embedding table `table` (borrowed; made once per graph, which holds the
// table until close).
PyObject* lookup_tag(Store* g, PyObject* table);
// A lookup node: row `row` of `table` (a matrix of `cols` columns; the caller checked the row),
// of per-instance shape index_dims + (cols,) (F.embedding of a one-element index of that
// shape; none for fb.lookup's row). `options`: an nn.Embedding's, or NULL.
PyObject* lookup_node(Store* g, std::int32_t op, PyObject* table, i64 cols, i64 row,
                      bool is_sparse, PyObject* options, const i64* index_dims,
                      std::size_t n_index);

// ---- nodes made by a rule ----------------------------------------------------------------------
// `fb.slice_rows(x, start, stop)`, the node of the Expression operator `x[start:stop]` (a
// State's `h` and `c` are such slices of its [h; c]). A new reference, or NULL with an
// exception set.
PyObject* slice_rows(PyObject* x, PyObject* start, PyObject* stop);

}  // namespace flybatch
