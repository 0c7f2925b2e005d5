// The op-creation hot path: `fb.tanh(x)`, `a + b`, `W @ h`, `fb.lookup(E, i)`... are one C call
// each. A `_core.Rule` wraps one row of the op table of ops.py (an `Op` whose `rule` names its
// family below); calling it resolves the operands, applies the family's shape rule, interns the
// signature and appends the node. The Expression operators are C slots calling these rules.
//
// Operands: an Expression of the graph is its node; anything else (a tensor, an ndarray, a
// number) goes through ONE Python callback, `Graph._operand`, which keeps the value rules
// (copy at the call, leaf requiring grad = parameter, constants keyed by their bits); floats
// already seen by this graph skip it.
//
// Signatures: each family writes its key as ints (op code, no-grad mark, shape ids, tags...);
// the first time a graph meets a key, the family's `python_key` builds the readable tuple
// (what `signatures.describe` prints), interned in the same per-graph table as the keys of
// `Graph.add`, so both paths agree on one int per key.
//
// Adding a rule family: a `Family` value, its case in `apply` (shape rule and key) and in
// `python_key`, and its name in `family_of`.
//
// The fused-module nodes (fused.cpp) resolve operands and key signatures with the helpers
// declared in rules.h, defined here.
#include "rules.h"

#include <structmember.h>

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <string>

namespace flybatch {

enum class Family {
  unary,      // same shape
  vector,     // same shape, which must be a vector (softmax)
  reduce,     // a scalar (sum_elems)
  binary,     // elementwise, NumPy broadcasting
  matmul,     // vectors and matrices; batched by a shared parameter's tag
  affine,     // W @ x + b
  list,       // equal shapes, any number (esum, average, emax)
  stack,      // equal shapes, any number, stacked as the rows of one tensor
  concat,     // along a dim
  pick,       // an element or row, by index
  pick_nls,   // -log_softmax(x)[label]
  slice,      // x[start:stop]
  lookup,     // a row of an embedding table
};

struct Rule {
  PyObject_HEAD
  vectorcallfunc call;
  Family family;
  std::int32_t code;  // of `op` in the op table
  std::int32_t alt;   // concat: the op of shapes that cannot be stacked; else -1
  PyObject* op;
  PyObject* alt_op;
  PyObject* name;     // op.name
  PyObject* doc;
  PyObject* lists;    // what a list or tuple of operands is given to (a Python function), or NULL
  const char* cname;
  bool ragged;        // list: the key leaves out the number of inputs
  bool padded;        // the key may leave out a length (see "batching across lengths")
};

namespace {

PyObject* s_operand = nullptr;  // "_operand"
PyObject* s_lookup_tag = nullptr;
// Attribute names read per op call, interned once (a name built per read costs more than the
// read's dict lookup).
PyObject* s_requires_grad = nullptr;
PyObject* s_shape = nullptr;
PyObject* g_ops_module = nullptr;  // flybatch.ops, for _embedding_args and _integer
PyObject* g_rules[8] = {};          // the operator rules: + - * / @ neg pick slice

enum Operator { kAdd, kSub, kMul, kDiv, kMatmul, kNeg, kPick, kSlice };

// The key of `node`'s shape with its leading dim left out (any length, padded in a batch): a
// mark, then the shape of the rest (the mark keeps it apart from the key of a whole shape).
void push_any_length(Store* g, Key& key, i64 node) {
  const Dims dims = dims_of(g, node);
  const std::vector<i64> rest(dims.d + 1, dims.d + dims.n);  // interning may move the table
  key.push(-2);
  key.push(intern_shape(g, rest.data(), rest.size()));
}

// The readable form of a shape (n, *rest) of any length n: ("n", *rest), which
// signatures.describe prints as (n, 64).
PyObject* any_length_tuple(const i64* rest, std::size_t n) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(n + 1));
  if (!t) throw PythonError{};
  for (std::size_t i = 0; i <= n; ++i) {
    PyObject* d = i ? PyLong_FromLongLong(rest[i - 1]) : PyUnicode_FromString("n");
    if (!d) {
      Py_DECREF(t);
      throw PythonError{};
    }
    PyTuple_SET_ITEM(t, i, d);
  }
  return t;
}

// That of `node`'s shape with its leading dim left out.
PyObject* any_length_tuple(const Store* g, i64 node) {
  const Dims dims = dims_of(g, node);
  return any_length_tuple(dims.d + 1, dims.n - 1);
}

// ---- batching across lengths ------------------------------------------------------------------
// A node batches across lengths when its key writes a length as n (push_any_length): the
// executor pads its batch's arguments to the longest, gives the kernel each node's length, and
// stores a result whose length varies padded with zeros. Nodes of equal shapes batch as before
// (the rest of the key keeps them apart as their shapes did); only a mix of lengths batches more.
// A node whose own leading dim is such a length is `length_led` (a stack's rows, a softmax of
// any length, the rows of `M_i @ q`); elementwise ops and reductions follow their inputs: they
// batch across lengths only where an input is length-led. So a leading dim that is no length
// (a parameter's rows, the rows of an embedding lookup, the n of a fixed-size vector) keeps
// its exact key, and the signatures (and the bound over them, stats.lower_bound) stay as they
// were on graphs without lengths. Each family's rule:

// Softmaxes of vectors (softmax, log_softmax, and pick_neg_log_softmax): any vector's length is
// one; the result is length-led.
bool vector_across_lengths(const Dims& x) { return x.n == 1; }

// Unary elementwise (tanh, exp, ...): of a length-led input; the result is as long, length-led.
bool unary_across_lengths(const Store* g, i64 x) { return length_led(g, x); }

// Reductions to a scalar (sum_elems, mean_elems, squared_norm): of a length-led input.
bool reduce_across_lengths(const Store* g, i64 x) { return length_led(g, x); }

// `x[i]` (pick): of a length-led input (an element of a softmax's weights, a row of a stack, a
// step of an lstm_layer's result). Not of any other input: picks from a captured embedding
// lookup of each tree's words, of (n_i, D), keep one signature per n_i, as their reads do.
bool pick_across_lengths(const Store* g, i64 x) { return length_led(g, x); }

