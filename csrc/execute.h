// The execution stage's planning: before a forward runs, how every batch reads its arguments
// from the results of earlier batches (the reads), and which results are read in pieces and so
// are fanned out once. Plain C++ over arrays: module.cpp converts from Python and back, and
// execution.py runs the plan with torch.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace flybatch {

using i64 = std::int64_t;

// How a node's op takes its arguments; the op table itself lives in Python.
struct ArgumentLayout {
  bool leaf = false;    // reads nothing: its kernel makes the values
  bool ragged = false;  // lists of any length in one batch: ONE read of every item, flat,
  i64 fixed = 0;        // after its first `fixed` arguments (ragged only), read one by one
  i64 stack_from = 0;   // variadic: from this arity on, ONE read of all arguments (0: never);
                        // below it too when that saves gathers (execute.cpp)
  // Arguments whose leading dim (a length) may differ from node to node in one batch: they
  // are read padded to the column's longest, and the kernel gets each node's length.
  bool padded = false;
  bool result_length = false;  // padded: the lengths are the nodes' own (elementwise ops)
};
using LayoutOf = std::function<ArgumentLayout(i64 node)>;  // node: a global id

// One forward's schedule, and the graph columns it reads in place.
struct ScheduledForward {
  i64 first_batch = 0;            // global index of the forward's first batch
  const i64* order = nullptr;     // node ids of the batches, batch after batch, in row order
  const i64* ends = nullptr;      // end of each batch in `order`
  i64 batches = 0;
  const i64* arg_ptr = nullptr;   // inputs of node v: arg_flat[arg_ptr[v] .. arg_ptr[v+1])
  const i64* arg_flat = nullptr;
  const std::int32_t* node_batch = nullptr;  // where each node's value lives: this forward's
  const std::int32_t* node_row = nullptr;    // nodes and every node they read
  const std::int32_t* batch_size = nullptr;  // rows of every batch, this forward's included
  const std::int32_t* shape = nullptr;       // shape id of each node
  const i64* leading = nullptr;              // per shape id: its first dim, -1 for a scalar
};

// A read gathers one argument position of a batch (a node id per row) into ONE tensor:
// - view: rows start .. start+length-1 of one result, a zero-copy view (the whole result when
//   it covers it; length 1 with several nodes: all read the same node, and the kernel
//   broadcasts the row);
// - rows: arbitrary rows of one result (one index_select);
// - multi: rows of several results: one read per result (its `parts`, ascending by result),
//   concatenated, then put back in the nodes' order unless they already are.
enum class ReadKind : std::uint8_t { view, rows, multi };

struct Read {
  ReadKind kind = ReadKind::view;
  i64 source = 0;    // view, rows: the batch whose result is read
  i64 start = 0;     // view: first row; rows: where its row numbers start in `indices`;
                     // multi: where its part read ids start in `parts`
  i64 length = 0;    // rows read; multi: parts
  i64 inverse = -1;  // multi: where the permutation back to the nodes' order starts in
                     // `indices` (as many entries as rows read), or -1 when none is needed
  i64 rows = 0;      // multi: rows read
  i64 whole = -1;    // multi of kWholeResultsMinParts parts or more: where the nodes' rows in
                     // the concatenation of the parts' WHOLE results (ascending by result)
                     // start in `indices` (as many as rows read), for execution to read many
                     // small results as one cat and one index_select; else -1
};

// From this many parts on, a multi read also carries its rows in the whole results (`whole`).
inline constexpr i64 kWholeResultsMinParts = 8;

// A batch's arguments: read ids args[begin .. end). `stacked`: the arity k of a variadic op
// read as one [B * k] read (0 otherwise). `arities`: for a ragged op, where the length of each
// node's list starts in `indices` (one per node), else -1. `widths`: where the width of each
// read starts in `indices` (one per read): the leading dim its rows must have, the longest of
// its nodes (a result of a padded op is stored padded to ITS longest), -1 for scalars.
// `lengths`: for a padded op whose nodes' first arguments (with `result_length`, whose nodes)
// differ in length, where those lengths start in `indices` (one per node), else -1. `uneven`: its nodes' shapes differ, so
// its result is stored padded.
struct BatchReads {
  i64 begin = 0, end = 0;
  i64 stacked = 0;
  i64 arities = -1;
  i64 widths = -1;
  i64 lengths = -1;
  bool uneven = false;
};

// A result read in pieces (not whole) by two or more reads. Every partial read of a tensor
// makes autograd build a zero tensor the size of the whole result in backward; fanning the
// result out once into the pieces makes that one allocation. The pieces come from ONE
// torch.split: of the result itself when the reads are disjoint runs (`gather` -1; `sizes`
// cover all its rows, runs nobody reads included), else of ONE gather of every read's rows,
// listed from indices[gather] on (`sizes`: each read's rows). reads[i] gets piece piece[i].
struct FanOut {
  i64 source = 0;
  i64 gather = -1;
  std::vector<i64> reads;
  std::vector<i64> sizes;
  std::vector<i64> piece;
};

struct ReadPlan {
  std::vector<Read> reads;
  std::vector<i64> parts;         // part read ids of the multi reads
  std::vector<i64> args;          // read ids of every batch's arguments (BatchReads)
  std::vector<BatchReads> batches;
  std::vector<i64> indices;       // row numbers, permutations and arities the reads refer to
  std::vector<FanOut> fan_outs;   // in the order of each source's first partial read
  // Per batch of this forward, how many reads (views and rows: a multi read counts through its
  // parts) read its result: execution.py asks whether a concat's only reader is one product.
  std::vector<i64> readers;
  // The views and rows reads of an EARLIER forward's result that take only part of it, in
  // read order: the only reads that may go through a gradient sink (execution.py), found here
  // instead of by a Python loop over every read of every forward.
  std::vector<i64> earlier_partial;
};

// Throws std::invalid_argument if an argument of a batch is not placed yet.
ReadPlan plan_reads(const ScheduledForward& forward, const LayoutOf& layout_of);

// What a product of a concat batch gathers from the projections of the concat's sources
// instead of multiplying (projection.py). The concat's nodes each have `k` arguments (block i
// of a node is its argument i), which read rows of the batches `sources` (ascending, each with
// `source_rows` rows). Row n * k + i of `table_rows` is the row of the sources' projection
// tables, joined in that order ([rows of all sources * k, out]), that block i of node n reads:
// (its argument's row in the sources' results end to end) * k + i.
struct ConcatRows {
  i64 k = 0;
  std::vector<i64> sources;
  std::vector<i64> source_rows;
  std::vector<i64> table_rows;
};

// The ConcatRows of nodes[0..n), read from the graph's columns (arg_ptr, arg_flat, node_batch,
// node_row, batch_size); false when the nodes differ in arity or have none. Throws
// std::invalid_argument if an argument is not placed.
bool concat_rows(const i64* nodes, i64 n, const ScheduledForward& columns, ConcatRows& out);

}  // namespace flybatch
