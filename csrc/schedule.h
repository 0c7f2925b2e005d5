// The scheduling stage: group the pending nodes of one forward into batches (one kernel each),
// decide where each node's value lives, and compute the per-signature ranks behind the agenda
// and the lower bound. Plain C++ over arrays: module.cpp converts from Python and back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

namespace flybatch {

using i64 = std::int64_t;
// Node ids inside one call. 32 bits halve the memory of the per-node work arrays; module.cpp
// refuses 2^31 nodes or more.
using Local = std::int32_t;

// Nodes start .. start+n-1 of the node store (one forward), read in place.
struct Nodes {
  i64 start = 0;
  Local n = 0;
  const i64* sig = nullptr;       // interned signature per node
  const i64* depth = nullptr;     // longest path from a leaf through this forward's nodes
  const i64* arg_ptr = nullptr;   // inputs of local node v: arg_flat[arg_ptr[v] .. arg_ptr[v+1])
  const i64* arg_flat = nullptr;  // global node ids; inputs below `start` are already computed
};

// What scheduling needs to know of a node's op; the op table itself lives in Python.
struct OpFlags {
  bool leaf = false;   // an input, parameter or constant: no inputs, no kernel launch
  bool cheap = false;  // the agenda runs cheap ops first on ties, as DyNet does
};
using OpFlagsOf = std::function<OpFlags(i64 node)>;  // node: a global id

// Throws std::invalid_argument when the arrays break the invariants every pass below relies
// on: inputs are earlier nodes (node ids are a topological order), depths lie in 0..n.
void check_nodes(const Nodes& nodes);

// Where the batches go: the node ids of all batches in batch and row order, and each node's
// (batch, row) in the graph-wide position arrays, which also say where earlier inputs live.
struct Placement {
  std::int32_t* node_batch = nullptr;  // indexed by global node id
  std::int32_t* node_row = nullptr;
  i64 first_batch = 0;        // global index of this forward's first batch
  i64* order = nullptr;       // n entries: global node ids, batch after batch
  i64* ends = nullptr;        // end of batch b in `order` (at most n entries)
  i64 batches = 0;            // batches written so far
};

// `automatic` is Python's "auto": the fewest launches among several schedules.
enum class Strategy { none, depth, agenda, automatic };

// Batches `nodes` with `strategy` into `out`; returns the number of batches.
i64 schedule(Strategy strategy, const Nodes& nodes, const OpFlagsOf& flags_of, Placement& out);

// For each node, the most nodes of its own signature on any path of this forward ending at it,
// counting only signatures whose op launches a kernel (leaves get 0).
std::vector<std::int32_t> signature_ranks(const Nodes& nodes, const OpFlagsOf& flags_of);

// Launches no schedule can beat: in each forward, for each signature the most nodes of it on
// one path, summed. `forward_ends`: where each forward's nodes end, ascending, `all.n` last.
i64 lower_bound(const Nodes& all, const std::vector<i64>& forward_ends,
                const OpFlagsOf& flags_of);

// A bound at least lower_bound's that no schedule can beat either, tighter where signatures
// interleave differently on different paths (tanh then sigmoid on one, sigmoid then tanh on
// another): per forward, lower_bound's sum plus what disjoint blocks of two or three
// signatures must add over their own counts (a pair bound from counts along paths, and a
// budgeted exact search per block). The proofs are beside tight_bound_of in schedule.cpp.
// `pairs_only`: the pair bound's matching alone (the earlier tight bound, for tests).
i64 tight_bound(const Nodes& all, const std::vector<i64>& forward_ends,
                const OpFlagsOf& flags_of, bool pairs_only = false);

// Why a signature took more launches than its bound, per interned signature of the first n
// nodes: its bound (summed over forwards) and, for the nodes that missed the first launch of
// their (signature, rank) group, the signatures of the inputs computed at or after that launch
// (how many such inputs): what they waited on. `node_batch`: the placement of the schedule run.
struct SignatureSplit {
  i64 sig = 0;
  i64 bound = 0;
  std::map<i64, i64> waited_on;  // input signature -> inputs
};
std::vector<SignatureSplit> signature_splits(const Nodes& all, const std::vector<i64>& forward_ends,
                                             const OpFlagsOf& flags_of,
                                             const std::int32_t* node_batch);

}  // namespace flybatch