// Binary elementwise (add, sub, mul, div): when an operand as long as the result (aligned: as
// many dims and the same leading dim) is length-led. Then every aligned operand's leading dim
// is written n (it equals the result's, node by node: `scores_i + mask_i`), and the others keep
// their whole shape (a broadcast row `K_i W + q U`, a scalar `0.5 * scores_i`); the result is
// length-led. Returns the aligned operands as bits (1: a, 2: b), 0 when the node batches by its
// exact shapes. (A result of length 1 makes an operand of leading dim 1 aligned, where a longer
// one would make it a broadcast row: two keys, never one batch mixing the two readings.)
int binary_across_lengths(const Store* g, const i64* args, const Dims& out) {
  if (out.n == 0) return 0;
  int aligned = 0;
  bool led = false;
  for (int k = 0; k < 2; ++k) {
    const Dims x = dims_of(g, args[k]);
    if (x.n == out.n && x[0] == out[0]) {
      aligned |= 1 << k;
      led = led || length_led(g, args[k]);
    }
  }
  return led ? aligned : 0;
}

// ---- operands ----------------------------------------------------------------------------------
bool is_expression(PyObject* x) { return PyObject_TypeCheck(x, &ExpressionBase); }

Expression* as_expression(PyObject* x) { return reinterpret_cast<Expression*>(x); }

// An index as an int: a Python int directly, anything else as ops._integer decides (a float or
// a bool is a bug at the caller, not a row number).
i64 integer(const char* name, PyObject* index) {
  if (PyLong_CheckExact(index)) {
    const long long v = PyLong_AsLongLong(index);
    if (v == -1 && PyErr_Occurred()) throw PythonError{};
    return v;
  }
  PyObject* v = PyObject_CallMethod(g_ops_module, "_integer", "sO", name, index);
  if (!v) throw PythonError{};
  const long long out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  if (out == -1 && PyErr_Occurred()) throw PythonError{};
  return out;
}

PyObject* tag_of(const Store* g, i64 node) {  // a parameter's tag, else None
  const auto found = g->param_tags->find(node);
  return Py_NewRef(found == g->param_tags->end() ? Py_None : found->second);
}

i64 tag_number(const Store* g, i64 node) {
  const auto found = g->param_tags->find(node);
  return found == g->param_tags->end() ? -1 : PyLong_AsLongLong(PyTuple_GET_ITEM(found->second, 1));
}

}  // namespace

// ---- shared with fused.cpp (rules.h) -----------------------------------------------------------
Store* graph_of(PyObject* const* xs, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (is_expression(xs[i]))
      return reinterpret_cast<Store*>(
          Py_NewRef(reinterpret_cast<PyObject*>(as_expression(xs[i])->graph)));
  PyObject* g = PyObject_CallNoArgs(g_current_graph);
  if (!g) throw PythonError{};
  return reinterpret_cast<Store*>(g);
}

i64 node_of(Store* g, PyObject* x) {
  if (is_expression(x)) {
    Expression* e = as_expression(x);
    if (e->graph == g) return expression_node(e);
    if (e->graph->closed)
      raise(g_graph_error, "%R belongs to a closed graph; expressions cannot outlive their graph "
                           "(create them in the current graph)", x);
    raise(g_graph_error, "%R belongs to another graph; one op cannot mix two graphs", x);
  }
  // A parameter seen before: still one? Inside a graph block (a torch function mode on) the
  // capture mode reports `requires_grad_(False)` and the like through Store.forget, so the
  // entry is trusted there; elsewhere asking the tensor is cheap (no mode to dispatch to).
  const auto parameter = g->parameters->find(x);
  if (parameter != g->parameters->end()) {
    if (torch_function_mode_enabled()) return parameter->second;
    PyObject* grad = PyObject_GetAttr(x, s_requires_grad);
    if (!grad) throw PythonError{};
    Py_DECREF(grad);
    if (grad == Py_True) return parameter->second;
  }
  std::uint64_t bits = 0;
  const bool number = PyFloat_CheckExact(x);
  if (number) {  // the constant of these bits, if this graph has made it already
    const double v = PyFloat_AS_DOUBLE(x);
    std::memcpy(&bits, &v, sizeof bits);
    const auto found = g->scalars->find(bits);
    if (found != g->scalars->end()) return found->second;
  }
  PyObject* node = PyObject_CallMethodOneArg(reinterpret_cast<PyObject*>(g), s_operand, x);
  if (!node) throw PythonError{};
  const i64 id = PyLong_AsLongLong(node);
  Py_DECREF(node);
  if (id == -1 && PyErr_Occurred()) throw PythonError{};
  if (number) g->scalars->emplace(bits, id);
  // A parameter's node (its attr is the tensor itself, held by the graph until close): the
  // next use of the tensor skips the callback.
  if (g->param_tags->count(id) && (*g->attrs)[id] == x) g->parameters->emplace(x, id);
  return id;
}

PyObject* new_tuple(std::initializer_list<PyObject*> items) {  // steals the items
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
  Py_ssize_t i = 0;
  for (PyObject* item : items) {
    if (!t || !item) {
      Py_XDECREF(item);
      continue;
    }
    PyTuple_SET_ITEM(t, i++, item);
  }
  if (t && i < static_cast<Py_ssize_t>(items.size())) Py_CLEAR(t);
  if (!t) throw PythonError{};
  return t;
}

PyObject* shapes_tuple(const Store* g, const i64* nodes, std::size_t n) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (!t) throw PythonError{};
  for (std::size_t i = 0; i < n; ++i) PyTuple_SET_ITEM(t, i, Py_NewRef(shape_tuple(g, nodes[i])));
  return t;
}

void shape_error(const char* format, ...) {
  va_list args;
  va_start(args, format);
  PyErr_FormatV(g_shape_error, format, args);
  va_end(args);
  throw PythonError{};
}

