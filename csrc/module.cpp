// flybatch._core: the Python bindings of the compiled core, and nothing else. Each stage's
// algorithms live in their own file (schedule.cpp, execute.cpp) over plain arrays; a binding
// reads the Python arguments, calls the stage and translates errors. To add a stage: write
// <stage>.cpp/.h, wrap its functions below like py_schedule, and list them in kMethods
// (setup.py compiles every csrc/*.cpp).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "execute.h"
#include "schedule.h"
#include "store.h"

namespace {

using flybatch::i64;

using flybatch::guarded;
using flybatch::PythonError;

[[noreturn]] void fail(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw PythonError{};
}

// Items begin..end-1 of a list of ints (a hand-made DAG, forward_ends), minus `shift`, into
// `out`: about 10x faster than numpy converting the same list.
void read_ints(PyObject* list, const char* name, i64 begin, i64 end, i64* out, i64 shift = 0) {
  if (!PyList_Check(list)) fail(PyExc_TypeError, std::string(name) + " must be a list of ints");
  if (begin < 0 || end > PyList_GET_SIZE(list))
    fail(PyExc_ValueError, std::string(name) + " has " + std::to_string(PyList_GET_SIZE(list)) +
                               " items; items " + std::to_string(begin) + ".." +
                               std::to_string(end - 1) + " were asked for");
  for (i64 i = begin; i < end; ++i) {
    const long long x = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (x == -1 && PyErr_Occurred()) throw PythonError{};
    out[i - begin] = x - shift;
  }
}

// Offsets of the inputs of nodes begin..end-1 (arg_end: where each node's inputs end) relative to their first input,
// into out[0..n]; returns the global offset of that first input.
i64 read_arg_ptr(PyObject* arg_end, i64 begin, i64 end, i64* out) {
  i64 first = 0;
  if (begin > 0) read_ints(arg_end, "arg_end", begin - 1, begin, &first);
  out[0] = 0;
  read_ints(arg_end, "arg_end", begin, end, out + 1, first);
  return first;
}

// A C-contiguous int64 buffer (a numpy array) of at least `size` items, writable unless
// `read_only`, held for the duration of a call.
class Int64Buffer {
 public:
  Int64Buffer(PyObject* obj, const char* name, i64 size, bool read_only = false) {
    const int access = read_only ? 0 : PyBUF_WRITABLE;
    if (PyObject_GetBuffer(obj, &view_, access | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
      throw PythonError{};
    const std::string format = view_.format ? view_.format : "B";
    const bool int64 =
        view_.itemsize == 8 && !format.empty() && (format.back() == 'l' || format.back() == 'q');
    if (!int64 || view_.len / 8 < size) {
      PyBuffer_Release(&view_);
      fail(PyExc_ValueError, std::string(name) + " must be an int64 array of at least " +
                                 std::to_string(size) + " items");
    }
  }
  ~Int64Buffer() { PyBuffer_Release(&view_); }
  i64 size() const { return view_.len / 8; }
  Int64Buffer(const Int64Buffer&) = delete;
  Int64Buffer& operator=(const Int64Buffer&) = delete;

  i64* data() const { return static_cast<i64*>(view_.buf); }

 private:
  Py_buffer view_{};
};

// `leaf` and `cheap` of the ops of a list (one per node), read once per distinct op object.
// The truth of an Op's flag attribute (`leaf`, `cheap`), read once per op per call.
bool op_flag(PyObject* op, const char* name) {
  PyObject* value = PyObject_GetAttrString(op, name);
  if (!value) throw PythonError{};
  const int truth = PyObject_IsTrue(value);
  Py_DECREF(value);
  if (truth < 0) throw PythonError{};
  return truth;
}

// An Op's int attribute (`stack_from`, `fixed`), 0 when it is None or the op has none.
i64 op_int(PyObject* op, const char* name) {
  PyObject* value = PyObject_GetAttrString(op, name);
  if (!value) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw PythonError{};
    PyErr_Clear();
    return 0;
  }
  const i64 number = value == Py_None ? 0 : PyLong_AsLongLong(value);
  Py_DECREF(value);
  if (number == -1 && PyErr_Occurred()) throw PythonError{};
  return number;
}

class OpTable {
 public:
  explicit OpTable(PyObject* ops) : ops_(ops) {
    if (!PyList_Check(ops)) fail(PyExc_TypeError, "ops must be a list of Op");
  }
  ~OpTable() {
    for (auto& [op, flags] : seen_) Py_DECREF(op);
  }
  OpTable(const OpTable&) = delete;
  OpTable& operator=(const OpTable&) = delete;