namespace {

// ---- the families ------------------------------------------------------------------------------

// The node `rule` makes of `operands` (already resolved to `args` in `g`). `extra`: the index of
// pick, the bounds of slice, the dim of concat.
PyObject* apply(Rule* rule, Store* g, const i64* args, std::size_t n, PyObject* const* extra) {
  const char* name = rule->cname;
  Key key;
  std::int32_t code = rule->code;
  std::vector<i64> out_dims;
  PyObject* attr = Py_None;
  PyObject* owned_attr = nullptr;  // a new reference to release after the append
  i64 index = 0;
  std::int32_t out_shape = -1;
  const bool no_grad = !grad_enabled();
  // `led`: the node's own leading dim is a length its key leaves out.
  auto finish = [&](auto&& python_key, bool led = false) -> PyObject* {
    key.push(no_grad);
    if (out_shape < 0) out_shape = intern_shape(g, out_dims.data(), out_dims.size());
    const i64 sig = signature(g, key, no_grad, python_key, led);
    check_open(g);
    PyObject* e;
    try {
      e = append(g, code, args, n, out_shape, sig, attr, no_grad, index);
    } catch (...) {
      Py_XDECREF(owned_attr);
      throw;
    }
    Py_XDECREF(owned_attr);
    return e;
  };
  auto named = [&](std::initializer_list<PyObject*> rest) {
    std::vector<PyObject*> items{Py_NewRef(rule->name)};
    items.insert(items.end(), rest.begin(), rest.end());
    PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
    if (!t) {
      for (PyObject* i : items) Py_XDECREF(i);
      throw PythonError{};
    }
    for (std::size_t i = 0; i < items.size(); ++i) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
  };
  const Dims a = dims_of(g, args[0]);
  key.push(code);
  switch (rule->family) {
    case Family::vector:
      if (a.n != 1) shape_error("%s: needs a vector, got shape %R", name, shape_tuple(g, args[0]));
      [[fallthrough]];
    case Family::unary:
      out_shape = g->nodes->shape[args[0]];
      if (rule->padded && (rule->family == Family::vector ? vector_across_lengths(a)
                                                          : unary_across_lengths(g, args[0]))) {
        push_any_length(g, key, args[0]);
        return finish([&] { return named({any_length_tuple(g, args[0])}); }, /*led=*/true);
      }
      key.push(out_shape);
      return finish([&] { return named({Py_NewRef(shape_tuple(g, args[0]))}); });
    case Family::reduce:
      if (rule->padded && reduce_across_lengths(g, args[0])) {
        push_any_length(g, key, args[0]);
        return finish([&] { return named({any_length_tuple(g, args[0])}); });
      }
      key.push(g->nodes->shape[args[0]]);
      return finish([&] { return named({Py_NewRef(shape_tuple(g, args[0]))}); });
    case Family::binary: {
      const Dims b = dims_of(g, args[1]);
      if (a == b) {
        out_shape = g->nodes->shape[args[0]];
      } else {
        const std::size_t nd = std::max(a.n, b.n);
        out_dims.resize(nd);
        for (std::size_t i = 1; i <= nd; ++i) {
          const i64 da = i <= a.n ? a[a.n - i] : 1, db = i <= b.n ? b[b.n - i] : 1;
          if (da != db && da != 1 && db != 1)
            shape_error("%s: shapes %R and %R do not broadcast", name, shape_tuple(g, args[0]),
                        shape_tuple(g, args[1]));
          out_dims[nd - i] = std::max(da, db);
        }
      }
      const Dims out = a == b ? a : Dims{out_dims.data(), out_dims.size()};
      const int aligned = rule->padded ? binary_across_lengths(g, args, out) : 0;
      static PyObject* aligned_attrs[4] = {};  // the kernel's attr: the aligned operands' bits
      if (aligned && !aligned_attrs[aligned] && !(aligned_attrs[aligned] = PyLong_FromLong(aligned)))
        throw PythonError{};
      if (aligned) attr = aligned_attrs[aligned];
      for (int k = 0; k < 2; ++k) {
        if (aligned >> k & 1) push_any_length(g, key, args[k]);
        else key.push(g->nodes->shape[args[k]]);
      }
      return finish([&] {
        auto shape = [&](int k) {
          return aligned >> k & 1 ? any_length_tuple(g, args[k]) : Py_NewRef(shape_tuple(g, args[k]));
        };
        return named({shape(0), shape(1)});
      }, /*led=*/aligned != 0);
    }
    case Family::matmul: {
      const Dims b = dims_of(g, args[1]);
      if (!(1 <= a.n && a.n <= 2 && 1 <= b.n && b.n <= 2) || a[a.n - 1] != b[0])
        shape_error("matmul: cannot multiply shapes %R and %R", shape_tuple(g, args[0]),
                    shape_tuple(g, args[1]));
      out_dims.assign(a.d, a.d + a.n - 1);
      out_dims.insert(out_dims.end(), b.d + 1, b.d + b.n);
      // (a is a vector, b is a vector): what the kernel needs, one of four shared tuples
      static PyObject* vecs[4] = {};
      const int which = 2 * (a.n == 1) + (b.n == 1);
      if (!vecs[which] && !(vecs[which] = Py_BuildValue("(OO)", a.n == 1 ? Py_True : Py_False,
                                                        b.n == 1 ? Py_True : Py_False)))
        throw PythonError{};
      attr = vecs[which];
      key.push(tag_number(g, args[0]));
      // Padded: the rows of a matrix a (W_i @ q with W_i of n_i rows), or the length of a
      // vector a contracted with b (weights_i @ H_i), unless a parameter fixes it.
      if (rule->padded && tag_number(g, args[0]) < 0 &&
          (a.n == 2 || (a.n == 1 && tag_number(g, args[1]) < 0))) {
        const bool vector = a.n == 1;  // (a's dims may move when the key is interned)
        push_any_length(g, key, args[0]);
        if (vector) push_any_length(g, key, args[1]);
        else key.push(g->nodes->shape[args[1]]);
        return finish([&] {
          return named({Py_NewRef(Py_None), any_length_tuple(g, args[0]),
                        vector ? any_length_tuple(g, args[1])
                               : Py_NewRef(shape_tuple(g, args[1]))});
        }, /*led=*/!vector);  // M_i @ q has M_i's rows
      }
      key.push(g->nodes->shape[args[0]]);
      key.push(g->nodes->shape[args[1]]);
      return finish([&] {
        return named({tag_of(g, args[0]), Py_NewRef(shape_tuple(g, args[0])),
                      Py_NewRef(shape_tuple(g, args[1]))});
      });
    }
    case Family::affine: {
      const Dims x = dims_of(g, args[1]), b = dims_of(g, args[2]);
      if (a.n != 2 || x.n != 1 || x[0] != a[1] || b.n != 1 || b[0] != a[0])
        shape_error("affine: W %R @ x %R + b %R do not fit", shape_tuple(g, args[0]),
                    shape_tuple(g, args[1]), shape_tuple(g, args[2]));
      out_dims.assign(1, a[0]);
      key.push(tag_number(g, args[0]));
      key.push(tag_number(g, args[2]));
      key.push(g->nodes->shape[args[0]]);
      key.push(g->nodes->shape[args[1]]);
      return finish([&] {
        return named({tag_of(g, args[0]), tag_of(g, args[2]), Py_NewRef(shape_tuple(g, args[0])),
                      Py_NewRef(shape_tuple(g, args[1]))});
      });
    }
    case Family::list:
    case Family::stack: {
      const std::int32_t shape = g->nodes->shape[args[0]];
      for (std::size_t i = 1; i < n; ++i)
        if (g->nodes->shape[args[i]] != shape) {
          PyObject* distinct = PySet_New(nullptr);
          for (std::size_t j = 0; distinct && j < n; ++j)
            if (PySet_Add(distinct, shape_tuple(g, args[j])) < 0) Py_CLEAR(distinct);
          PyObject* sorted = distinct ? PySequence_List(distinct) : nullptr;
          Py_XDECREF(distinct);
          if (!sorted || PyList_Sort(sorted) < 0) {
            Py_XDECREF(sorted);
            throw PythonError{};
          }
          PyErr_Format(g_shape_error, "%s: all shapes must be equal, got %R", name, sorted);
          Py_DECREF(sorted);
          throw PythonError{};
        }
      key.push(shape);
      if (rule->family == Family::stack) {  // (n, *shape), whatever n
        out_dims.assign(1, static_cast<i64>(n));
        out_dims.insert(out_dims.end(), a.d, a.d + a.n);
        return finish([&] {
          const Dims item = dims_of(g, args[0]);
          return named({any_length_tuple(item.d, item.n)});
        }, /*led=*/true);
      }
      out_shape = shape;
      if (!rule->ragged) key.push(static_cast<i64>(n));
      return finish([&] {
        PyObject* s = Py_NewRef(shape_tuple(g, args[0]));
        return rule->ragged ? named({s}) : named({s, PyLong_FromSize_t(n)});
      });
    }
    case Family::concat: {
      const i64 dim = integer("concat", extra[0]);
      if (!(0 <= dim && dim < static_cast<i64>(a.n)))
        shape_error("concat: dim %lld out of range for shape %R", static_cast<long long>(dim),
                    shape_tuple(g, args[0]));
      bool same = true;  // every shape equal: stacked along dim 0 in one gather
      out_dims.assign(a.d, a.d + a.n);
      out_dims[dim] = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const Dims s = dims_of(g, args[i]);
        bool fits = s.n == a.n;
        for (std::size_t k = 0; fits && k < a.n; ++k)
          fits = k == static_cast<std::size_t>(dim) || s[k] == a[k];
        if (!fits) {
          PyObject* shapes = shapes_tuple(g, args, n);
          PyObject* list = PySequence_List(shapes);
          Py_DECREF(shapes);
          if (!list) throw PythonError{};
          PyErr_Format(g_shape_error, "concat: shapes %R differ outside dim %lld", list,
                       static_cast<long long>(dim));
          Py_DECREF(list);
          throw PythonError{};
        }
        same = same && g->nodes->shape[args[i]] == g->nodes->shape[args[0]];
        out_dims[dim] += s[dim];
      }
      if (!(dim == 0 && same)) code = rule->alt;
      attr = owned_attr = PyLong_FromLongLong(dim);
      if (!attr) throw PythonError{};
      key.push(dim);
      for (std::size_t i = 0; i < n; ++i) key.push(g->nodes->shape[args[i]]);
      return finish([&] { return named({shapes_tuple(g, args, n), PyLong_FromLongLong(dim)}); });
    }
    case Family::pick:
    case Family::pick_nls: {
      if (rule->family == Family::pick_nls && a.n != 1)
        shape_error("pick_neg_log_softmax: needs a vector, got shape %R", shape_tuple(g, args[0]));
      if (a.n == 0) shape_error("%s: cannot index a scalar", name);
      i64 i = integer(name, extra[0]);
      if (!(-a[0] <= i && i < a[0]))
        raise(PyExc_IndexError, "%s: index %lld out of range for shape %R", name,
              static_cast<long long>(i), shape_tuple(g, args[0]));
      if (i < 0) i += a[0];
      if (rule->family == Family::pick) out_dims.assign(a.d + 1, a.d + a.n);
      index = i;
      if (rule->padded && (rule->family == Family::pick_nls || pick_across_lengths(g, args[0]))) {
        push_any_length(g, key, args[0]);
        return finish([&] { return named({any_length_tuple(g, args[0])}); });
      }
      key.push(g->nodes->shape[args[0]]);
      return finish([&] { return named({Py_NewRef(shape_tuple(g, args[0]))}); });
    }
    case Family::slice: {
      if (a.n == 0) shape_error("slice: cannot slice a scalar");
      PyObject* bounds = PySlice_New(extra[0], extra[1], nullptr);
      if (!bounds) throw PythonError{};
      Py_ssize_t begin, end, step;
      const int failed = PySlice_Unpack(bounds, &begin, &end, &step);
      Py_DECREF(bounds);
      if (failed < 0) throw PythonError{};
      PySlice_AdjustIndices(a[0], &begin, &end, step);
      if (end < begin) end = begin;  // empty, as in torch (`h[k:]` with k == len(h))
      out_dims.assign(a.d, a.d + a.n);
      out_dims[0] = end - begin;
      attr = owned_attr = Py_BuildValue("(nn)", begin, end);
      if (!attr) throw PythonError{};
      key.push(g->nodes->shape[args[0]]);
      key.push(begin);
      key.push(end);
      return finish([&] {
        return named({Py_NewRef(shape_tuple(g, args[0])), PyLong_FromSsize_t(begin),
                      PyLong_FromSsize_t(end)});
      });
    }
    default:
      break;
  }
  PyErr_SetString(PyExc_SystemError, "rule family without a shape rule");
  throw PythonError{};
}

// `fb.lookup(table, index, sparse=None, graph=None)`: a row of a matrix (or nn.Embedding).
PyObject* lookup(Rule* rule, PyObject* const* argv, std::size_t argc) {
  PyObject *table = argv[0], *sparse = argc > 2 ? argv[2] : Py_None,
           *graph = argc > 3 ? argv[3] : Py_None, *options = nullptr;
  PyObject* owned = nullptr;  // (table, sparse, options) of an nn.Embedding
  if (!PyObject_TypeCheck(table, reinterpret_cast<PyTypeObject*>(g_tensor_type))) {
    owned = PyObject_CallMethod(g_ops_module, "_embedding_args", "OO", table, sparse);
    if (!owned) throw PythonError{};
    table = PyTuple_GET_ITEM(owned, 0);
    sparse = PyTuple_GET_ITEM(owned, 1);
    options = PyTuple_GET_ITEM(owned, 2);
  }
  Release release{owned};
  const int is_sparse = PyObject_IsTrue(sparse);
  if (is_sparse < 0) throw PythonError{};
  static PyObject* no_options = PyTuple_New(0);
  if (!options) options = no_options;
  GraphRef ref(graph == Py_None ? graph_of(nullptr, 0)
                                : reinterpret_cast<Store*>(Py_NewRef(graph)));
  Store* g = ref.g;
  std::pair<i64, i64> table_size;  // (rows, cols), remembered once the graph holds the table
  auto known = g->table_shapes->find(table);
  if (known != g->table_shapes->end() && !torch_function_mode_enabled()) {
    g->table_shapes->erase(known);  // no mode reports a rebind of `.data` here: read it again
    known = g->table_shapes->end();
  }
  if (known == g->table_shapes->end()) {
    PyObject* size = PyObject_GetAttr(table, s_shape);
    if (!size) throw PythonError{};
    Release size_ref{size};
    if (PyTuple_GET_SIZE(size) != 2) {
      PyObject* plain = PySequence_Tuple(size);  // (3,), not torch.Size([3])
      if (!plain) throw PythonError{};
      PyErr_Format(g_shape_error, "lookup: the table must be a matrix, got shape %R", plain);
      Py_DECREF(plain);
      throw PythonError{};
    }
    table_size = {PyLong_AsLongLong(PyTuple_GET_ITEM(size, 0)),
                  PyLong_AsLongLong(PyTuple_GET_ITEM(size, 1))};
  } else {
    table_size = known->second;
  }
  const auto [rows, cols] = table_size;
  const i64 i = integer("lookup", argv[1]);
  if (!(0 <= i && i < rows))
    raise(PyExc_IndexError, "lookup: index %lld out of range for a table of %lld rows",
          static_cast<long long>(i), static_cast<long long>(rows));
  PyObject* out = lookup_node(g, rule->code, table, cols, i, is_sparse,
                              options == no_options ? nullptr : options, nullptr, 0);
  // (remembered once the graph holds the table: lookup_node made its tag)
  if (known == g->table_shapes->end()) g->table_shapes->emplace(table, table_size);
  return out;
}

}  // namespace