  flybatch::OpFlags operator()(i64 node) {
    if (node >= PyList_GET_SIZE(ops_)) fail(PyExc_IndexError, "ops is shorter than the graph");
    PyObject* op = PyList_GET_ITEM(ops_, node);
    const auto found = seen_.find(op);
    if (found != seen_.end()) return found->second;
    const flybatch::OpFlags flags{op_flag(op, "leaf"), op_flag(op, "cheap")};
    Py_INCREF(op);  // the key must outlive this call even if the list changes
    seen_.emplace(op, flags);
    return flags;
  }

 private:
  PyObject* ops_;
  std::unordered_map<PyObject*, flybatch::OpFlags> seen_;
};

// What the stages need to know of an op code's op (a row of ops.py's op table), read from the
// op once per process: ops are frozen module constants that the store holds for good.
struct OpTraits {
  flybatch::OpFlags flags;          // scheduling
  flybatch::ArgumentLayout layout;  // read planning
};

// The traits of every op code so far, read from the ops that were registered since last asked.
const std::vector<OpTraits>& op_traits() {
  static std::vector<OpTraits> known;
  while (known.size() < flybatch::op_count()) {
    PyObject* op = flybatch::op_object(static_cast<std::int32_t>(known.size()));
    OpTraits traits;
    traits.flags = {op_flag(op, "leaf"), op_flag(op, "cheap")};
    traits.layout.leaf = traits.flags.leaf;
    traits.layout.ragged = op_flag(op, "ragged");
    traits.layout.fixed = op_int(op, "fixed");  // ops.RaggedOp's; plain ops have none
    traits.layout.stack_from = op_int(op, "stack_from");
    traits.layout.padded = op_flag(op, "padded");
    traits.layout.result_length = op_flag(op, "result_length");
    known.push_back(traits);
  }
  return known;
}

// A count of nodes that the core's 32-bit local ids can hold.
flybatch::Local node_count(i64 begin, i64 end) {
  if (begin < 0 || end < begin) fail(PyExc_ValueError, "need 0 <= start <= end");
  if (end - begin >= INT32_MAX) fail(PyExc_OverflowError, "2^31 nodes or more in one forward");
  return static_cast<flybatch::Local>(end - begin);
}

// Nodes begin..end-1 of a DAG given as lists (sigs; arg_end and arg_flat, the inputs in CSR
// form), as the core reads them; for tests of the core on small hand-made DAGs. Graphs are read
// in place (GraphSlice).
class ListSlice {
 public:
  ListSlice(PyObject* sigs, PyObject* arg_end, PyObject* arg_flat, i64 begin, i64 end) {
    nodes.start = begin;
    nodes.n = node_count(begin, end);
    sig_.resize(nodes.n);
    read_ints(sigs, "sigs", begin, end, sig_.data());
    nodes.sig = sig_.data();
    ptr_.resize(nodes.n + 1);
    const i64 first = read_arg_ptr(arg_end, begin, end, ptr_.data());
    if (ptr_[nodes.n] < 0) fail(PyExc_ValueError, "arg_end must not decrease");
    flat_.resize(ptr_[nodes.n]);
    read_ints(arg_flat, "arg_flat", first, first + ptr_[nodes.n], flat_.data());
    nodes.arg_ptr = ptr_.data();
    nodes.arg_flat = flat_.data();
    flybatch::check_nodes(nodes);
  }

  flybatch::Nodes nodes;

 private:
  std::vector<i64> sig_, ptr_, flat_;
};

// The scheduling view of a graph's nodes begin..end-1, read in place from its columns (no
// copy): signatures, depths (when asked for) and the inputs as global offsets into the arg_flat
// column. Op flags come from the op column through the (leaf, cheap) of each op code.
class GraphSlice {
 public:
  GraphSlice(PyObject* graph, i64 begin, i64 end, bool with_depth = false) {
    if (!PyObject_TypeCheck(graph, &flybatch::StoreType))
      fail(PyExc_TypeError, "graph must be a flybatch Graph (a _core.Store)");
    store_ = reinterpret_cast<flybatch::Store*>(graph);
    const flybatch::Columns& c = *store_->nodes;
    if (end > flybatch::n_nodes(store_))
      fail(PyExc_ValueError, "the graph has " + std::to_string(flybatch::n_nodes(store_)) +
                                 " nodes; nodes up to " + std::to_string(end - 1) +
                                 " were asked for");
    nodes.start = begin;
    nodes.n = node_count(begin, end);
    nodes.sig = c.sig.data() + begin;
    if (with_depth) nodes.depth = c.depth.data() + begin;  // the strategies read it
    nodes.arg_ptr = c.arg_ptr.size() ? c.arg_ptr.data() + begin : kNoInputs;
    nodes.arg_flat = c.arg_flat.data();
    flybatch::check_nodes(nodes);
    for (const OpTraits& traits : op_traits()) flags_.push_back(traits.flags);
  }

  flybatch::OpFlags operator()(i64 node) const { return flags_[store_->nodes->op[node]]; }
  flybatch::Columns& columns() const { return *store_->nodes; }

  // The store's node_batch column, which must have room for nodes up to `end` - 1.
  std::int32_t* node_batch(i64 end) const {
    if (columns().batch.size() < end)
      fail(PyExc_ValueError, "the graph's positions have room for " +
                                 std::to_string(columns().batch.size()) + " nodes; call "
                                 "graph.grow_positions(" + std::to_string(end) + ") first");
    return columns().batch.data();
  }

  flybatch::Nodes nodes;

 private:
  static constexpr i64 kNoInputs[1] = {0};  // arg_ptr of an empty store

  flybatch::Store* store_;
  std::vector<flybatch::OpFlags> flags_;
};

// The nodes and op flags of a scheduling call: a graph's columns read in place, or (for tests
// of the core on small hand-made DAGs) lists of ints and a list of ops.
class Source {
 public:
  Source(PyObject* graph, PyObject* sigs, PyObject* arg_end, PyObject* arg_flat, PyObject* ops,
         i64 begin, i64 end) {
    if (graph && graph != Py_None) {
      graph_.emplace(graph, begin, end);
      return;
    }
    if (!sigs || !arg_end || !arg_flat || !ops)
      fail(PyExc_TypeError, "pass graph=, or sigs=, arg_end=, arg_flat= and ops=");
    slice_.emplace(sigs, arg_end, arg_flat, begin, end);
    table_.emplace(ops);
  }

  const flybatch::Nodes& nodes() const { return graph_ ? graph_->nodes : slice_->nodes; }
  flybatch::OpFlags operator()(i64 node) { return graph_ ? (*graph_)(node) : (*table_)(node); }