PyObject* lookup_tag(Store* g, PyObject* table) {
  check_open(g);
  PyObject*& tag = (*g->table_tags)[table];  // the graph's tags hold the table until close
  if (!tag) {
    tag = PyObject_CallMethodOneArg(reinterpret_cast<PyObject*>(g), s_lookup_tag, table);
    if (!tag) {
      g->table_tags->erase(table);
      throw PythonError{};
    }
  }
  return tag;
}

PyObject* lookup_node(Store* g, std::int32_t op, PyObject* table, i64 cols, i64 row,
                      bool is_sparse, PyObject* options, const i64* index_dims,
                      std::size_t n_index) {
  static PyObject* no_options = PyTuple_New(0);
  if (!options) options = no_options;
  PyObject* tag = lookup_tag(g, table);
  SmallInts<8> dims;
  for (std::size_t k = 0; k < n_index; ++k) dims.push(index_dims[k]);
  dims.push(cols);
  const std::int32_t shape = intern_shape(g, dims.data(), dims.size());
  const bool no_grad = false;  // a leaf: no inputs, so no grad mode of its own
  PyObject* sparse_flag = is_sparse ? Py_True : Py_False;
  auto python_key = [&] {
    PyObject* head = Py_BuildValue("(sOOO)", "lookup", tag, sparse_flag,
                                   (*g->shape_tuples)[shape]);
    if (!head) throw PythonError{};
    PyObject* full = PySequence_Concat(head, options);
    Py_DECREF(head);
    if (!full) throw PythonError{};
    return full;
  };
  i64 sig;
  if (options == no_options) {
    Key key;
    key.push(op);
    key.push(PyLong_AsLongLong(PyTuple_GET_ITEM(tag, 1)));
    key.push(is_sparse);
    key.push(shape);
    sig = signature(g, key, no_grad, python_key);
  } else {  // an nn.Embedding's options (rare): its whole Python key, every time
    PyObject* readable = python_key();
    Release readable_ref{readable};
    sig = python_sig(g, readable);
  }
  // The kernel's attr, (table, sparse, options), is shared by the lookups of a table (one
  // tuple per graph, not per node); the row goes to the store's index column.
  PyObject* attr;  // a new reference
  if (options == no_options) {
    PyObject*& shared = (*g->lookup_attrs[is_sparse])[table];  // held by the graph until close
    if (!shared && !(shared = Py_BuildValue("(OOO)", table, sparse_flag, options))) {
      g->lookup_attrs[is_sparse]->erase(table);
      throw PythonError{};
    }
    attr = Py_NewRef(shared);
  } else if (!(attr = Py_BuildValue("(OOO)", table, sparse_flag, options))) {
    throw PythonError{};
  }
  Release attr_ref{attr};
  return append(g, op, nullptr, 0, shape, sig, attr, no_grad, row);
}