 private:
  std::optional<GraphSlice> graph_;
  std::optional<ListSlice> slice_;
  std::optional<OpTable> table_;
};

// graph.forward_ends as the core's forwards: those that ended within the first n nodes, then
// the rest.
std::vector<i64> forward_cuts(PyObject* forward_ends, i64 n) {
  if (!PyList_Check(forward_ends)) fail(PyExc_TypeError, "forward_ends must be a list of ints");
  std::vector<i64> ends(PyList_GET_SIZE(forward_ends));
  read_ints(forward_ends, "forward_ends", 0, static_cast<i64>(ends.size()), ends.data());
  std::vector<i64> cuts;
  for (std::size_t i = 0; i < ends.size(); ++i) {
    if (ends[i] <= (i ? ends[i - 1] : 0)) fail(PyExc_ValueError, "forward_ends must ascend");
    if (ends[i] < n) cuts.push_back(ends[i]);
  }
  if (n > 0) cuts.push_back(n);
  return cuts;
}

flybatch::Strategy strategy_of(const std::string& name) {
  if (name == "none") return flybatch::Strategy::none;
  if (name == "depth") return flybatch::Strategy::depth;
  if (name == "agenda") return flybatch::Strategy::agenda;
  if (name == "auto") return flybatch::Strategy::automatic;
  fail(PyExc_ValueError, "unknown strategy " + name);
}

const char kScheduleDoc[] =
    "schedule(strategy, graph, start, end, first_batch, order_out, ends_out) -> int\n\n"
    "Batch the graph's nodes start..end-1 ('none', 'depth', 'agenda' or 'auto'), reading its\n"
    "columns in place. first_batch: the graph's batch count so far (its batch_sizes column).\n"
    "Writes each node's (batch, row) into the graph's node_batch/node_row columns (grown to\n"
    "end first: grow_positions), appends each new batch's size to batch_sizes, and writes the\n"
    "node ids of the batches, in batch and row order, into order_out, with the end of each\n"
    "batch in ends_out.\n"
    "Returns the number of batches.";

PyObject* py_schedule(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"strategy",    "graph",     "start",    "end",
                                "first_batch", "order_out", "ends_out", nullptr};
  const char* strategy_name;
  long long start, end, first_batch;
  PyObject *graph, *order_out, *ends_out;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOLLLOO:schedule", const_cast<char**>(names),
                                   &strategy_name, &graph, &start, &end, &first_batch,
                                   &order_out, &ends_out))
    return nullptr;
  return guarded([&]() -> PyObject* {
    const flybatch::Strategy strategy = strategy_of(strategy_name);
    const GraphSlice store(graph, start, end, /*with_depth=*/true);
    const flybatch::Nodes& nodes = store.nodes;
    flybatch::Columns& columns = store.columns();
    if (first_batch != columns.batch_size.size())
      fail(PyExc_ValueError, "first_batch is " + std::to_string(first_batch) + " but the graph "
                             "has " + std::to_string(columns.batch_size.size()) + " batches");
    Int64Buffer order(order_out, "order_out", nodes.n), ends(ends_out, "ends_out", nodes.n);
    flybatch::Placement out;
    out.node_batch = store.node_batch(end);
    out.node_row = columns.row.data();
    out.first_batch = first_batch;
    out.order = order.data();
    out.ends = ends.data();
    const i64 batches =
        flybatch::schedule(strategy, nodes, [&](i64 node) { return store(node); }, out);
    for (i64 b = 0; b < batches; ++b)
      columns.batch_size.push(static_cast<std::int32_t>(out.ends[b] - (b ? out.ends[b - 1] : 0)));
    return PyLong_FromLongLong(batches);
  });
}

const char kLowerBoundDoc[] =
    "lower_bound(n, forward_ends, graph=None, tight=False, *, sigs, arg_end, arg_flat, ops,\n"
    "            pairs_only=False)\n"
    "    -> int\n\n"
    "Launches no schedule of the graph's first n nodes (its columns, read in place; or the\n"
    "lists sigs, arg_end, arg_flat, ops of a hand-made DAG) can beat: in each forward (forward_ends:\n"
    "where each ended; nodes after the last are one more), for each signature the most nodes of\n"
    "it on one dependency path, summed. With tight, that plus what blocks of two or three\n"
    "signatures that interleave differently on different paths must add (csrc/schedule.cpp,\n"
    "tight_bound_of); with pairs_only too, the pair bound alone (the earlier tight bound).";

PyObject* py_lower_bound(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"n",   "forward_ends", "graph", "tight", "sigs", "arg_end",
                                "arg_flat", "ops", "pairs_only", nullptr};
  long long n;
  PyObject *forward_ends, *graph = nullptr, *sigs = nullptr, *arg_end = nullptr,
                          *arg_flat = nullptr, *ops = nullptr;
  int tight = 0, pairs_only = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LO|Op$OOOOp:lower_bound",
                                   const_cast<char**>(names), &n, &forward_ends, &graph, &tight,
                                   &sigs, &arg_end, &arg_flat, &ops, &pairs_only))
    return nullptr;
  return guarded([&]() -> PyObject* {
    Source source(graph, sigs, arg_end, arg_flat, ops, 0, n);
    const std::vector<i64> cuts = forward_cuts(forward_ends, n);
    const auto flags_of = [&](i64 node) { return source(node); };
    return PyLong_FromLongLong(
        tight ? flybatch::tight_bound(source.nodes(), cuts, flags_of, pairs_only != 0)
              : flybatch::lower_bound(source.nodes(), cuts, flags_of));
  });
}

const char kSplitsDoc[] =
    "signature_splits(n, graph, forward_ends)\n"
    "    -> dict[int, tuple[int, dict[int, int]]]\n\n"
    "Per signature of the store's first n nodes that launches a kernel: its lower bound (summed\n"
    "over forwards) and what its nodes that missed their (signature, rank) group's first launch\n"
    "waited on: input signature -> inputs computed at or after that launch (by where the\n"
    "schedule put each node: the graph's node_batch column).";

PyObject* py_signature_splits(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"n", "graph", "forward_ends", nullptr};
  long long n;
  PyObject *graph, *forward_ends;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LOO:signature_splits",
                                   const_cast<char**>(names), &n, &graph, &forward_ends))
    return nullptr;
  return guarded([&]() -> PyObject* {
    const GraphSlice store(graph, 0, n);
    const std::vector<i64> cuts = forward_cuts(forward_ends, n);
    const std::vector<flybatch::SignatureSplit> splits = flybatch::signature_splits(
        store.nodes, cuts, [&](i64 node) { return store(node); }, store.node_batch(n));
    PyObject* out = PyDict_New();
    if (!out) throw PythonError{};
    for (const flybatch::SignatureSplit& split : splits) {
      if (split.bound == 0) continue;  // leaves
      PyObject* waited = PyDict_New();
      bool ok = waited != nullptr;
      for (auto it = split.waited_on.begin(); ok && it != split.waited_on.end(); ++it) {
        PyObject *key = PyLong_FromLongLong(it->first), *count = PyLong_FromLongLong(it->second);
        ok = key && count && PyDict_SetItem(waited, key, count) == 0;
        Py_XDECREF(key);
        Py_XDECREF(count);
      }
      PyObject *sig = ok ? PyLong_FromLongLong(split.sig) : nullptr,
               *value = ok ? Py_BuildValue("(LO)", split.bound, waited) : nullptr;
      ok = sig && value && PyDict_SetItem(out, sig, value) == 0;
      Py_XDECREF(sig);
      Py_XDECREF(value);
      Py_XDECREF(waited);
      if (!ok) {
        Py_DECREF(out);
        throw PythonError{};
      }
    }
    return out;
  });
}

const char kRanksDoc[] =
    "signature_ranks(start, end, graph) -> list[int]\n\n"
    "For each of the store's nodes start..end-1 (one forward), the most nodes of its signature\n"
    "on any path of that forward ending at it; leaves (no launch) get 0. The agenda runs each\n"
    "(signature, rank) group as one batch; the lower bound sums each signature's highest rank.";

PyObject* py_signature_ranks(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"start", "end", "graph", nullptr};
  long long start, end;
  PyObject* graph;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLO:signature_ranks",
                                   const_cast<char**>(names), &start, &end, &graph))
    return nullptr;
  return guarded([&]() -> PyObject* {
    // With depths, as scheduling reads it (a signature whose nodes share one depth ranks 1 and
    // needs no counts): the tests hold this path to the definition.
    const GraphSlice store(graph, start, end, /*with_depth=*/true);
    const std::vector<std::int32_t> ranks =
        flybatch::signature_ranks(store.nodes, [&](i64 node) { return store(node); });
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(ranks.size()));
    if (!list) throw PythonError{};
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      PyObject* rank = PyLong_FromLong(ranks[i]);
      if (!rank) {
        Py_DECREF(list);
        throw PythonError{};
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), rank);
    }
    return list;
  });
}

// ---- the execution stage -----------------------------------------------------------------------

using flybatch::checked;
using flybatch::Owned;

PyObject* int_tuple(const i64* items, std::size_t n) {
  Owned tuple(PyTuple_New(static_cast<Py_ssize_t>(n)));
  for (std::size_t i = 0; i < n; ++i)
    PyTuple_SET_ITEM(tuple.get(), i, checked(PyLong_FromLongLong(items[i])));
  return tuple.release();
}

PyObject* int_tuple(const std::vector<i64>& items) { return int_tuple(items.data(), items.size()); }

// The interned names of the read kinds (execution.py compares them).
PyObject* kind_name(flybatch::ReadKind kind) {
  static PyObject* names[3] = {PyUnicode_InternFromString("view"),
                               PyUnicode_InternFromString("rows"),
                               PyUnicode_InternFromString("multi")};
  PyObject* name = names[static_cast<int>(kind)];
  if (!name) throw PythonError{};
  return Py_NewRef(name);
}