namespace {

std::size_t arity(Family family) {
  switch (family) {
    case Family::binary:
    case Family::matmul: return 2;
    case Family::affine: return 3;
    default: return 1;
  }
}

// Calls `rule` on positional operands (the list families take one sequence).
PyObject* call_rule(Rule* rule, PyObject* const* argv, std::size_t argc, PyObject* const* extra) {
  return creating_nodes([&]() -> PyObject* {
    if (rule->family == Family::lookup) return lookup(rule, argv, argc);
    PyObject* const* operands = argv;
    std::size_t n = arity(rule->family);
    PyObject* seq = nullptr;
    if (rule->family == Family::list || rule->family == Family::stack ||
        rule->family == Family::concat) {
      seq = PySequence_Fast(argv[0], "expected a list of expressions");
      if (!seq) throw PythonError{};
      operands = PySequence_Fast_ITEMS(seq);
      n = PySequence_Fast_GET_SIZE(seq);
    }
    Release release{seq};
    if (n == 0) raise(PyExc_ValueError, "%s: needs at least one expression", rule->cname);
    GraphRef ref(graph_of(operands, n));
    i64 small[3];
    std::vector<i64> many;
    i64* args = small;
    if (n > 3) {
      many.resize(n);
      args = many.data();
    }
    for (std::size_t i = 0; i < n; ++i) args[i] = node_of(ref.g, operands[i]);
    return apply(rule, ref.g, args, n, extra);
  });
}

// ---- the Rule type -----------------------------------------------------------------------------
PyObject* rule_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Rule* rule = reinterpret_cast<Rule*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  // Positional parameters after the operands, and their defaults.
  static const char* const lookup_names[] = {"table", "index", "sparse", "graph"};
  static const char* const concat_names[] = {"xs", "dim"};
  static const char* const slice_names[] = {"x", "start", "stop"};
  static const char* const pick_names[] = {"x", "i"};
  static const char* const label_names[] = {"x", "label"};
  const char* const* names = nullptr;
  std::size_t total = arity(rule->family), required = total;
  switch (rule->family) {
    case Family::lookup: names = lookup_names, total = 4, required = 2; break;
    case Family::concat: names = concat_names, total = 2, required = 1; break;
    case Family::slice: names = slice_names, total = 3, required = 3; break;
    case Family::pick: names = pick_names, total = 2, required = 2; break;
    case Family::pick_nls: names = label_names, total = 2, required = 2; break;
    default: break;
  }
  PyObject* full[4] = {nullptr, nullptr, Py_None, Py_None};
  static PyObject* zero = PyLong_FromLong(0);
  if (rule->family == Family::concat) full[1] = zero;
  if (static_cast<std::size_t>(nargs) > total) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zu arguments (%zd given)", rule->cname, total,
                 nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) full[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    const char* kw = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
    std::size_t at = total;
    for (std::size_t i = 0; names && kw && i < total; ++i)
      if (std::strcmp(kw, names[i]) == 0) at = i;
    if (at == total) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", rule->cname,
                   kw ? kw : "?");
      return nullptr;
    }
    full[at] = args[nargs + k];
  }
  for (std::size_t i = 0; i < required; ++i)
    if (!full[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument %zu", rule->cname, i + 1);
      return nullptr;
    }
  if (rule->lists && (PyList_Check(full[0]) || PyTuple_Check(full[0])))
    return creating_nodes([&] { return PyObject_Vectorcall(rule->lists, full, total, nullptr); });
  const std::size_t operands = rule->family == Family::lookup ? 0 : arity(rule->family);
  return call_rule(rule, full, total, full + operands);
}

bool family_of(const char* name, Family* out) {
  static const std::pair<const char*, Family> families[] = {
      {"unary", Family::unary},   {"vector", Family::vector}, {"reduce", Family::reduce},
      {"binary", Family::binary}, {"matmul", Family::matmul}, {"affine", Family::affine},
      {"list", Family::list},     {"stack", Family::stack},   {"concat", Family::concat},
      {"pick", Family::pick},     {"pick_nls", Family::pick_nls}, {"slice", Family::slice},
      {"lookup", Family::lookup}};
  for (const auto& [n, f] : families)
    if (std::strcmp(n, name) == 0) return *out = f, true;
  return false;
}

PyObject* rule_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"op", "positional", "doc", "lists", nullptr};
  PyObject *op, *alt = Py_None, *doc = Py_None, *lists = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOO:Rule", const_cast<char**>(names), &op,
                                   &alt, &doc, &lists))
    return nullptr;
  PyObject* family_name = PyObject_GetAttrString(op, "rule");
  PyObject* name = family_name ? PyObject_GetAttrString(op, "name") : nullptr;
  PyObject* ragged = name ? PyObject_GetAttrString(op, "ragged") : nullptr;
  PyObject* padded = ragged ? PyObject_GetAttrString(op, "padded") : nullptr;
  Family family;
  const char* fname =
      family_name && PyUnicode_Check(family_name) ? PyUnicode_AsUTF8(family_name) : nullptr;
  const bool ok = padded && PyUnicode_Check(name) && fname && family_of(fname, &family);
  Py_XDECREF(family_name);
  if (!ok) {
    Py_XDECREF(name);
    Py_XDECREF(ragged);
    Py_XDECREF(padded);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Rule: op.rule names no rule family");
    return nullptr;
  }
  Rule* rule = reinterpret_cast<Rule*>(type->tp_alloc(type, 0));
  if (!rule) {
    Py_DECREF(name);
    Py_DECREF(ragged);
    Py_DECREF(padded);
    return nullptr;
  }
  rule->call = rule_vectorcall;
  rule->family = family;
  rule->op = Py_NewRef(op);
  rule->alt_op = Py_NewRef(alt == Py_None ? op : alt);
  rule->code = op_code(op);
  rule->alt = op_code(rule->alt_op);
  rule->name = name;
  rule->doc = Py_NewRef(doc);
  rule->lists = lists == Py_None ? nullptr : Py_NewRef(lists);
  rule->cname = PyUnicode_AsUTF8(name);
  rule->ragged = PyObject_IsTrue(ragged) == 1;
  rule->padded = PyObject_IsTrue(padded) == 1;
  Py_DECREF(ragged);
  Py_DECREF(padded);
  return reinterpret_cast<PyObject*>(rule);
}

void rule_dealloc(PyObject* self) {
  Rule* rule = reinterpret_cast<Rule*>(self);
  Py_XDECREF(rule->op);
  Py_XDECREF(rule->alt_op);
  Py_XDECREF(rule->name);
  Py_XDECREF(rule->doc);
  Py_XDECREF(rule->lists);
  Py_TYPE(self)->tp_free(self);
}

PyObject* rule_repr(PyObject* self) {
  return PyUnicode_FromFormat("<flybatch op %U>", reinterpret_cast<Rule*>(self)->name);
}