PyObject* read_tuple(const flybatch::Read& r, const flybatch::ReadPlan& plan) {
  if (r.kind != flybatch::ReadKind::multi)
    return checked(Py_BuildValue("(NLLL)", kind_name(r.kind), r.source, r.start, r.length));
  Owned parts(int_tuple(plan.parts.data() + r.start, static_cast<std::size_t>(r.length)));
  Owned inverse(r.inverse < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(r.inverse));
  Owned whole(r.whole < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(r.whole));
  return checked(Py_BuildValue("(NOOLO)", kind_name(r.kind), parts.get(), inverse.get(), r.rows,
                               whole.get()));
}

// Per batch, what its launch needs to know of its first node (kPlanReadsDoc): one tuple per
// batch, made here, instead of five calls into the store per launch.
PyObject* batch_heads(const flybatch::Store* store, const flybatch::ScheduledForward& forward) {
  const flybatch::Columns& c = *store->nodes;
  Owned heads(PyList_New(static_cast<Py_ssize_t>(forward.batches)));
  for (i64 b = 0; b < forward.batches; ++b) {
    const i64 first = forward.order[b == 0 ? 0 : forward.ends[b - 1]];
    PyObject* attr = (*store->attrs)[first];
    PyList_SET_ITEM(heads.get(), b,
                    checked(Py_BuildValue("(LOLOOO)", first,
                                          flybatch::op_object(c.op.data()[first]),
                                          c.sig.data()[first], attr ? attr : Py_None,
                                          (*store->shape_tuples)[c.shape.data()[first]],
                                          c.no_grad.data()[first] ? Py_True : Py_False)));
  }
  return heads.release();
}

// (reads, batch_reads, fan_outs, indices, readers, earlier): the ReadPlan as Python data (see
// kPlanReadsDoc).
PyObject* plan_to_python(const flybatch::ReadPlan& plan) {
  Owned reads(PyList_New(static_cast<Py_ssize_t>(plan.reads.size())));
  for (std::size_t k = 0; k < plan.reads.size(); ++k)
    PyList_SET_ITEM(reads.get(), k, read_tuple(plan.reads[k], plan));
  Owned batches(PyList_New(static_cast<Py_ssize_t>(plan.batches.size())));
  for (std::size_t b = 0; b < plan.batches.size(); ++b) {
    const flybatch::BatchReads& batch = plan.batches[b];
    Owned args(int_tuple(plan.args.data() + batch.begin,
                         static_cast<std::size_t>(batch.end - batch.begin)));
    Owned arities(batch.arities < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(batch.arities));
    Owned lengths(batch.lengths < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(batch.lengths));
    PyList_SET_ITEM(batches.get(), b,
                    checked(Py_BuildValue("(OLOLOO)", args.get(), batch.stacked, arities.get(),
                                          batch.widths, lengths.get(),
                                          batch.uneven ? Py_True : Py_False)));
  }
  Owned fan_outs(PyDict_New());
  for (const flybatch::FanOut& fan : plan.fan_outs) {
    Owned source(PyLong_FromLongLong(fan.source));
    Owned reads_of(int_tuple(fan.reads)), sizes(int_tuple(fan.sizes));
    Owned piece(int_tuple(fan.piece));
    Owned gather(fan.gather < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(fan.gather));
    Owned value(PyTuple_Pack(4, reads_of.get(), gather.get(), sizes.get(), piece.get()));
    if (PyDict_SetItem(fan_outs.get(), source.get(), value.get()) < 0) throw PythonError{};
  }
  Owned indices(PyByteArray_FromStringAndSize(
      reinterpret_cast<const char*>(plan.indices.data()),
      static_cast<Py_ssize_t>(plan.indices.size() * sizeof(i64))));
  Owned readers(int_tuple(plan.readers)), earlier(int_tuple(plan.earlier_partial));
  return checked(PyTuple_Pack(6, reads.get(), batches.get(), fan_outs.get(), indices.get(),
                              readers.get(), earlier.get()));
}

const char kPlanReadsDoc[] =
    "plan_reads(graph, first_batch, order, ends)\n"
    "    -> (reads, batch_reads, fan_outs, indices, heads, readers, earlier)\n\n"
    "How each batch of a scheduled forward reads its arguments (csrc/execute.h). order, ends:\n"
    "the forward's node ids batch after batch and where each batch ends (int64 arrays);\n"
    "first_batch: the global index of its first batch. The graph's columns (inputs, node_batch,\n"
    "node_row, batch_sizes) are read in place. Returns\n"
    "  reads: per read, ('view', source, start, length) | ('rows', source, at, length) |\n"
    "         ('multi', part read ids, inverse at or None, rows, whole at or None);\n"
    "  batch_reads: per batch, (read ids of its arguments, stacked arity or 0, arities at or\n"
    "         None for a ragged op, widths at, lengths at or None: a padded op's nodes whose\n"
    "         first arguments differ in length, whether its nodes' shapes differ);\n"
    "  fan_outs: source -> (read ids, gather at or None, sizes, piece of each read): the\n"
    "         result (or one gather of the rows listed from `gather` on) split into `sizes`;\n"
    "  indices: the int64 row numbers, permutations, arities, widths and lengths that an `at`\n"
    "         points into;\n"
    "  heads: per batch, (its first node, that node's op, signature, attr, shape, and whether\n"
    "         it was written under no_grad): what its launch needs, in one tuple;\n"
    "  readers: per batch, how many view and rows reads read its result (a multi read through\n"
    "         its parts);\n"
    "  earlier: the ids of the view and rows reads of an earlier forward's result (a batch\n"
    "         before first_batch) that do not read all of it, ascending.";

PyObject* py_plan_reads(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"graph", "first_batch", "order", "ends", nullptr};
  PyObject *graph, *order_in, *ends_in;
  long long first_batch;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLOO:plan_reads", const_cast<char**>(names),
                                   &graph, &first_batch, &order_in, &ends_in))
    return nullptr;
  return guarded([&]() -> PyObject* {
    if (!PyObject_TypeCheck(graph, &flybatch::StoreType))
      fail(PyExc_TypeError, "graph must be a flybatch Graph (a _core.Store)");
    const flybatch::Store* store = reinterpret_cast<flybatch::Store*>(graph);
    const flybatch::Columns& c = *store->nodes;
    const Int64Buffer order(order_in, "order", 0, /*read_only=*/true);
    const Int64Buffer ends(ends_in, "ends", 0, /*read_only=*/true);
    flybatch::ScheduledForward forward;
    forward.first_batch = first_batch;
    forward.order = order.data();
    forward.ends = ends.data();
    forward.batches = ends.size();
    // The planner trusts these: each batch a non-empty run of placed nodes of this graph.
    const i64 placed = std::min<i64>(c.batch.size(), flybatch::n_nodes(store));
    i64 previous = 0;
    for (i64 b = 0; b < forward.batches; ++b) {
      if (ends.data()[b] <= previous || ends.data()[b] > order.size())
        fail(PyExc_ValueError, "ends must ascend strictly within order");
      previous = ends.data()[b];
    }
    for (i64 i = 0; i < previous; ++i)
      if (order.data()[i] < 0 || order.data()[i] >= placed)
        fail(PyExc_ValueError, "order holds node " + std::to_string(order.data()[i]) +
                                   ", which the graph has not placed");
    if (first_batch < 0 || first_batch + forward.batches > c.batch_size.size())
      fail(PyExc_ValueError, "batches " + std::to_string(first_batch) + ".." +
                                 std::to_string(first_batch + forward.batches - 1) +
                                 " are not all in the graph's batch_sizes");
    forward.arg_ptr = c.arg_ptr.data();
    forward.arg_flat = c.arg_flat.data();
    forward.node_batch = c.batch.data();
    forward.node_row = c.row.data();
    forward.batch_size = c.batch_size.data();
    forward.shape = c.shape.data();
    std::vector<i64> leading(store->shape_keys->size());  // of each shape the graph has met
    for (std::size_t id = 0; id < leading.size(); ++id) {
      const std::int32_t shape = static_cast<std::int32_t>(id);
      leading[id] = store->shape_keys->length(shape) ? store->shape_keys->key(shape)[0] : -1;
    }
    forward.leading = leading.data();
    const flybatch::ReadPlan plan = flybatch::plan_reads(
        forward, [&, &traits = op_traits()](i64 node) { return traits[c.op[node]].layout; });
    Owned planned(plan_to_python(plan));
    Owned heads(batch_heads(store, forward));
    return checked(PyTuple_Pack(7, PyTuple_GET_ITEM(planned.get(), 0),
                                PyTuple_GET_ITEM(planned.get(), 1),
                                PyTuple_GET_ITEM(planned.get(), 2),
                                PyTuple_GET_ITEM(planned.get(), 3), heads.get(),
                                PyTuple_GET_ITEM(planned.get(), 4),
                                PyTuple_GET_ITEM(planned.get(), 5)));
  });
}