PyMemberDef kRuleMembers[] = {
    {"op", T_OBJECT_EX, offsetof(Rule, op), READONLY, "the Op row of ops.py"},
    {"__name__", T_OBJECT_EX, offsetof(Rule, name), READONLY, nullptr},
    {"__doc__", T_OBJECT, offsetof(Rule, doc), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject RuleType = [] {
  PyTypeObject t{};
  t.ob_base.ob_base.ob_refcnt = 1;
  t.tp_name = "flybatch._core.Rule";
  t.tp_basicsize = sizeof(Rule);
  t.tp_dealloc = rule_dealloc;
  t.tp_vectorcall_offset = offsetof(Rule, call);
  t.tp_call = PyVectorcall_Call;
  t.tp_repr = rule_repr;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_doc = "Rule(op, positional=None, doc=None, lists=None): calling it creates a node of\n"
             "`op` (an Op whose `rule` names a family of rules.cpp); `positional`: concat's op\n"
             "for shapes that cannot be stacked; `lists`: the function that a call whose first\n"
             "operand is a list or tuple (of scalars) goes to, with the same arguments.";
  t.tp_members = kRuleMembers;
  t.tp_new = rule_new;
  return t;
}();

// ---- the Expression operators ------------------------------------------------------------------
// Whether `x` is an expression whose value is not of its graph's floating dtype (an index, a
// mask, a float32 cast in a float64 graph): Graph.node_dtypes holds only such nodes.
bool of_other_dtype(PyObject* x) {
  if (!is_expression(x)) return false;
  Expression* e = as_expression(x);
  return flybatch::of_other_dtype(e->graph, expression_node(e));
}

// Whether `x` has more than two dims: `a @ b` of such operands is torch.matmul's broadcast
// batched product (attention heads' `q @ k.transpose(-2, -1)`), not the fb op's vector and
// matrix product.
bool beyond_matrices(PyObject* x) {
  std::size_t nd = 0;
  if (is_expression(x)) {
    const Expression* e = as_expression(x);
    shape_dims(e->graph, expression_shape_id(e), &nd);
  } else if (PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(g_tensor_type))) {
    PyObject* ndim = PyObject_GetAttrString(x, "ndim");
    if (!ndim) throw PythonError{};
    nd = static_cast<std::size_t>(PyLong_AsSsize_t(ndim));
    Py_DECREF(ndim);
  }
  return nd > 2;
}

PyObject* operator_rule(Operator which, PyObject* a, PyObject* b) {
  PyObject* rule = g_rules[which];
  if (!rule) Py_RETURN_NOTIMPLEMENTED;
  // The fb ops compute in the graph's dtype; an operand of another dtype follows torch's type
  // promotion instead (`mask.long() + 1` is an integer, `h.float() * 3` a float32), and a
  // product of operands beyond matrices is torch's batched matmul, and so is a product inside
  // a torch.autocast region, where the capture refuses it (eagerly it would compute in the
  // region's lower precision): each is recorded as the Tensor operator it is, by the capture
  // layer (`ops._tensor_operator`).
  try {
    if (of_other_dtype(a) || (b && of_other_dtype(b)) ||
        (which == kMatmul && (beyond_matrices(a) || beyond_matrices(b) || autocast_enabled())))
      return PyObject_CallMethod(g_ops_module, "_tensor_operator", "iOO", static_cast<int>(which),
                                 a, b ? b : Py_None);
  } catch (const PythonError&) {
    return nullptr;
  }
  PyObject* operands[2] = {a, b};
  return call_rule(reinterpret_cast<Rule*>(rule), operands, 2, nullptr);
}

// Python's `sum(losses)`, or `total = total + loss` in a loop, is a chain of scalar adds: each
// waits for the one before, one launch per term, however many instances. So a scalar `a + b`
// whose `a` is itself a pending scalar sum (an add, or an esum made here) of the same grad mode
// becomes ONE esum of a's terms and b: the partial sums no longer wait for each other and all
// batch into one launch (esum batches any number of terms), with the same gradients and, as
// the terms are added in order, the same values. Up to kMaxFlatTerms terms: a longer chain
// anchors its next esum at a sum of that many (its cost grows as terms x chain length).
constexpr Py_ssize_t kMaxFlatTerms = 64;

Rule* esum_rule() {
  static PyObject* esum = nullptr;  // ops.esum, kept for the process
  if (!esum) esum = PyObject_GetAttrString(g_ops_module, "esum");
  if (!esum) throw PythonError{};
  return reinterpret_cast<Rule*>(esum);
}

// The terms of a flattened `a + b`, or NULL (no error set) when the rule does not apply.
PyObject* flat_sum_terms(PyObject* a, PyObject* b) {
  if (!g_rules[kAdd] || !is_expression(a) || !is_expression(b)) return nullptr;
  Expression* ea = as_expression(a);
  Expression* eb = as_expression(b);
  Store* g = ea->graph;
  if (eb->graph != g || g->closed || ea->view >= 0 || ea->id < g->n_done)
    return nullptr;  // computed: no gain (a view: not the node's own terms)
  Columns& c = *g->nodes;
  std::size_t nd_a, nd_b;
  shape_dims(g, c.shape[ea->id], &nd_a);
  shape_dims(g, c.shape[eb->id], &nd_b);
  if (nd_a || nd_b) return nullptr;  // scalars only: a vector chain's terms would be re-added
  const std::int32_t op = c.op[ea->id];
  if (op != reinterpret_cast<Rule*>(g_rules[kAdd])->code && op != esum_rule()->code)
    return nullptr;
  // a's terms must get the gradient that a would pass on: not if a was written under no_grad
  // and this add is not.
  if (c.no_grad[ea->id] != !grad_enabled()) return nullptr;
  const i64 first = c.arg_ptr[ea->id], last = c.arg_ptr[ea->id + 1];
  if (last - first + 1 > kMaxFlatTerms) return nullptr;
  Owned terms{PyList_New(0)};
  for (i64 k = first; k < last; ++k) {
    Owned term{new_expression(g, c.arg_flat[k])};
    if (PyList_Append(terms.get(), term.get()) < 0) throw PythonError{};
  }
  if (PyList_Append(terms.get(), b) < 0) throw PythonError{};
  return terms.release();
}

PyObject* expr_add(PyObject* a, PyObject* b) {
  try {
    if (PyObject* terms = flat_sum_terms(a, b)) {
      Owned held{terms};
      return call_rule(esum_rule(), &terms, 1, nullptr);
    }
  } catch (const PythonError&) {
    return nullptr;
  }
  return operator_rule(kAdd, a, b);
}
PyObject* expr_sub(PyObject* a, PyObject* b) { return operator_rule(kSub, a, b); }
PyObject* expr_mul(PyObject* a, PyObject* b) { return operator_rule(kMul, a, b); }
PyObject* expr_div(PyObject* a, PyObject* b) { return operator_rule(kDiv, a, b); }
PyObject* expr_matmul(PyObject* a, PyObject* b) { return operator_rule(kMatmul, a, b); }
PyObject* expr_neg(PyObject* a) { return operator_rule(kNeg, a, nullptr); }

// Any other index (a tuple, None, ..., a step, a tensor) goes to `flybatch.ops._getitem`, the
// torch-semantics indexing of the capture layer (flybatch/capture/indexing.py), set when it is
// imported.
PyObject* getitem_fallback(PyObject* x, PyObject* index) {
  PyObject* fallback = PyObject_GetAttrString(g_ops_module, "_getitem");
  if (!fallback) {
    PyErr_Clear();
    PyErr_Format(PyExc_IndexError, "unsupported index %R: use an int or a slice", index);
    return nullptr;
  }
  PyObject* out = PyObject_CallFunctionObjArgs(fallback, x, index, nullptr);
  Py_DECREF(fallback);
  return out;
}

// x[i] picks, x[a:b] slices (step 1) in C, the common cases of per-instance code. The fb ops
// compute in the graph's dtype: an expression of another (topk's indices) is indexed as the
// Tensor it stands for, by the fallback.
PyObject* expr_getitem(PyObject* x, PyObject* index) {
  if (PyObject* view = view_getitem(x, index)) return view;  // (a view's row: no node)
  if (PyErr_Occurred()) return nullptr;
  try {
    if (of_other_dtype(x)) return getitem_fallback(x, index);
  } catch (const PythonError&) {
    return nullptr;
  }
  if (PySlice_Check(index)) {
    PySliceObject* s = reinterpret_cast<PySliceObject*>(index);
    if (s->step != Py_None) {
      PyObject* one = PyLong_FromLong(1);
      const int is_one = one ? PyObject_RichCompareBool(s->step, one, Py_EQ) : -1;
      Py_XDECREF(one);
      if (is_one < 0) return nullptr;
      if (!is_one) return getitem_fallback(x, index);
    }
    Expression* e = as_expression(x);
    std::size_t nd;
    const i64* d = shape_dims(e->graph, expression_shape_id(e), &nd);
    PyObject* start = s->start == Py_None ? PyLong_FromLong(0) : Py_NewRef(s->start);
    PyObject* stop = s->stop == Py_None ? PyLong_FromLongLong(nd ? d[0] : 0) : Py_NewRef(s->stop);
    PyObject* out = nullptr;
    if (start && stop) out = slice_rows(x, start, stop);
    Py_XDECREF(start);
    Py_XDECREF(stop);
    return out;
  }
  // ints, numpy integers and bools (which pick rejects: x[True] is not x[1]); a tensor or an
  // expression (which have __index__ too: a mask, an index computed per instance) indexes as
  // in torch, through the fallback
  int is_index = PyIndex_Check(index) &&
                 !PyObject_TypeCheck(index, reinterpret_cast<PyTypeObject*>(g_tensor_type)) &&
                 !is_expression(index);
  if (!is_index) {
    PyObject* types = PyObject_GetAttrString(g_ops_module, "_INDEX_TYPES");
    is_index = types ? PyObject_IsInstance(index, types) : -1;
    Py_XDECREF(types);
    if (is_index < 0) return nullptr;
  }
  if (is_index) {
    PyObject* argv[2] = {x, index};
    return call_rule(reinterpret_cast<Rule*>(g_rules[kPick]), argv, 2, argv + 1);
  }
  return getitem_fallback(x, index);
}

const char kOperatorsDoc[] =
    "set_operators(add, sub, mul, div, matmul, neg, pick, slice)\n\n"
    "The rules behind the Expression operators + - * / @, unary -, x[i] and x[a:b].";

PyObject* set_operators(PyObject*, PyObject* args) {
  PyObject* rules[8];
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!:set_operators", &RuleType, &rules[0], &RuleType,
                        &rules[1], &RuleType, &rules[2], &RuleType, &rules[3], &RuleType, &rules[4],
                        &RuleType, &rules[5], &RuleType, &rules[6], &RuleType, &rules[7]))
    return nullptr;
  PyObject* ops = PyImport_ImportModule("flybatch.ops");
  if (!ops) return nullptr;
  Py_XSETREF(g_ops_module, ops);
  for (int i = 0; i < 8; ++i) Py_XSETREF(g_rules[i], Py_NewRef(rules[i]));
  Py_RETURN_NONE;
}