const char kConcatRowsDoc[] =
    "concat_rows(graph, nodes) -> (k, sources, source_rows, table_rows) or None\n\n"
    "What a product of a concat batch gathers from the projections of its sources\n"
    "(csrc/execute.h, projection.py). nodes: the concat batch's node ids (an int64 array), each\n"
    "of k arguments; sources: the batches those arguments are rows of, ascending, with\n"
    "source_rows rows each; table_rows (int64 bytes, n * k): the row of the sources' joined\n"
    "projection tables that argument i of node n reads, at n * k + i. None when the nodes\n"
    "differ in arity.";

PyObject* py_concat_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "concat_rows(graph, nodes) takes 2 arguments");
    return nullptr;
  }
  PyObject* graph = args[0];
  return guarded([&]() -> PyObject* {
    if (!PyObject_TypeCheck(graph, &flybatch::StoreType))
      fail(PyExc_TypeError, "graph must be a flybatch Graph (a _core.Store)");
    const flybatch::Store* store = reinterpret_cast<flybatch::Store*>(graph);
    const flybatch::Columns& c = *store->nodes;
    const Int64Buffer nodes(args[1], "nodes", 0, /*read_only=*/true);
    const i64 placed = std::min<i64>(c.batch.size(), flybatch::n_nodes(store));
    for (i64 i = 0; i < nodes.size(); ++i)
      if (nodes.data()[i] < 0 || nodes.data()[i] >= placed)
        fail(PyExc_ValueError, "nodes holds node " + std::to_string(nodes.data()[i]) +
                                   ", which the graph has not placed");
    flybatch::ScheduledForward columns;
    columns.arg_ptr = c.arg_ptr.data();
    columns.arg_flat = c.arg_flat.data();
    columns.node_batch = c.batch.data();
    columns.node_row = c.row.data();
    columns.batch_size = c.batch_size.data();
    flybatch::ConcatRows found;
    if (!flybatch::concat_rows(nodes.data(), nodes.size(), columns, found)) Py_RETURN_NONE;
    Owned sources(int_tuple(found.sources)), source_rows(int_tuple(found.source_rows));
    Owned table_rows(PyByteArray_FromStringAndSize(
        reinterpret_cast<const char*>(found.table_rows.data()),
        static_cast<Py_ssize_t>(found.table_rows.size() * sizeof(i64))));
    return checked(Py_BuildValue("(LOOO)", found.k, sources.get(), source_rows.get(),
                                 table_rows.get()));
  });
}

PyMethodDef kMethods[] = {
    {"concat_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_concat_rows)),
     METH_FASTCALL, kConcatRowsDoc},
    {"plan_reads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_plan_reads)),
     METH_VARARGS | METH_KEYWORDS, kPlanReadsDoc},
    {"schedule", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_schedule)),
     METH_VARARGS | METH_KEYWORDS, kScheduleDoc},
    {"lower_bound", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_lower_bound)),
     METH_VARARGS | METH_KEYWORDS, kLowerBoundDoc},
    {"signature_splits",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_signature_splits)),
     METH_VARARGS | METH_KEYWORDS, kSplitsDoc},
    {"signature_ranks",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_signature_ranks)),
     METH_VARARGS | METH_KEYWORDS, kRanksDoc},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "flybatch._core",
    "The compiled core of flybatch: the per-node work of each stage (see csrc/).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__core() { return flybatch::register_store(PyModule_Create(&kModule)); }