PyMethodDef kRuleFunctions[] = {
    {"set_operators", set_operators, METH_VARARGS, kOperatorsDoc},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// An operand's node for the capture layer (capture.cpp), resolved as the rules resolve theirs.
i64 operand_node(Store* g, PyObject* x) { return node_of(g, x); }

PyObject* slice_rows(PyObject* x, PyObject* start, PyObject* stop) {
  PyObject* argv[3] = {x, start, stop};
  return call_rule(reinterpret_cast<Rule*>(g_rules[kSlice]), argv, 3, argv + 1);
}

PyNumberMethods expression_number = [] {
  PyNumberMethods m{};
  m.nb_add = expr_add;
  m.nb_subtract = expr_sub;
  m.nb_multiply = expr_mul;
  m.nb_true_divide = expr_div;
  m.nb_matrix_multiply = expr_matmul;
  m.nb_negative = expr_neg;
  return m;
}();

PyMappingMethods expression_mapping = [] {
  PyMappingMethods m{};
  m.mp_subscript = expr_getitem;
  return m;
}();

bool register_rules(PyObject* module) {
  s_operand = PyUnicode_InternFromString("_operand");
  s_lookup_tag = PyUnicode_InternFromString("_lookup_tag");
  s_requires_grad = PyUnicode_InternFromString("requires_grad");
  s_shape = PyUnicode_InternFromString("shape");
  return s_operand && s_lookup_tag && s_requires_grad && s_shape && PyType_Ready(&RuleType) == 0 &&
         PyModule_AddObjectRef(module, "Rule", reinterpret_cast<PyObject*>(&RuleType)) == 0 &&
         PyModule_AddFunctions(module, kRuleFunctions) == 0;
}

}  // namespace flybatch
