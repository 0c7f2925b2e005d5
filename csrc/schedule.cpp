// The scheduling stage (see schedule.h). Every pass is linear in nodes + edges, apart from
// sorting the distinct signatures and the batches whose nodes became ready in several pieces.
#include "schedule.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <optional>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace flybatch {
namespace {

// Numbers int64 keys in order of first appearance (open addressing, linear probing). Interned
// signature ids number every signature of the graph, so a forward of 100 nodes must not pay for
// a table indexed by all of them.
class KeyNumbers {
 public:
  // The number of `key`; a new key gets the next unused number.
  std::int32_t number(i64 key) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    Slot& slot = find(key);
    if (slot.number < 0) slot = {key, static_cast<std::int32_t>(size_++)};
    return slot.number;
  }

 private:
  struct Slot {
    i64 key = 0;
    std::int32_t number = -1;  // -1: empty
  };

  Slot& find(i64 key) {
    const std::size_t mask = slots_.size() - 1;
    // Fibonacci hashing: interned ids are small consecutive ints, the top bits spread them.
    std::size_t i = (static_cast<std::uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> (64 - bits_);
    while (slots_[i].number >= 0 && slots_[i].key != key) i = (i + 1) & mask;
    return slots_[i];
  }

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    bits_ = old.empty() ? 6 : bits_ + 1;
    slots_.assign(std::size_t{1} << bits_, Slot{});
    for (const Slot& slot : old)
      if (slot.number >= 0) find(slot.key) = slot;
  }

  std::vector<Slot> slots_;
  int bits_ = 0;
  std::size_t size_ = 0;
};

// The signatures of a forward renumbered 0..count-1 in ascending order of their interned ids:
// the order in which the schedules break ties between signatures.
struct Signatures {
  std::vector<std::int32_t> of;  // per node
  std::vector<Local> first;      // per signature: its first node
  std::size_t count() const { return first.size(); }
};

// Interned ids below this many per node are numbered through a table indexed by id (a load per
// node) rather than KeyNumbers (a hash and a probe): the ids of a graph's few hundred signatures
// are small, while a small forward of a graph with very many must not pay for a table of all.
constexpr i64 kTableIdsPerNode = 4;

Signatures compact_signatures(const Nodes& nodes) {
  Signatures sigs;
  sigs.of.resize(nodes.n);
  std::vector<Local> first;
  i64 top = -1;  // the highest interned id (ids are >= 0: the store's row numbers)
  for (Local v = 0; v < nodes.n; ++v) top = std::max(top, nodes.sig[v]);
  if (nodes.n && *std::min_element(nodes.sig, nodes.sig + nodes.n) >= 0 &&
      top < kTableIdsPerNode * static_cast<i64>(nodes.n)) {
    std::vector<std::int32_t> number(static_cast<std::size_t>(top) + 1, -1);
    for (Local v = 0; v < nodes.n; ++v) {
      std::int32_t& s = number[nodes.sig[v]];
      if (s < 0) {
        s = static_cast<std::int32_t>(first.size());
        first.push_back(v);
      }
      sigs.of[v] = s;
    }
  } else {
    KeyNumbers numbers;
    std::int32_t last = -1;  // consecutive nodes often share a signature: skip the lookup
    for (Local v = 0; v < nodes.n; ++v) {
      if (last < 0 || nodes.sig[v] != nodes.sig[first[last]]) {
        last = numbers.number(nodes.sig[v]);
        if (last == static_cast<std::int32_t>(first.size())) first.push_back(v);
      }
      sigs.of[v] = last;
    }
  }
  std::vector<std::int32_t> by_key(first.size());
  std::iota(by_key.begin(), by_key.end(), 0);
  std::sort(by_key.begin(), by_key.end(), [&](std::int32_t a, std::int32_t b) {
    return nodes.sig[first[a]] < nodes.sig[first[b]];
  });
  std::vector<std::int32_t> renumber(first.size());
  sigs.first.resize(first.size());
  for (std::size_t i = 0; i < by_key.size(); ++i) {
    renumber[by_key[i]] = static_cast<std::int32_t>(i);
    sigs.first[i] = first[by_key[i]];
  }
  for (std::int32_t& s : sigs.of) s = renumber[s];
  return sigs;
}

std::vector<OpFlags> signature_flags(const Nodes& nodes, const Signatures& sigs,
                                     const OpFlagsOf& flags_of) {
  std::vector<OpFlags> flags(sigs.count());
  for (std::size_t s = 0; s < flags.size(); ++s) flags[s] = flags_of(nodes.start + sigs.first[s]);
  return flags;
}

template <class Visit>
void for_each_input(const Nodes& nodes, Local v, Visit&& visit) {
  for (i64 e = nodes.arg_ptr[v]; e < nodes.arg_ptr[v + 1]; ++e)
    if (nodes.arg_flat[e] >= nodes.start)
      visit(static_cast<Local>(nodes.arg_flat[e] - nodes.start));
}

// Per-node sparse counts (signature -> count) in one pool, each node's as one block behind a
// header {owner, length}. Freed blocks are reclaimed by compacting the pool once it is mostly
// dead, so it never holds much more than twice the live counts, without a heap allocation per
// node.
class CountPool {
 public:
  struct Entry {
    std::int32_t sig, count;
  };

  explicit CountPool(Local n) : at_(n, -1) {}

  const Entry* begin(Local v) const { return at_[v] < 0 ? nullptr : &pool_[at_[v] + 1]; }
  const Entry* end(Local v) const {
    return at_[v] < 0 ? nullptr : &pool_[at_[v] + 1] + pool_[at_[v]].count;
  }

  // Writes node v's block: open(v, at most `length` entries), add() each entry, close(v).
  void open(Local v, std::size_t length) {
    if (size_ > 2 * live_ + kSlack) compact();
    if (size_ + length + 1 > pool_.size()) pool_.resize(2 * (size_ + length + 1));
    open_ = size_;
    pool_[size_++] = {v, 0};
  }
  void add(std::int32_t sig, std::int32_t count) { pool_[size_++] = {sig, count}; }
  void close(Local v) {
    const std::size_t length = size_ - open_ - 1;
    if (length == 0) {
      size_ = open_;
      return;
    }
    pool_[open_].count = static_cast<std::int32_t>(length);
    at_[v] = static_cast<i64>(open_);
    live_ += length + 1;
  }

  void free(Local v) {
    if (at_[v] < 0) return;
    live_ -= pool_[at_[v]].count + 1;
    at_[v] = -1;
  }

 private:
  static constexpr std::size_t kSlack = 4096;  // entries; avoids compacting tiny pools

  void compact() {
    std::size_t write = 0;
    for (std::size_t read = 0; read < size_;) {
      const Local owner = pool_[read].sig;
      const std::size_t length = pool_[read].count + 1;
      if (at_[owner] == static_cast<i64>(read)) {
        std::copy(pool_.begin() + read, pool_.begin() + read + length, pool_.begin() + write);
        at_[owner] = static_cast<i64>(write);
        write += length;
      }
      read += length;
    }
    size_ = write;
  }

  std::vector<Entry> pool_;  // entries 0..size_-1 are in use
  std::vector<i64> at_;      // per node: its block's header in pool_, -1 when it keeps none
  std::size_t size_ = 0;
  std::size_t open_ = 0;
  std::size_t live_ = 0;
};

// count_v[s] = [v counted and sig(v) = s] + max over inputs u of count_u[s];
// rank(v) = count_v[sig(v)].
//
// A dense table count[node, signature] costs nodes x signatures (2.9 GB for 168k nodes of
// 4,006 signatures). But edges always go to a deeper node, so count_v[s] can only matter to a
// node deeper than v: a node keeps its counts only for signatures that have a node deeper than
// it (a signature whose nodes all sit at one depth is never kept: its ranks are all 1), and
// only until its last consumer has read them. Time is then edges x the signatures a node keeps
// and memory the live nodes x the same, whatever the number of signatures in the graph: a node
// of one instance keeps the few signatures of its instance's path.
//
// A small forward (nodes x signatures up to kDenseCounts) keeps every count in one dense table
// instead: no bookkeeping per node, a row per node the max of its inputs' rows. On the
// 300-1,500-node graphs of bench quality that is 3-4x cheaper.
constexpr std::size_t kDenseCounts = std::size_t{1} << 16;

// Only signatures whose counts can matter get a column: one that launches a kernel (a leaf is
// never counted: its counts stay 0) and, where depths are known, has nodes at two depths or
// more (edges go to deeper nodes, so no path holds two nodes of one depth: such a signature's
// ranks are all 1). On bench quality's graphs that is a half to two thirds of the signatures.
__attribute__((optimize("O3"))) std::vector<std::int32_t> dense_ranks_of(
    const Nodes& nodes, const Signatures& sigs, const std::vector<OpFlags>& flags) {
  constexpr std::size_t kChunk = 8;  // rows padded to chunks of 8, which the compiler vectorizes
  std::vector<std::int32_t> column(sigs.count(), -1);
  std::size_t columns = 0;
  if (nodes.depth) {
    std::vector<bool> deeper(sigs.count(), false);  // a node deeper than the signature's first
    for (Local v = 0; v < nodes.n; ++v)
      if (nodes.depth[v] != nodes.depth[sigs.first[sigs.of[v]]]) deeper[sigs.of[v]] = true;
    for (std::size_t s = 0; s < sigs.count(); ++s)
      if (deeper[s] && !flags[s].leaf) column[s] = static_cast<std::int32_t>(columns++);
  } else {
    for (std::size_t s = 0; s < sigs.count(); ++s)
      if (!flags[s].leaf) column[s] = static_cast<std::int32_t>(columns++);
  }
  const std::size_t width = (columns + kChunk - 1) / kChunk * kChunk;
  std::vector<std::int32_t> rank(nodes.n);
  if (width == 0) {  // no signature can rank above 1: no table (and no row of an empty one)
    for (Local v = 0; v < nodes.n; ++v) rank[v] = !flags[sigs.of[v]].leaf;
    return rank;
  }
  std::vector<std::int32_t> count(static_cast<std::size_t>(nodes.n) * width, 0);
  for (Local v = 0; v < nodes.n; ++v) {
    std::int32_t* __restrict row = &count[v * width];
    for_each_input(nodes, v, [&](Local u) {
      const std::int32_t* __restrict input = &count[u * width];
      for (std::size_t c = 0; c < width; c += kChunk)
        for (std::size_t k = 0; k < kChunk; ++k) row[c + k] = std::max(row[c + k], input[c + k]);
    });
    const std::int32_t s = sigs.of[v];
    rank[v] = column[s] >= 0 ? ++row[column[s]] : !flags[s].leaf;
  }
  return rank;
}

std::vector<std::int32_t> ranks_of(const Nodes& nodes, const Signatures& sigs,
                                   const std::vector<OpFlags>& flags) {
  const Local n = nodes.n;
  if (static_cast<std::size_t>(n) * sigs.count() <= kDenseCounts)
    return dense_ranks_of(nodes, sigs, flags);
  // Depth along this forward's edges (computed here, so the invariant holds by construction),
  // each signature's deepest node, and how many times each node is read.
  std::vector<std::int32_t> depth(n, 0), deepest(sigs.count(), 0), reads(n, 0);
  for (Local v = 0; v < n; ++v) {
    std::int32_t d = 0;
    for_each_input(nodes, v, [&](Local u) {
      d = std::max(d, depth[u] + 1);
      ++reads[u];
    });
    depth[v] = d;
    deepest[sigs.of[v]] = std::max(deepest[sigs.of[v]], d);
  }
  std::vector<std::int32_t> rank(n);
  CountPool counts(n);
  std::vector<std::int32_t> best(sigs.count(), 0);  // max over v's inputs, per signature
  std::vector<std::int32_t> touched;                // signatures with best > 0
  for (Local v = 0; v < n; ++v) {
    for_each_input(nodes, v, [&](Local u) {
      for (const CountPool::Entry* e = counts.begin(u); e != counts.end(u); ++e) {
        if (best[e->sig] == 0) touched.push_back(e->sig);
        best[e->sig] = std::max(best[e->sig], e->count);
      }
    });
    const std::int32_t s = sigs.of[v];
    rank[v] = best[s] + (flags[s].leaf ? 0 : 1);
    for_each_input(nodes, v, [&](Local u) {
      if (--reads[u] == 0) counts.free(u);
    });
    if (reads[v] > 0) {
      counts.open(v, touched.size() + 1);
      if (rank[v] > 0 && depth[v] < deepest[s]) counts.add(s, rank[v]);
      for (std::int32_t t : touched)
        if (t != s && depth[v] < deepest[t]) counts.add(t, best[t]);
      counts.close(v);
    }
    for (std::int32_t t : touched) best[t] = 0;
    touched.clear();
  }
  return rank;
}

// Per node, the most nodes of its signature on any path of this forward STARTING at it (leaves
// get 0): dense_ranks_of along consumers, from the last node back, over the forward's
// consumers as CSR arrays (Edges). Columns only for the signatures that launch and have nodes
// at two depths or more (no path holds two nodes of one depth); a forward whose table would
// pass kDenseBackward entries (4 MB) is turned around instead (node v becomes n - 1 - v) for
// ranks_of, whose sparse counts take less memory and more time: on the torch-native Tree-LSTM
// benchmark's 40-46k-node forwards (about 16 columns), scheduling 0.18 us/node with the table,
// 0.25 with the sparse counts.
constexpr std::size_t kDenseBackward = std::size_t{1} << 20;

__attribute__((optimize("O3"))) std::vector<std::int32_t> backward_ranks_of(
    const Nodes& nodes, const std::vector<i64>& consumers_ptr,
    const std::vector<Local>& consumers, const Signatures& sigs,
    const std::vector<OpFlags>& flags) {
  constexpr std::size_t kChunk = 8;
  const Local n = nodes.n;
  std::vector<std::int32_t> column(sigs.count(), -1);
  std::vector<bool> deeper(sigs.count(), false);
  for (Local v = 0; v < n; ++v)
    if (nodes.depth[v] != nodes.depth[sigs.first[sigs.of[v]]]) deeper[sigs.of[v]] = true;
  std::size_t columns = 0;
  for (std::size_t s = 0; s < sigs.count(); ++s)
    if (deeper[s] && !flags[s].leaf) column[s] = static_cast<std::int32_t>(columns++);
  const std::size_t width = (columns + kChunk - 1) / kChunk * kChunk;
  std::vector<std::int32_t> rank(n);
  if (width * static_cast<std::size_t>(n) > kDenseBackward) {
    std::vector<i64> ptr(static_cast<std::size_t>(n) + 1, 0), flat(consumers.size());
    for (Local i = 0; i < n; ++i) {  // reversed node i is node n - 1 - i
      const Local v = n - 1 - i;
      ptr[i + 1] = ptr[i] + (consumers_ptr[v + 1] - consumers_ptr[v]);
      for (i64 e = consumers_ptr[v]; e < consumers_ptr[v + 1]; ++e)
        flat[ptr[i] + (e - consumers_ptr[v])] = n - 1 - consumers[e];
    }
    Signatures reversed;
    reversed.of.assign(sigs.of.rbegin(), sigs.of.rend());
    reversed.first = sigs.first;  // read only with depths, which the reversed forward has not
    Nodes back;
    back.n = n;
    back.arg_ptr = ptr.data();
    back.arg_flat = flat.data();
    rank = ranks_of(back, reversed, flags);
    std::reverse(rank.begin(), rank.end());
    return rank;
  }
  if (width == 0) {
    for (Local v = 0; v < n; ++v) rank[v] = !flags[sigs.of[v]].leaf;
    return rank;
  }
  // The table's memory is kept from call to call (at most kDenseBackward entries per thread):
  // allocated afresh, its pages cost more than filling them (hierarchical-rnn x20, 4.1k nodes x
  // 16 columns: 125 -> 33 us).
  static thread_local std::vector<std::int32_t> count;
  count.assign(static_cast<std::size_t>(n) * width, 0);
  for (Local v = n - 1; v >= 0; --v) {
    std::int32_t* __restrict row = &count[v * width];
    for (i64 e = consumers_ptr[v]; e < consumers_ptr[v + 1]; ++e) {
      const std::int32_t* __restrict after = &count[consumers[e] * width];
      for (std::size_t c = 0; c < width; c += kChunk)
        for (std::size_t k = 0; k < kChunk; ++k) row[c + k] = std::max(row[c + k], after[c + k]);
    }
    const std::int32_t s = sigs.of[v];
    rank[v] = column[s] >= 0 ? ++row[column[s]] : !flags[s].leaf;
  }
  return rank;
}

// Appends batches to a Placement and orders each batch's rows so that the next batch usually
// finds its inputs as a contiguous, in-order run of an earlier result, read without a copy.
class Placer {
 public:
  Placer(const Nodes& nodes, Placement& out) : nodes_(nodes), out_(out) {}

  // `batch`: local ids, in any order; reordered in place. The schedules leave a batch that
  // became ready in pieces unsorted: only the plan placed is sorted, not every candidate's.
  void place(Local* batch, std::size_t size) {
    if (!std::is_sorted(batch, batch + size)) std::sort(batch, batch + size);
    order_rows(batch, size);
    const i64 index = out_.first_batch + out_.batches;
    const i64 begin = out_.batches ? out_.ends[out_.batches - 1] : 0;
    for (std::size_t row = 0; row < size; ++row) {
      const i64 node = nodes_.start + batch[row];
      out_.order[begin + row] = node;
      out_.node_batch[node] = static_cast<std::int32_t>(index);
      out_.node_row[node] = static_cast<std::int32_t>(row);
    }
    out_.ends[out_.batches++] = begin + static_cast<i64>(size);
  }

 private:
  i64 arity(Local v) const { return nodes_.arg_ptr[v + 1] - nodes_.arg_ptr[v]; }
  i64 arg(Local v, i64 j) const { return nodes_.arg_flat[nodes_.arg_ptr[v] + j]; }

  // Sorts the rows by the position of the input fed by the most recent earlier batch: that
  // input is usually the recurrent one (the previous step's state, a child's output), and rows
  // in its order let the next gather be a zero-copy view. Looks at the first four argument
  // positions that every node of the batch has (ragged ops batch lists of any length).
  void order_rows(Local* batch, std::size_t size) {
    if (size < 2) return;
    i64 positions = 4;
    for (std::size_t i = 0; i < size; ++i) positions = std::min(positions, arity(batch[i]));
    i64 column = -1, recency = -1;
    for (i64 j = 0; j < positions; ++j) {
      const i64 first = arg(batch[0], j);
      bool varying = false;
      i64 latest = out_.node_batch[first];
      for (std::size_t i = 1; i < size; ++i) {
        const i64 a = arg(batch[i], j);
        varying |= a != first;
        latest = std::max<i64>(latest, out_.node_batch[a]);
      }
      if (varying && latest > recency) column = j, recency = latest;
    }
    if (column < 0) return;  // every node reads the same inputs: any order reads them alike
    keys_.resize(size);
    for (std::size_t i = 0; i < size; ++i) {
      const i64 a = arg(batch[i], column);
      keys_[i] = {out_.node_batch[a], out_.node_row[a]};
    }
    if (std::is_sorted(keys_.begin(), keys_.end())) return;
    rows_.resize(size);
    std::iota(rows_.begin(), rows_.end(), 0);
    std::stable_sort(rows_.begin(), rows_.end(),
                     [&](std::size_t a, std::size_t b) { return keys_[a] < keys_[b]; });
    sorted_.resize(size);
    for (std::size_t i = 0; i < size; ++i) sorted_[i] = batch[rows_[i]];
    std::copy(sorted_.begin(), sorted_.end(), batch);
  }

  const Nodes& nodes_;
  Placement& out_;
  std::vector<std::pair<i64, i64>> keys_;  // (batch, row) of each row's chosen input
  std::vector<std::size_t> rows_;
  std::vector<Local> sorted_;
};

// A stable counting sort of `items` by key(item) in 0..keys-1.
template <class Key>
std::vector<Local> counting_sort(const std::vector<Local>& items, std::size_t keys, Key&& key) {
  std::vector<std::size_t> start(keys + 1, 0);
  for (Local v : items) ++start[key(v) + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<Local> sorted(items.size());
  for (Local v : items) sorted[start[key(v)]++] = v;
  return sorted;
}

// A schedule before placement: local node ids, batch after batch. `auto` builds several and
// places only the one with the fewest launches (placing writes the graph's position arrays).
struct Plan {
  std::vector<Local> order;
  std::vector<Local> ends;  // end of each batch in `order`
  i64 launches = 0;         // batches of ops that launch a kernel (not leaves)

  void add(const Local* batch, std::size_t size, bool launch) {
    const std::size_t at = order.size();  // a resize and a copy: cheaper than a range insert
    order.resize(at + size);
    std::copy(batch, batch + size, order.begin() + static_cast<std::ptrdiff_t>(at));
    ends.push_back(static_cast<Local>(order.size()));
    launches += launch;
  }
};

// One batch per (key, signature), in that order, its nodes in id order. Valid for any key that
// grows along every edge; with key = depth it is TensorFlow Fold's schedule. Two counting
// sorts: linear, where sorting tuples would not be.
Plan by_key(const Nodes& nodes, const Signatures& sigs, const std::vector<OpFlags>& flags,
            const i64* key) {
  std::vector<Local> order(nodes.n);
  std::iota(order.begin(), order.end(), 0);
  order = counting_sort(order, sigs.count(), [&](Local v) { return sigs.of[v]; });
  order = counting_sort(order, static_cast<std::size_t>(nodes.n) + 1,
                        [&](Local v) { return key[v]; });
  Plan plan;
  plan.order = std::move(order);
  const std::vector<Local>& o = plan.order;
  for (std::size_t i = 1; i <= o.size(); ++i) {
    if (i < o.size() && key[o[i]] == key[o[i - 1]] && sigs.of[o[i]] == sigs.of[o[i - 1]])
      continue;
    plan.ends.push_back(static_cast<Local>(i));
    plan.launches += !flags[sigs.of[o[i - 1]]].leaf;
  }
  return plan;
}

// by_key's launches, or `limit` when it would launch at least that many (then no plan is
// built: `auto` keeps only a schedule that launches fewer). The (key, signature) pairs of nodes
// that launch, counted in a bit table of keys x signatures; a table over 64 bits per node would
// cost more than the plan it saves, and the plan is built instead.
Plan by_key_below(const Nodes& nodes, const Signatures& sigs, const std::vector<OpFlags>& flags,
                  const i64* key, i64 limit) {
  const i64 keys = nodes.n ? *std::max_element(key, key + nodes.n) + 1 : 0;
  const auto n_sigs = static_cast<i64>(sigs.count());
  if (keys * n_sigs > 64 * static_cast<i64>(nodes.n)) return by_key(nodes, sigs, flags, key);
  std::vector<std::uint64_t> seen(static_cast<std::size_t>((keys * n_sigs + 63) / 64), 0);
  i64 launches = 0;
  for (Local v = 0; v < nodes.n; ++v) {
    const std::int32_t s = sigs.of[v];
    if (flags[s].leaf) continue;
    const i64 bit = key[v] * n_sigs + s;
    std::uint64_t& word = seen[bit / 64];
    launches += !(word >> (bit % 64) & 1u);
    word |= std::uint64_t{1} << (bit % 64);
  }
  if (launches >= limit) return Plan{{}, {}, limit};
  return by_key(nodes, sigs, flags, key);
}

// The latest-possible twin of the depth rule: key = 1 + (longest path below the deepest node)
// - (longest path below v), so every node runs as late as its consumers allow and the last
// steps of paths of different lengths line up (losses after sequences of different lengths
// share one launch). Leaves, which need nothing, take key 0.
std::vector<i64> as_late_as_possible(const Nodes& nodes, const Signatures& sigs,
                                     const std::vector<OpFlags>& flags,
                                     const std::vector<std::int32_t>& height) {
  const std::int32_t top = nodes.n ? *std::max_element(height.begin(), height.end()) : 0;
  std::vector<i64> key(nodes.n);
  for (Local v = 0; v < nodes.n; ++v) key[v] = flags[sigs.of[v]].leaf ? 0 : 1 + top - height[v];
  return key;
}

// Per node, the longest path from it to a node nothing in this forward reads (in edges).
std::vector<std::int32_t> heights_of(const Nodes& nodes) {
  std::vector<std::int32_t> height(nodes.n, 0);
  for (Local v = nodes.n - 1; v >= 0; --v)
    for_each_input(nodes, v, [&](Local u) { height[u] = std::max(height[u], height[v] + 1); });
  return height;
}

// Edges between this forward's nodes: how many inputs each node waits for, and each node's
// consumers as a CSR array.
struct Edges {
  std::vector<Local> inputs;  // per node
  std::vector<i64> consumers_ptr;
  std::vector<Local> consumers;

  explicit Edges(const Nodes& nodes)
      : inputs(nodes.n, 0), consumers_ptr(static_cast<std::size_t>(nodes.n) + 1, 0) {
    for (Local v = 0; v < nodes.n; ++v)
      for_each_input(nodes, v, [&](Local u) {
        ++inputs[v];
        ++consumers_ptr[u + 1];
      });
    std::partial_sum(consumers_ptr.begin(), consumers_ptr.end(), consumers_ptr.begin());
    consumers.resize(consumers_ptr[nodes.n]);
    std::vector<i64> fill(consumers_ptr.begin(), consumers_ptr.end() - 1);
    for (Local v = 0; v < nodes.n; ++v)
      for_each_input(nodes, v, [&](Local u) { consumers[fill[u]++] = v; });
  }
};

// The (signature, rank) groups of a forward. Nodes of equal signature and rank never depend on
// each other, and a signature needs at least max-rank launches, so the ideal schedule runs each
// group as ONE batch; the groups' count is the lower bound of the forward.
struct Groups {
  std::vector<i64> of;              // per node
  std::vector<i64> size;            // per group
  std::vector<std::int32_t> rank;   // per node (ranks_of)
  std::vector<std::int32_t> brank;  // per node: the same along consumers (backward_ranks_of)
  std::vector<std::int32_t> high;   // per signature: its highest rank, 0 for leaves
  std::vector<Local> nodes_of;      // per signature: its number of nodes
  i64 bound = 0;                    // groups of signatures that launch a kernel
};

// A lower bound on the launches a partial schedule still needs, kept up to date launch by
// launch, so that a candidate of `auto` stops as soon as it cannot beat the best schedule so
// far rather than when it has used as many launches.
//
// Per signature s that launches a kernel: the most s-nodes on one path through the nodes not
// yet run (no two of them can share a launch, each waits on the one before). A schedule built
// forward has run a set of nodes closed under inputs, so the nodes not yet run are closed under
// consumers, and a path through them is a path of the forward from its first node v: the most
// s-nodes on it is v's backward rank (Groups::brank, the most s-nodes on a path of the forward
// starting at v), a number fixed before the schedule starts. So the bound of s is the highest
// backward rank among its nodes not yet run: per signature, a count of the nodes not yet run at
// each backward rank, and the highest rank with a count left. A schedule built from the end of
// the forward back (list_schedule's `backward`) is the same with the forward ranks. This is
// the exact heuristic of bench/optimum.py's A*, and at least what rank(s) - done(s) (the
// highest rank less the highest rank run) gave before.
class LaunchesLeft {
 public:
  // `level`: per node, its backward rank (forward schedules) or rank (backward ones).
  LaunchesLeft(const std::vector<std::int32_t>& level, const Signatures& sigs,
               const std::vector<OpFlags>& flags)
      : level_(&level), sigs_(&sigs), first_(sigs.count() + 1, 0), top_(sigs.count(), 0) {
    const auto n = static_cast<Local>(level.size());
    for (Local v = 0; v < n; ++v)
      if (!flags[sigs.of[v]].leaf) top_[sigs.of[v]] = std::max(top_[sigs.of[v]], level[v]);
    for (std::size_t s = 0; s < sigs.count(); ++s) {
      first_[s + 1] = first_[s] + top_[s] + 1;
      value_ += top_[s];
    }
    count_.assign(first_.back(), 0);
    for (Local v = 0; v < n; ++v)
      if (!flags[sigs.of[v]].leaf) ++count_[first_[sigs.of[v]] + level[v]];
  }

  i64 value() const { return value_; }
  std::int32_t level(Local v) const { return (*level_)[v]; }
  std::int32_t top(std::int32_t s) const { return top_[s]; }
  // The nodes of s not yet run at its top level: a launch of s lowers s's bound iff it takes
  // them all.
  Local at_top(std::int32_t s) const { return count_[first_[s] + top_[s]]; }

  // Nodes batch[0 .. size-1], all of one signature, have run.
  void ran(const Local* batch, std::size_t size) {
    const std::int32_t s = sigs_->of[batch[0]];
    if (top_[s] == 0) return;  // a leaf, or nothing left
    const i64 at = first_[s];
    for (std::size_t i = 0; i < size; ++i) --count_[at + (*level_)[batch[i]]];
    std::int32_t t = top_[s];
    while (t > 0 && count_[at + t] == 0) --t;
    value_ -= top_[s] - t;
    top_[s] = t;
  }

 private:
  const std::vector<std::int32_t>* level_;  // pointers: copies of a ListRun are assigned
  const Signatures* sigs_;
  std::vector<i64> first_;  // per signature: where its counts start in count_
  std::vector<std::int32_t> top_;  // per signature: the highest level with nodes not yet run
  std::vector<Local> count_;  // nodes not yet run, per signature and level
  i64 value_ = 0;
};

// Groups numbered in DyNet's priority order of their signature (lowest average depth first,
// cheap ops first on ties, then the signature order), then by rank.
Groups groups_of(const Nodes& nodes, const Signatures& sigs, const std::vector<OpFlags>& flags) {
  const Local n = nodes.n;
  const std::size_t n_sigs = sigs.count();
  std::vector<std::int32_t> rank = ranks_of(nodes, sigs, flags);
  std::vector<double> depth_sum(n_sigs, 0.0);
  std::vector<Local> size(n_sigs, 0);
  std::vector<std::int32_t> low(n_sigs, INT32_MAX), high(n_sigs, 0);  // rank range
  for (Local v = 0; v < n; ++v) {
    const std::int32_t s = sigs.of[v];
    depth_sum[s] += static_cast<double>(nodes.depth[v]);
    ++size[s];
    low[s] = std::min(low[s], rank[v]);
    high[s] = std::max(high[s], rank[v]);
  }
  std::vector<std::int32_t> by_priority(n_sigs);
  std::iota(by_priority.begin(), by_priority.end(), 0);
  std::sort(by_priority.begin(), by_priority.end(), [&](std::int32_t a, std::int32_t b) {
    const double da = depth_sum[a] / static_cast<double>(size[a]);
    const double db = depth_sum[b] / static_cast<double>(size[b]);
    if (da != db) return da < db;
    if (flags[a].cheap != flags[b].cheap) return flags[a].cheap;
    return a < b;
  });
  Groups groups;
  std::vector<i64> first_group(n_sigs);
  i64 n_groups = 0;
  for (std::int32_t s : by_priority) {
    first_group[s] = n_groups - low[s];
    n_groups += high[s] - low[s] + 1;
    if (!flags[s].leaf) groups.bound += high[s];
  }
  groups.of.resize(n);
  groups.size.assign(n_groups, 0);
  for (Local v = 0; v < n; ++v) ++groups.size[groups.of[v] = first_group[sigs.of[v]] + rank[v]];
  groups.rank = std::move(rank);
  groups.high = std::move(high);
  groups.nodes_of = std::move(size);
  return groups;
}

// DyNet's agenda, completed by per-signature ranks so it reaches the lower bound where the
// groups allow.
//
// A group runs as soon as ALL its nodes are ready; among complete groups, the group order
// decides (DyNet's priority). Only when no group is complete (groups that wait on each other)
// must a group run in pieces: then the ready group whose ready nodes have the longest path to
// the end of the forward runs its ready nodes (a critical-path list scheduler: what must wait
// longest for its consumers goes first), ties by the group order. Without `height` (DyNet's
// rule, the `agenda` baseline) the best-priority ready group runs instead. Losses after
// sequences of different lengths, for instance, are all rank 1 of their signature, so they wait
// until the longest sequence is done.
//
// Once a group has run in pieces, ranks no longer line up with what can share a launch: the
// rest of (s, r) and nodes of (s, r + 1) may be ready together. With `merge`, a launch takes
// the ready nodes of every group of its signature (ready nodes never depend on each other),
// which on mixed-operator DAGs and shift-reduce stacks saves a quarter to a half of the
// launches (bench quality: random-dag 65 -> 45, spinn 165 -> 117).
//
// `limit`: stop once the plan cannot have fewer launches (its launches and the launches it still
// needs reach it: it cannot beat a schedule already found); the plan is then incomplete, its
// `launches` equal to the limit.
Plan ranked_agenda(const Nodes& nodes, const Groups& groups, const Edges& edges,
                   const Signatures& sigs, const std::vector<OpFlags>& flags,
                   const std::vector<std::int32_t>* height, bool merge,
                   i64 limit = INT64_MAX) {
  const Local n = nodes.n;
  const i64 n_groups = static_cast<i64>(groups.size.size());
  std::vector<Local> waiting = edges.inputs;
  // Ready groups keyed by (height of their highest ready node, -group) in one int64: a group is
  // pushed again when a higher node joins it, and an entry whose key is no longer its group's
  // is skipped.
  auto key_of = [&](i64 h, i64 g) { return h * n_groups + (n_groups - 1 - g); };
  std::priority_queue<i64> candidates;
  std::priority_queue<i64, std::vector<i64>, std::greater<i64>> complete;  // group ids
  std::vector<i64> top(n_groups, -1);  // per group: the height of its highest ready node
  // Each group's nodes get a contiguous range of `slots` (sized by the group) and fill it in
  // the order they become ready: slots begin[g] + taken[g] .. begin[g] + filled[g] are the
  // ready nodes not yet run. No allocation per group, and a batch is read in one sweep.
  std::vector<Local> slots(n);
  std::vector<i64> begin(n_groups), filled(n_groups, 0), taken(n_groups, 0);
  std::partial_sum(groups.size.begin(), groups.size.end() - 1, begin.begin() + 1);
  i64 n_ready = 0;
  // With `merge`, a launch of a signature takes the ready nodes of ALL its groups: per
  // signature, a list (through next_group) of its groups that have ready nodes.
  std::vector<i64> first_ready(merge ? sigs.count() : 0, -1), next_group(merge ? n_groups : 0);
  std::vector<Local> merged;
  auto make_ready = [&](Local v) {
    const i64 g = groups.of[v];
    const i64 h = height ? (*height)[v] : 0;
    if (merge && filled[g] == taken[g]) {
      next_group[g] = first_ready[sigs.of[v]];
      first_ready[sigs.of[v]] = g;
    }
    if (h > top[g]) {
      top[g] = h;
      candidates.push(key_of(h, g));
    }
    slots[begin[g] + filled[g]++] = v;
    ++n_ready;
    if (filled[g] == groups.size[g]) complete.push(g);
  };
  for (Local v = 0; v < n; ++v)
    if (waiting[v] == 0) make_ready(v);
  Plan plan;
  plan.order.reserve(n);
  // Without a limit there is nothing to stop for (and groups.brank may not be computed).
  std::optional<LaunchesLeft> left;
  if (limit != INT64_MAX) left.emplace(groups.brank, sigs, flags);
  while (n_ready > 0) {
    i64 g;
    if (!complete.empty()) {
      g = complete.top();
      complete.pop();
      if (filled[g] == taken[g]) continue;  // merged into an earlier launch
    } else {
      for (;; candidates.pop()) {
        g = n_groups - 1 - candidates.top() % n_groups;
        if (filled[g] > taken[g] && candidates.top() == key_of(top[g], g)) break;
      }
      candidates.pop();
    }
    Local* batch = &slots[begin[g] + taken[g]];
    std::size_t size = static_cast<std::size_t>(filled[g] - taken[g]);
    taken[g] = filled[g];
    top[g] = -1;
    if (merge) {
      merged.assign(batch, batch + size);
      const std::int32_t s = sigs.of[batch[0]];
      for (i64 other = first_ready[s]; other >= 0; other = next_group[other]) {
        merged.insert(merged.end(), &slots[begin[other] + taken[other]],
                      &slots[begin[other] + filled[other]]);
        taken[other] = filled[other];
        top[other] = -1;
      }
      first_ready[s] = -1;
      batch = merged.data();
      size = merged.size();
    }
    n_ready -= static_cast<i64>(size);
    plan.add(batch, size, !flags[sigs.of[batch[0]]].leaf);
    if (left) left->ran(batch, size);
    if (left && plan.launches + left->value() >= limit) {
      plan.launches = limit;
      break;
    }
    for (std::size_t i = 0; i < size; ++i)
      for (i64 e = edges.consumers_ptr[batch[i]]; e < edges.consumers_ptr[batch[i] + 1]; ++e)
        if (--waiting[edges.consumers[e]] == 0) make_ready(edges.consumers[e]);
  }
  return plan;
}

// A plan built from the end of the forward back, in forward order: one batch per leaf
// signature (leaves need nothing), then its batches last to first.
Plan reversed_after_leaves(const Plan& backward, const Nodes& nodes, const Signatures& sigs,
                           const std::vector<OpFlags>& flags) {
  Plan plan;
  plan.order.reserve(nodes.n);
  std::vector<Local> leaves;
  for (Local v = 0; v < nodes.n; ++v)
    if (flags[sigs.of[v]].leaf) leaves.push_back(v);
  leaves = counting_sort(leaves, sigs.count(), [&](Local v) { return sigs.of[v]; });
  for (std::size_t i = 0, j = 0; i < leaves.size(); i = j) {
    while (j < leaves.size() && sigs.of[leaves[j]] == sigs.of[leaves[i]]) ++j;
    plan.add(&leaves[i], j - i, false);
  }
  for (std::size_t b = backward.ends.size(); b-- > 0;) {
    const Local first = b ? backward.ends[b - 1] : 0;
    plan.add(&backward.order[first], static_cast<std::size_t>(backward.ends[b] - first), true);
  }
  return plan;
}

// How `list_schedule` ranks the signatures with ready nodes, from the heights (longest path
// to the end of the forward) of their ready nodes.
enum class Priority {
  highest,      // the highest ready node, then the most ready nodes: the critical path
  highest_sum,  // the highest ready node's height plus the number of ready nodes
  squares,      // the sum of the squared heights: many long paths, each weighed by its length
};

// A random-looking word per node (splitmix64); a set of nodes run is fingerprinted by their sum.
std::uint64_t fingerprint_of(Local v) {
  std::uint64_t z = static_cast<std::uint64_t>(v) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Up to this many signatures, a list schedule picks by scanning the signatures with ready nodes
// instead of keeping a heap of them: fewer instructions per pick on the small forwards where
// `auto` runs many list schedules (the climb).
constexpr std::size_t kScanSignatures = 64;

// A list scheduler over signatures rather than (signature, rank) groups: a launch of signature
// s takes EVERY ready node of s (more computed nodes never delay a later launch, so an optimal
// schedule exists among these), and the only choice is which signature runs next.
//
// One rule is exact: when every node of s not yet run is ready, launching s now is in some
// optimal schedule (an optimal one runs those nodes in later launches of s; one launch of all
// of them now instead makes every input available as early or earlier, and the later launches
// of s are then empty). Such signatures run first (leaves, which launch nothing, among them).
// Otherwise `priority` picks. Against the exact optimum (bench/optimum.py) on small graphs,
// the critical path with this rule comes closer than the ranked agenda's rule of complete
// groups first on mixed-operator DAGs (random-dag), and the other two priorities on
// shift-reduce stacks (spinn); `auto` keeps whichever launches least.
//
// `productive_first`: signatures whose launch lowers LaunchesLeft's bound go before the rest
// (each group in `priority`'s order). A launch of s lowers s's bound iff it takes every node of
// s not yet run at the highest backward rank left (the first nodes of the longest paths of
// s-nodes still to run); any other launch leaves the launches still needed as they were, one
// launch spent: so the rule is the A* search's (bench/optimum.py) greedy step, a launch that
// keeps launches + bound where it was before one that raises it. What it fixes: the critical
// path runs a signature as soon as any node of it is ready and the longest paths after it
// still wait (spinn's final classifier for 17 instances of 20, then again for the last 3); a
// launch that does not shorten them waits for one that does. Over the 162 graphs of
// scripts/auto_launches.py, each forward list schedule by itself as a further candidate:
// 9,863 -> 9,859 (critical path), 9,846 (squared heights), 9,847 (height plus ready nodes);
// all of them, forward and backward: 9,829 (spinn x20 seed 1 106 -> 101, mixed-op-tree x20
// seed 0 55 -> 52).
//
// `backward`: the same over the forward with its edges turned around and its leaves left out,
// from the nodes nothing reads back to the leaves' consumers; the launches read backwards are a
// schedule of the forward (a launch's nodes still never depend on each other, and every input
// runs in an earlier launch), after one batch per leaf signature. `height` is then the longest
// path from a leaf. Where the forward's list schedules lose launches by running the early
// nodes of a signature too soon (an outer RNN step of hierarchical-rnn before the inner steps
// of every sentence are done), the reversed one lines up the ends instead (119 -> 114
// launches, the tight bound).
//
// Cost: each node joins its signature's ready list once and pushes one heap entry (an entry
// whose key is no longer its signature's is skipped): O((nodes + edges) + nodes log nodes). Over
// at most kScanSignatures signatures a pick scans them instead: O(signatures) per pick.
//
// The state of a run is a copyable object, so that `climb` can try another choice from the
// middle of a run without repeating its beginning.
class ListRun {
 public:
  ListRun(const Nodes& nodes, const Groups& groups, const Edges& edges, const Signatures& sigs,
          const std::vector<OpFlags>& flags, const std::vector<std::int32_t>& height,
          Priority priority, bool backward, bool productive_first = false)
      : nodes_(&nodes), edges_(&edges), sigs_(&sigs), flags_(&flags), height_(&height),
        priority_(priority), backward_(backward), productive_first_(productive_first),
        waiting_(edges.inputs),
        left_(groups.nodes_of), slots_(nodes.n), begin_(sigs.count(), 0),
        filled_(sigs.count(), 0), taken_(sigs.count(), 0), top_(sigs.count(), -1),
        key_(sigs.count(), 0.0), scan_(sigs.count() <= kScanSignatures),
        is_dirty_(sigs.count(), 0),
        launches_left_(backward ? groups.rank : groups.brank, sigs, flags),
        ready_at_top_(productive_first ? sigs.count() : 0, 0),
        bonus_(productive_first ? sigs.count() : 0, 0) {
    const Local n = nodes.n;
    const double n1 = static_cast<double>(nodes.n) + 2;
    productive_bonus_ = n1 * n1 * n1;  // above any key
    if (backward)
      for (Local v = 0; v < n; ++v)
        waiting_[v] = static_cast<Local>(edges.consumers_ptr[v + 1] - edges.consumers_ptr[v]);
    std::partial_sum(left_.begin(), left_.end() - 1, begin_.begin() + 1);
    plan.order.reserve(n);
    for (Local v = 0; v < n; ++v)
      if (waiting_[v] == 0 && runs(v)) make_ready(v);
  }

  Plan plan;
  i64 choices = 0;                 // picks made by priority so far
  std::uint64_t fingerprint = 0;   // of the nodes run, when `fingerprinted` (see Steering)
  bool fingerprinted = false;      // only the climb reads fingerprints

  // A signature all of whose nodes not yet run are ready, or -1.
  std::int32_t all_ready() {
    while (!safe_.empty()) {
      const std::int32_t t = safe_.back();
      safe_.pop_back();
      if (filled_[t] > taken_[t]) return t;  // else already run
    }
    return -1;
  }

  // The signature `priority` ranks first (with `second`, second when there is one), or -1
  // when no node is ready. Counts a choice. With `second` and `hold`, the best is also held
  // back at later picks (the second best runs instead) until a node of it becomes ready or it
  // runs (all its nodes ready, or nothing else ready): a climb's flip that waits for the node
  // that would have joined the launch (see climb).
  std::int32_t by_priority(bool second, bool hold = false) {
    if (!holding()) held_ = -1;
    if (scan_) return by_scan(second, hold);
    for (std::int32_t t : dirty_) {
      is_dirty_[t] = 0;
      if (filled_[t] > taken_[t]) by_key_.emplace(key_[t], -t);
    }
    dirty_.clear();
    std::int32_t s = pop_valid();
    if (s < 0) return s;
    if (second || s == held_)
      if (const std::int32_t other = pop_valid(); other >= 0) {
        by_key_.emplace(key_[s], -s);  // the best waits for a later pick
        if (second && hold) hold_back(s);
        s = other;
      }
    ++choices;
    return s;
  }

  // Whether a signature is held back (by_priority's `hold`): no node of it became ready since,
  // and it has not run.
  bool holding() const {
    return held_ >= 0 && filled_[held_] == held_filled_ && filled_[held_] > taken_[held_];
  }

  // Runs every ready node of s as one batch; returns the launches still needed at least
  // (LaunchesLeft).
  i64 launch(std::int32_t s) {
    Local* batch = &slots_[begin_[s] + taken_[s]];
    const auto size = static_cast<std::size_t>(filled_[s] - taken_[s]);
    taken_[s] = filled_[s];
    left_[s] -= static_cast<Local>(size);
    key_[s] = 0.0;
    top_[s] = -1;
    if (productive_first_) ready_at_top_[s] = bonus_[s] = 0;
    plan.add(batch, size, !(*flags_)[s].leaf);
    launches_left_.ran(batch, size);
    for (std::size_t i = 0; i < size; ++i) {
      if (fingerprinted) fingerprint += fingerprint_of(batch[i]);
      if (backward_)
        for_each_input(*nodes_, batch[i], [&](Local u) {
          if (--waiting_[u] == 0 && runs(u)) make_ready(u);
        });
      else
        for (i64 e = edges_->consumers_ptr[batch[i]]; e < edges_->consumers_ptr[batch[i] + 1]; ++e)
          if (--waiting_[edges_->consumers[e]] == 0) make_ready(edges_->consumers[e]);
    }
    return launches_left_.value();
  }

 private:
  bool runs(Local v) const { return !backward_ || !(*flags_)[sigs_->of[v]].leaf; }

  void make_ready(Local v) {
    const std::int32_t s = sigs_->of[v];
    slots_[begin_[s] + filled_[s]++] = v;
    const double h = (*height_)[v];
    top_[s] = std::max(top_[s], (*height_)[v]);
    const double count = static_cast<double>(filled_[s] - taken_[s]);
    switch (priority_) {
      case Priority::highest:
        key_[s] = top_[s] * (static_cast<double>(nodes_->n) + 1) + count;
        break;
      case Priority::highest_sum: key_[s] = top_[s] + count; break;
      case Priority::squares: key_[s] += h * h + 1; break;
    }
    if (productive_first_) {
      if (launches_left_.level(v) == launches_left_.top(s)) ++ready_at_top_[s];
      if (priority_ != Priority::squares) bonus_[s] = 0;
      if (!bonus_[s] && ready_at_top_[s] == launches_left_.at_top(s)) {
        bonus_[s] = 1;
        key_[s] += productive_bonus_;
      }
    }
    if (filled_[s] - taken_[s] == left_[s]) {
      safe_.push_back(s);  // every node of s not yet run is ready
    } else if (!is_dirty_[s]) {
      is_dirty_[s] = 1;
      dirty_.push_back(s);
    }
  }

  // by_priority over few signatures: `dirty_` lists every signature that may have ready nodes
  // (make_ready adds it, this drops it once it has none), scanned for the two best keys (ties:
  // the lower signature, as the heap's order).
  std::int32_t by_scan(bool second, bool hold) {
    std::int32_t best = -1, next = -1;
    auto ahead = [&](std::int32_t a, std::int32_t b) {
      return b < 0 || key_[a] > key_[b] || (key_[a] == key_[b] && a < b);
    };
    for (std::size_t i = 0; i < dirty_.size();) {
      const std::int32_t t = dirty_[i];
      if (filled_[t] == taken_[t]) {  // run since it was listed
        is_dirty_[t] = 0;
        dirty_[i] = dirty_.back();
        dirty_.pop_back();
        continue;
      }
      if (ahead(t, best)) {
        next = best;
        best = t;
      } else if (ahead(t, next)) {
        next = t;
      }
      ++i;
    }
    if (best < 0) return best;
    ++choices;
    if (next < 0 || !(second || best == held_)) return best;
    if (second && hold) hold_back(best);
    return next;
  }

  void hold_back(std::int32_t s) {
    held_ = s;
    held_filled_ = filled_[s];
  }

  std::int32_t pop_valid() {
    while (!by_key_.empty()) {
      const auto [k, minus] = by_key_.top();
      by_key_.pop();
      if (filled_[-minus] > taken_[-minus] && k == key_[-minus]) return -minus;
    }
    return -1;
  }

  const Nodes* nodes_;
  const Edges* edges_;
  const Signatures* sigs_;
  const std::vector<OpFlags>* flags_;
  const std::vector<std::int32_t>* height_;
  Priority priority_;
  bool backward_;
  // Signatures whose launch lowers the launches still needed (LaunchesLeft) go first: their
  // keys hold productive_bonus_, above any key of `priority`.
  bool productive_first_;
  std::vector<Local> waiting_;  // per node: inputs (consumers, backward) not yet run
  // Per signature: its nodes not yet run, its ready nodes (a contiguous range of `slots_` per
  // signature, filled in the order they become ready: begin + taken .. begin + filled), the
  // height of its highest ready node and its key.
  std::vector<Local> left_, slots_;
  std::vector<i64> begin_, filled_, taken_;
  std::vector<std::int32_t> top_;
  std::vector<double> key_;
  // Signatures whose key changed since the last pick are pushed once, at the next pick: an
  // entry per launch and signature, not per node. An entry whose key is stale is skipped. With
  // `scan_` (at most kScanSignatures signatures) there is no heap: see by_scan.
  bool scan_;
  std::vector<std::int32_t> dirty_, safe_;
  std::vector<std::uint8_t> is_dirty_;  // bytes: a vector<bool>'s bit arithmetic costs more
  std::priority_queue<std::pair<double, std::int32_t>> by_key_;  // (key, -signature)
  LaunchesLeft launches_left_;
  std::vector<Local> ready_at_top_;  // per signature: ready nodes at LaunchesLeft's top level
  std::vector<std::uint8_t> bonus_;  // per signature: its key holds productive_bonus_
  double productive_bonus_ = 0;
  std::int32_t held_ = -1;  // the signature held back, if any, and its ready count then
  i64 held_filled_ = 0;
};

// What `climb` steers and reads of a run (forward runs only). `flips` (ascending): choices
// (picks by priority, counted from the run's start) that take the second-best signature.
// `choices`: per choice, the index of its batch in the plan. `trail`: fingerprints of sets of
// nodes run by earlier complete runs past their last flip, each with the launches those runs
// still made from there. Past its last flip, a run's next steps depend only on the set of
// nodes run (up to the order of signatures that became all-ready together), so a run that
// meets a fingerprint of the trail ends with its launches so far plus the trail's: it stops
// once that cannot beat the limit.
struct Steering {
  std::vector<i64> flips;
  bool hold = false;
  std::vector<Local> choices;
  std::unordered_map<std::uint64_t, i64> trail;
  std::vector<std::pair<std::uint64_t, i64>> passed;  // finish's, kept to reuse its memory
};

// Runs `run` to its end (or its limit, as list_schedule's), as `steer` says; a complete run
// past its last flip adds its fingerprints to the trail. Returns the run's plan, moved out.
// `choices` (without `steer`, which has its own): gets Steering's `choices` of the run.
Plan finish(ListRun& run, i64 limit, Steering* steer = nullptr,
            std::vector<Local>* choices = nullptr) {
  std::vector<std::pair<std::uint64_t, i64>> unsteered;
  auto& passed = steer ? steer->passed : unsteered;  // fingerprint, launches so far
  passed.clear();
  if (steer) choices = &steer->choices;
  std::size_t next_flip = 0;
  if (steer)
    while (next_flip < steer->flips.size() && steer->flips[next_flip] < run.choices) ++next_flip;
  while (true) {
    std::int32_t s = run.all_ready();
    if (s < 0) {
      const bool flip = steer && next_flip < steer->flips.size() &&
                        steer->flips[next_flip] == run.choices;
      const bool hold = flip && steer->hold;
      next_flip += flip;
      if (choices) choices->push_back(static_cast<Local>(run.plan.ends.size()));
      s = run.by_priority(flip, hold);
      if (s < 0) {
        if (choices) choices->pop_back();
        break;  // nothing ready: all nodes run
      }
    }
    if (run.plan.launches + run.launch(s) >= limit) {
      run.plan.launches = limit;
      return std::move(run.plan);
    }
    if (steer && next_flip == steer->flips.size() && !run.holding()) {
      const auto met = steer->trail.find(run.fingerprint);
      if (met != steer->trail.end() && run.plan.launches + met->second >= limit) {
        run.plan.launches = limit;  // as over the limit
        return std::move(run.plan);
      }
      passed.emplace_back(run.fingerprint, run.plan.launches);
    }
  }
  if (steer)
    for (const auto& [print, launches] : passed) {
      const auto [it, fresh] = steer->trail.emplace(print, run.plan.launches - launches);
      if (!fresh) it->second = std::min(it->second, run.plan.launches - launches);
    }
  return std::move(run.plan);
}

Plan list_schedule(const Nodes& nodes, const Groups& groups, const Edges& edges,
                   const Signatures& sigs, const std::vector<OpFlags>& flags,
                   const std::vector<std::int32_t>& height, Priority priority,
                   bool backward = false, i64 limit = INT64_MAX,
                   std::vector<Local>* choices = nullptr, bool productive_first = false) {
  ListRun run(nodes, groups, edges, sigs, flags, height, priority, backward, productive_first);
  Plan plan = finish(run, limit, nullptr, choices);
  if (!backward || plan.launches >= limit) return plan;  // stopped at the limit: incomplete
  return reversed_after_leaves(plan, nodes, sigs, flags);
}

// An improvement pass over the critical-path list schedule, for the graphs where no schedule
// above reached the lower bound: a hill climb over its choices, each step re-running the
// schedule with one more choice flipped to the second-best signature and keeping the flip if
// the schedule launches less.
//
// Only choices that split a group are flipped: a launch of s at choice i whose batch's lowest
// rank r is matched or undercut by a node of a later launch of s. That node (rank <= r) cannot
// depend on any node of the batch (each of those has rank >= r, and a path from one would give
// it a higher rank), so it could have run with the batch had s waited; running s now costs a
// launch of s later. On mixed-operator trees, for example, the critical path runs the `concat`
// of pairs whose other inputs are still a few ops away and splits it. Choices are tried in
// order, each once (the schedule before a flipped choice does not change, so earlier choices
// stay as they were): at most one run per split choice, each resumed from a copy of the run
// at that choice, not started over, and stopped early when it meets the trail (Steering).
//
// Bench quality's graphs (20 instances, seed 0): skip-chain 64 -> 58 launches (the lower
// bound), random-dag 38 -> 36, mixed-op-tree 59 -> 57, message-passing 43 -> 42. Cost: the run
// followed once (the list schedule itself is not run again where fewest_launches hands over
// its plan and choices), and per flip a copy of its state and the rest of a run, stopped once it
// cannot beat the schedule so far. The flips' work (nodes copied and run) may reach
// kClimbStart per node and edge of the forward, and kClimbGain more after each flip that
// gained: a climb that finds nothing stops after a few list schedules' worth, one that gains
// goes on. Over random-dag, spinn, mixed-op-tree, skip-chain and the three newest families at
// 8, 20 and 40 instances, seeds 0-2: 3,326 launches without the climb, 3,250 with it (a fixed
// budget of 3 / 6 / 8 / 10 per node and edge: 3,292 / 3,275 / 3,253 / 3,245).
// `hold`: each flip instead holds the signature back until a node of it becomes ready
// (ListRun::by_priority), where a second-best flip takes the signature one pick later: on a
// child-sum Tree-LSTM cell, the critical path runs the forget gate's f * c as soon as f is
// ready and the input gate's i * u one launch later, after tanh(u); one flip that runs
// something else first does not help (the next pick takes the product again), holding the
// product until i * u is ready does (33 -> 32 launches, the optimum). The two kinds of flips
// gain on different graphs and share a budget badly (each spends it on choices where the
// other would have gained); since the list schedules run productive signatures first
// (ListRun), `fewest_launches` runs only climbs that hold back: the second-best flips no
// longer lowered any of the 162 graphs of scripts/auto_launches.py that the rest did not.
// `productive`: the run climbed is ListRun's `productive_first` one.
//
// Forwards of more than kClimbSize nodes and edges skip the climb: its work grows with the
// forward and the launches it saves do not (random-dag at 200 instances, 4.6k nodes: 51 -> 50
// launches for about +1.3 us/node of scheduling; at 2,000, 47k nodes: 65 -> 59 for +2.3).
constexpr i64 kClimbFlips = 32;  // flips tried at most
constexpr i64 kClimbStart = 4;
constexpr i64 kClimbGain = 4;
constexpr i64 kClimbSize = i64{1} << 13;

// Which choices of `plan` split a group (see above): per choice, whether its launch does.
std::vector<bool> split_choices(const Plan& plan, const std::vector<Local>& choices,
                                const Groups& groups, const Signatures& sigs) {
  // Per batch its lowest rank, and per signature the lowest rank of its later launches.
  const std::size_t batches = plan.ends.size();
  std::vector<std::int32_t> later_low(sigs.count(), INT32_MAX), low(batches, INT32_MAX),
      low_after(batches);
  for (std::size_t b = batches; b-- > 0;) {
    const Local first = b ? plan.ends[b - 1] : 0;
    for (Local i = first; i < plan.ends[b]; ++i)
      low[b] = std::min(low[b], groups.rank[plan.order[i]]);
    const std::int32_t s = sigs.of[plan.order[first]];
    low_after[b] = later_low[s];
    later_low[s] = std::min(later_low[s], low[b]);
  }
  std::vector<bool> split(choices.size());
  for (std::size_t c = 0; c < choices.size(); ++c)
    split[c] = low_after[choices[c]] <= low[choices[c]];
  return split;
}

// The trail (Steering) of a complete run without flips, read off its plan: after each launch,
// the fingerprint of the nodes run so far and the launches the run made after it.
std::unordered_map<std::uint64_t, i64> trail_of(const Plan& plan, const Signatures& sigs,
                                                const std::vector<OpFlags>& flags) {
  std::unordered_map<std::uint64_t, i64> trail;
  std::uint64_t print = 0;
  i64 launches = 0;
  for (std::size_t b = 0; b < plan.ends.size(); ++b) {
    const Local first = b ? plan.ends[b - 1] : 0;
    for (Local i = first; i < plan.ends[b]; ++i) print += fingerprint_of(plan.order[i]);
    launches += !flags[sigs.of[plan.order[first]]].leaf;
    trail.emplace(print, plan.launches - launches);  // a repeated print keeps its first, least
  }
  return trail;
}

// `start`: the plan of the list schedule by `priority` and its choices (Steering's), when the
// caller has them; otherwise the climb runs it first.
Plan climb(const Nodes& nodes, const Groups& groups, const Edges& edges, const Signatures& sigs,
           const std::vector<OpFlags>& flags, const std::vector<std::int32_t>& height,
           Priority priority, const Plan* start, const std::vector<Local>& start_choices,
           bool hold = false, bool productive = false) {
  const i64 size = static_cast<i64>(nodes.n) + static_cast<i64>(edges.consumers.size());
  i64 budget = kClimbStart * size, work = 0;
  Steering steer;
  steer.hold = hold;
  // Follows `plan`.
  ListRun at(nodes, groups, edges, sigs, flags, height, priority, false, productive);
  at.fingerprinted = true;
  ListRun trial = at;  // a flipped run; assigned from `at`, reusing its memory
  Plan plan;
  std::vector<Local> choices;
  if (start) {
    plan = *start;
    choices = start_choices;
    steer.trail = trail_of(plan, sigs, flags);
  } else {
    plan = finish(trial, INT64_MAX, &steer);
    choices = std::move(steer.choices);
  }
  std::vector<bool> split = split_choices(plan, choices, groups, sigs);
  i64 after = -1;
  for (i64 flip = 0; flip < kClimbFlips && work < budget && plan.launches > groups.bound; ++flip) {
    do ++after; while (after < static_cast<i64>(split.size()) && !split[after]);
    if (after == static_cast<i64>(split.size())) break;
    // Bring `at` to choice `after` of the plan (its flips all come before).
    for (std::size_t f = 0; true;) {
      std::int32_t s = at.all_ready();
      if (s < 0) {
        if (at.choices == after) break;
        while (f < steer.flips.size() && steer.flips[f] < at.choices) ++f;
        const bool flip = f < steer.flips.size() && steer.flips[f] == at.choices;
        s = at.by_priority(flip, flip && steer.hold);
      }
      at.launch(s);
    }
    steer.flips.push_back(after);
    steer.choices.assign(choices.begin(), choices.begin() + after);
    trial = at;
    Plan tried = finish(trial, plan.launches, &steer);
    work += nodes.n + static_cast<i64>(tried.order.size() - at.plan.order.size());
    if (tried.launches < plan.launches) {
      std::swap(plan, tried);
      std::swap(choices, steer.choices);
      split = split_choices(plan, choices, groups, sigs);
      budget += kClimbGain * size;
    } else {
      steer.flips.pop_back();
    }
    // The plan left over goes back to `trial`: the next `trial = at` copies into its vectors
    // instead of allocating them and regrowing them as the run goes.
    trial.plan = std::move(tried);
  }
  return plan;
}

// Forward-backward compaction of a complete plan (the justification of project scheduling):
// its launches' signatures kept as a word, in order, every node moved to the LAST launch of its
// signature before its first consumer's (backward, consumers first), launches left empty
// dropped; then every node to the FIRST launch of its signature after its last input's
// (forward), empties dropped again; rounds until one drops nothing (at most kCompactRounds).
// Each pass keeps every node after its inputs and in a launch of its own signature (the
// backward pass moves a node no earlier, so the latest launch before its consumers exists; the
// forward pass likewise no later), so the plan stays valid and never gains a launch. What it
// finds: a launch whose nodes can all wait for (or all run at) another launch of their
// signature once the rest of the word is fixed, which the list schedules and their climbs,
// deciding launch by launch, miss. Over the 162 graphs of scripts/auto_launches.py, on `auto`'s
// final plan: 9,807 -> 9,794 launches, 10 graphs lower (spinn x20 seed 1 101 -> 100,
// mixed-op-tree x20 seed 0 52 -> 51, x40 seed 2 56 -> 52), none higher, for 2-5% of the
// scheduling time of the forwards it runs on.
// Cost per round: nodes + edges + launches x signatures (the tables of the last / first launch
// of each signature before / after each launch).
constexpr int kCompactRounds = 8;
// A forward whose launches x signatures pass this many per node and edge is not compacted (a
// graph of thousands of signatures would pay for tables that are mostly empty).
constexpr i64 kCompactTable = 16;

Plan compacted(const Plan& plan, const Nodes& nodes, const Edges& edges, const Signatures& sigs,
               const std::vector<OpFlags>& flags) {
  const Local n = nodes.n;
  const auto n_sigs = static_cast<std::int32_t>(sigs.count());
  std::vector<std::int32_t> word;        // per launch: its signature
  std::vector<std::int32_t> pos(n, -1);  // per node: its launch (leaves: -1, before all)
  for (std::size_t b = 0; b < plan.ends.size(); ++b) {
    const Local first = b ? plan.ends[b - 1] : 0;
    const std::int32_t s = sigs.of[plan.order[first]];
    if (flags[s].leaf) continue;
    for (Local i = first; i < plan.ends[b]; ++i)
      pos[plan.order[i]] = static_cast<std::int32_t>(word.size());
    word.push_back(s);
  }
  std::vector<std::int32_t> table, count, renumber;
  auto drop_empty = [&]() {  // whether a launch was empty
    const auto launches = static_cast<std::int32_t>(word.size());
    count.assign(launches, 0);
    for (Local v = 0; v < n; ++v)
      if (pos[v] >= 0) ++count[pos[v]];
    renumber.assign(launches, -1);
    std::int32_t kept = 0;
    for (std::int32_t k = 0; k < launches; ++k)
      if (count[k] > 0) {
        renumber[k] = kept;
        word[kept++] = word[k];
      }
    if (kept == launches) return false;
    word.resize(kept);
    for (Local v = 0; v < n; ++v)
      if (pos[v] >= 0) pos[v] = renumber[pos[v]];
    return true;
  };
  for (int round = 0; round < kCompactRounds; ++round) {
    bool dropped = false;
    // Backward: table[p * n_sigs + s] = the last launch of s before launch p.
    auto launches = static_cast<std::int32_t>(word.size());
    table.assign(static_cast<std::size_t>(launches + 1) * n_sigs, -1);
    for (std::int32_t p = 1; p <= launches; ++p) {
      std::copy_n(&table[(p - 1) * n_sigs], n_sigs, &table[p * n_sigs]);
      table[p * n_sigs + word[p - 1]] = p - 1;
    }
    for (Local v = n - 1; v >= 0; --v) {
      if (pos[v] < 0) continue;
      std::int32_t limit = launches;
      for (i64 e = edges.consumers_ptr[v]; e < edges.consumers_ptr[v + 1]; ++e)
        limit = std::min(limit, pos[edges.consumers[e]]);
      pos[v] = table[limit * n_sigs + sigs.of[v]];
    }
    dropped |= drop_empty();
    // Forward: table[p * n_sigs + s] = the first launch of s at or after launch p.
    launches = static_cast<std::int32_t>(word.size());
    table.assign(static_cast<std::size_t>(launches + 1) * n_sigs, -1);
    for (std::int32_t p = launches - 1; p >= 0; --p) {
      std::copy_n(&table[(p + 1) * n_sigs], n_sigs, &table[p * n_sigs]);
      table[p * n_sigs + word[p]] = p;
    }
    for (Local v = 0; v < n; ++v) {
      if (pos[v] < 0) continue;
      std::int32_t after = 0;
      for_each_input(nodes, v, [&](Local u) { after = std::max(after, pos[u] + 1); });
      pos[v] = table[after * n_sigs + sigs.of[v]];
    }
    dropped |= drop_empty();
    if (!dropped) break;
  }
  // Leaves first, a batch per signature, then the launches.
  Plan out;
  out.order.reserve(n);
  std::vector<Local> leaves, kernels;
  for (Local v = 0; v < n; ++v) (pos[v] < 0 ? leaves : kernels).push_back(v);
  leaves = counting_sort(leaves, sigs.count(), [&](Local v) { return sigs.of[v]; });
  for (std::size_t i = 0, j = 0; i < leaves.size(); i = j) {
    while (j < leaves.size() && sigs.of[leaves[j]] == sigs.of[leaves[i]]) ++j;
    out.add(&leaves[i], j - i, false);
  }
  kernels = counting_sort(kernels, word.size(), [&](Local v) { return pos[v]; });
  for (std::size_t i = 0, j = 0; i < kernels.size(); i = j) {
    while (j < kernels.size() && pos[kernels[j]] == pos[kernels[i]]) ++j;
    out.add(&kernels[i], j - i, true);
  }
  return out;
}

// With one depth per signature no path holds two nodes of one signature: every group is a
// whole signature, and batching by (depth, signature) runs each as one batch, far cheaper
// than the agenda. Typical of the small incremental forwards of one step of many instances.
bool one_depth_per_signature(const Nodes& nodes, const Signatures& sigs) {
  for (Local v = 0; v < nodes.n; ++v)
    if (nodes.depth[v] != nodes.depth[sigs.first[sigs.of[v]]]) return false;
  return true;
}

// The fewest launches among several schedules, each linear in nodes + edges (the list
// schedules: nodes log nodes): the ranked agenda with its critical-path fallback, merging
// groups; the signature list schedules that run productive signatures first (ListRun; by
// critical path, squared heights, height plus ready nodes, then the first two built
// backwards); the depth rule; the agenda; the depth rule's latest-possible twin; on small
// forwards, climbs that hold a signature back (see climb) from the winning list schedule, then
// from the productive ones by critical path and by height plus ready nodes and the plain one
// by height plus ready nodes. The first to reach the groups' lower bound ends the search (the
// first alone does on every tree family of bench/workloads.py); otherwise the fewest launches
// win (the earliest on ties), so `auto` is never worse than `depth` or `agenda` on any graph;
// the winner is then compacted (`compacted`). A candidate stops as soon as its launches and
// those it still needs (LaunchesLeft) reach the best so far (it cannot win), so the losers
// cost a fraction of a run.
//
// Issue 12 (this list, against the one below): over the 162 graphs of scripts/auto_launches.py
// 9,863 -> 9,807 launches before compaction, 9,794 after, none higher; bench quality's 20
// instances, seed 0: random-dag 36 -> 34 (the A* optimum), mixed-op-tree 55 -> 51 (optimum 50),
// spinn 106 -> 102 (optimum 100). Scheduling time (the core's call, min of 21): random-dag 0.67 ->
// 0.71 us/node, spinn 0.54 -> 0.53, mixed-op-tree 0.45 -> 0.44, calculator 0.31 -> 0.31, skip-chain
// 0.14 -> 0.15; where no candidate meets the lower bound on a larger forward, the productive list
// schedules cost more than the plain ones (a better schedule runs longer before the limit stops
// it): bahdanau-attention 0.16 -> 0.20, hierarchical-rnn 0.10 -> 0.13, child-sum-treelstm 0.13 ->
// 0.15; message-passing 0.12 -> 0.06. The Tree-LSTM benchmark's torch-native and fb-unfused
// forwards (40-46k nodes, above the lower bound): 204.5 -> 183.5 and 199 -> 180 launches per
// minibatch, 0.17 -> 0.18 us/node of scheduling, 5-10% more trees per second. The productive list
// schedules start the climbs nearer, and the plain list schedules, the second-best climb and the
// hold climbs from the plain critical path and squared heights are gone. Other graphs (the 18
// families at 3, 5, 12 and 30 instances, seeds 3-5): 11,718 -> 11,665, 25 lower, 1 higher
// (skip-chain x30 seed 5 61 -> 62); 2-6 instances, seeds 0-9, of random-dag, spinn, mixed-op-tree,
// calculator, skip-chain against the A* optimum (7,775): 7,866 -> 7,814, at the optimum on 176 of
// 200 graphs (153 before), 5 higher by 1-2; 20,000 random programs of 8-40 steps (the tests' random
// graphs): 280,581 -> 280,493, 5 higher by 1. Tried: all of the old and new candidates and climbs
// together (9,806, for 1.4x random-dag's scheduling time); productive list schedules with the old
// climbs (9,815-9,825 with cheaper climbs, some graphs higher); flipping only the choices whose
// launch did not lower the bound (9,815, 4 higher); compacting every climb's result rather than the
// winner's (9,789 for +10-20% scheduling time).
//
// Before issue 12 (the plain list schedules by critical path, the same backwards, squared
// heights, height plus ready nodes; depth; agenda; latest depth; squared heights backwards;
// the second-best climb; hold climbs from the winner and the three forward list schedules):
// Which wins where (20 instances, seed 0): the list schedule by critical path on random-dag
// (45 -> 38 launches) and calculator (28 -> 27, the tight bound: optimal), built backwards on
// hierarchical-rnn (119 -> 114, the tight bound), by squared heights on spinn (117 -> 106);
// the first on the tree families. Over 774 graphs (the 15 families at 2-32 instances, seeds
// 0-3) the ranked agenda with DyNet's fallback (merging or not) and with the critical-path
// fallback without merging never launched fewer than all of these, so `auto` no longer tries
// them (the agenda's own schedule stays, for the guarantee). Last, on small forwards, the climb
// over the winning list schedule's choices that split a group (skip-chain 64 -> 58, the bound),
// then, if still above the bound, climbs whose flips hold a signature back (see climb) from
// each forward list schedule in turn, the winner first: the climb's result depends on where
// it starts (a list schedule that loses by a few launches may climb lower). Over the 162 graphs
// of scripts/auto_launches.py 9,905 -> 9,863 launches (mixed-op-tree x20 seed 0 57 -> 55, x40
// 58 -> 52; spinn x40 seed 2 109 -> 104; random-dag x40 45 -> 42), none higher (a candidate
// replaces the best only when it launches fewer). Cost, where the climbs run (no schedule met
// the bound on a small forward): it about doubles, bench quality's 20 instances random-dag 0.52
// -> 1.18 us/node, spinn 0.30 -> 0.67, calculator 0.39 -> 0.71, mixed-op-tree 0.35 -> 0.68
// (over all 162 graphs 0.13-0.15 -> 0.16-0.22); with a budget of 1 or 2 per node and edge per
// hold climb instead of kClimbStart, 9,881 or 9,873 launches, random-dag 0.88 or 1.00 us/node.
// On small graphs (2-4 instances, seeds
// 0-2) against the exact optimum: random-dag 202 -> 200 (the optimum, 200), spinn 606 -> 596
// (596), child-sum-treelstm 588 -> 587 (587), mixed-op-tree 237 -> 230 (224). Tried: both
// kinds of flips in the first climb, sharing its budget: 9,914, 10 graphs higher; one hold
// climb, from the winner only: 9,888.
//
// The backward schedule by squared heights lines up the ends of many long paths at once. It
// finds what a forward list schedule misses where an early node of one signature feeds a node
// of a signature that is ready beside it: x * y then (x * y) + (x * y) beside x + y, where
// running the product alone first lets its sum join the other sums (the forward schedules run
// the sums first, and split them). It comes after the depth rules, as it seldom wins: over 750
// small graphs (random-dag, mixed-op-tree, spinn, calculator, skip-chain at 2-6 instances,
// seeds 0-29) it lowered 25 (random-dag 3,680 -> 3,664 launches, mixed-op-tree 5,735 -> 5,716,
// spinn 11,387 -> 11,379), 6 of 20,000 random graphs of 6-16 operations, none raised.
Plan fewest_launches(const Nodes& nodes, const Signatures& sigs,
                     const std::vector<OpFlags>& flags) {
  if (one_depth_per_signature(nodes, sigs)) return by_key(nodes, sigs, flags, nodes.depth);
  Groups groups = groups_of(nodes, sigs, flags);
  const Edges edges(nodes);
  const i64 size = nodes.n + static_cast<i64>(edges.consumers.size());
  const bool small = size <= kClimbSize;  // the climbs run
  const std::vector<std::int32_t> height = heights_of(nodes);
  Plan best;
  // The (productive) forward list schedule that won, climbed first, and its choices; whether
  // `best` is its plan (else the climb runs it again). The critical path when none won.
  Priority best_list = Priority::highest;
  std::vector<Local> list_choices;
  bool best_is_list = false, won_by_list = false;
  auto list_won = [&](Priority priority) {
    std::vector<Local> choices;
    Plan plan = list_schedule(nodes, groups, edges, sigs, flags, height, priority, false,
                              best.launches, &choices, /*productive_first=*/true);
    if (plan.launches < best.launches) {
      best_list = priority;
      list_choices = std::move(choices);
      won_by_list = true;
    }
    return plan;
  };
  // The depths as the list schedules take them (a vector), copied once, by the first backward
  // list schedule that runs (most forwards end before either does).
  std::vector<std::int32_t> depth;
  auto depths = [&]() -> const std::vector<std::int32_t>& {
    if (depth.size() != static_cast<std::size_t>(nodes.n))
      depth.assign(nodes.depth, nodes.depth + nodes.n);
    return depth;
  };
  const std::function<Plan()> candidates[] = {
      [&] { return list_won(Priority::highest); },
      // These two, on small forwards only: on larger ones, where no climb runs, they never
      // launched fewer than the rest over the graphs of scripts/auto_launches.py.
      [&] { return small ? list_won(Priority::squares) : Plan{{}, {}, INT64_MAX}; },
      [&] { return small ? list_won(Priority::highest_sum) : Plan{{}, {}, INT64_MAX}; },
      [&] {
        return list_schedule(nodes, groups, edges, sigs, flags, depths(), Priority::highest,
                             /*backward=*/true, best.launches, nullptr, true);
      },
      [&] {
        return list_schedule(nodes, groups, edges, sigs, flags, depths(), Priority::squares,
                             /*backward=*/true, best.launches, nullptr, true);
      },
      [&] { return by_key_below(nodes, sigs, flags, nodes.depth, best.launches); },
      [&] {
        return ranked_agenda(nodes, groups, edges, sigs, flags, nullptr, false, best.launches);
      },
      [&] {
        return by_key_below(nodes, sigs, flags,
                            as_late_as_possible(nodes, sigs, flags, height).data(), best.launches);
      },
      [&] {
        if (!small) return Plan{{}, {}, INT64_MAX};
        Plan out{{}, {}, INT64_MAX};
        // The winner first (from its plan, when it is the best), then the others in turn; the
        // last runs signatures by priority alone.
        const std::pair<Priority, bool> starts[] = {{best_list, true},
                                                    {Priority::highest, true},
                                                    {Priority::highest_sum, true},
                                                    {Priority::highest_sum, false}};
        for (std::size_t i = 0; i < std::size(starts); ++i) {
          const auto [priority, productive] = starts[i];
          if (i > 0 && productive && priority == best_list) continue;  // climbed first
          const bool from_best = i == 0 && best_is_list;
          Plan plan = climb(nodes, groups, edges, sigs, flags, height, priority,
                            from_best ? &best : nullptr, list_choices, true, productive);
          if (plan.launches < out.launches) out = std::move(plan);
          if (out.launches == groups.bound) break;
        }
        return out;
      },
  };
  best = ranked_agenda(nodes, groups, edges, sigs, flags, &height, true);
  if (best.launches > groups.bound)
    groups.brank = backward_ranks_of(nodes, edges.consumers_ptr, edges.consumers, sigs, flags);
  for (const auto& candidate : candidates) {
    if (best.launches == groups.bound) break;
    won_by_list = false;
    Plan plan = candidate();  // stops at best.launches launches, incomplete, if it cannot win
    if (plan.launches < best.launches) {
      best = std::move(plan);
      best_is_list = won_by_list;
    }
  }
  if (best.launches > groups.bound &&
      best.launches * static_cast<i64>(sigs.count()) <= kCompactTable * size) {
    Plan plan = compacted(best, nodes, edges, sigs, flags);
    if (plan.launches < best.launches) best = std::move(plan);
  }
  return best;
}

// Nodes begin..end-1 of `all` (one forward) as a Nodes of their own: inputs from earlier
// forwards fall below its start and are left out, as computed values.
Nodes one_forward(const Nodes& all, i64 begin, i64 end) {
  Nodes part = all;
  part.start = all.start + begin;
  part.n = static_cast<Local>(end - begin);
  part.sig += begin;
  part.arg_ptr += begin;
  return part;
}

// ---- the tight bound: signatures whose order differs from path to path -------------------------
//
// A schedule is a sequence of launches, each of one signature. Its signatures, read in launch
// order, form a word Z, and for every path of the forward the signatures of its non-leaf nodes,
// in path order, form a subsequence of Z (each node runs in a later launch than its inputs).
// For a set B of signatures, Z restricted to B is a supersequence of every path's word
// restricted to B, and restrictions to disjoint sets are disjoint parts of Z: so the launches
// are at least the sum, over the blocks of any partition of the signatures, of a lower bound
// on the shortest common supersequence of the paths' words restricted to the block. A block of
// one signature s gives A_s, the most s-nodes on one path: `lower_bound`. The tight bound uses
// blocks of two: a matching of signatures, each pair (s, t) adding what its bound has over
// A_s + A_t.
//
// The pair bound. Let Z (now a word over {s, t}) hold a s's and b t's, and c(k) be the number
// of t's after its k-th s, non-increasing in k. Take an s-node v; on a path ending at v with
// the most s's, v is the f(v)-th s, and that path continued by a path from v with the most
// t's (a path still) has tafter(v) t's after v. Z places that path's s's at increasing s's of
// Z, v at its k-th s for some k >= f(v), and the t's after v at t's after that one:
//   (1) c(f(v)) >= c(k) >= tafter(v),
// hence c(k) >= H(k) = max{tafter(v) : f(v) >= k} for every k. Likewise, on a path from v with
// the most s's, v is the g(v)-th s from the end, and with the most t's before v, tbefore(v)
// t's precede it; Z places v at its k-th s with k <= a - g(v) + 1, after at least tbefore(v)
// t's: b - c(k) >= tbefore(v), so
//   (2) c(k) <= b - G(a - k + 1) for every k, G(i) = max{tbefore(v) : g(v) >= i} (0 if none).
// Such a c exists (c = H, both sides non-increasing) iff H(k) + G(a - k + 1) <= b for k in
// 1..A_s, and a >= A_s, b >= A_t. So |Z| >= the least a + b meeting these; the same with s and
// t swapped is a bound too, and the pair takes the larger. Example: paths tanh-sigmoid and
// sigmoid-tanh have A = 1 each, but H(1) = G(1) = 1 makes a = b = 1 infeasible: 3, not 2.
//
// Cost: per pair, two passes over the forward's nodes and edges and a scan over a from A_s up
// while a + A_t can still beat the best (at a = 2 A_s, G vanishes and b = A_t is feasible).
// Only pairs that can gain are tried (interleaving_candidates), and no more than kPairWork
// node and edge visits' worth of them per forward: leaving pairs out keeps the bound valid.
constexpr i64 kPairWork = i64{1} << 26;
constexpr std::size_t kMaxTriples = std::size_t{1} << 14;  // candidate triples per forward

// Per node: the most s-nodes and t-nodes on a path ending at it (fs, ft) and on a path starting
// at it (bs, bt), each counting the node itself.
struct PairCounts {
  std::vector<std::int32_t> fs, ft, bs, bt;

  void count(const Nodes& nodes, const std::vector<std::int32_t>& of, std::int32_t s,
             std::int32_t t) {
    const Local n = nodes.n;
    fs.assign(n, 0), ft.assign(n, 0), bs.assign(n, 0), bt.assign(n, 0);
    for (Local v = 0; v < n; ++v) {
      for_each_input(nodes, v, [&](Local u) {
        fs[v] = std::max(fs[v], fs[u]);
        ft[v] = std::max(ft[v], ft[u]);
      });
      fs[v] += of[v] == s;
      ft[v] += of[v] == t;
    }
    for (Local v = n - 1; v >= 0; --v) {  // consumers come later: bs[v] holds their maximum
      bs[v] += of[v] == s;
      bt[v] += of[v] == t;
      for_each_input(nodes, v, [&](Local u) {
        bs[u] = std::max(bs[u], bs[v]);
        bt[u] = std::max(bt[u], bt[v]);
      });
    }
  }
};

// The least a + b for which the conditions above hold, counting Z's t's around its s's.
// fs/bs: s counts (f, g), ft/bt: t counts (tbefore = ft, tafter = bt at an s-node).
i64 pair_side(const std::vector<std::int32_t>& of, std::int32_t s, std::int32_t a_s,
              std::int32_t a_t, const std::vector<std::int32_t>& fs,
              const std::vector<std::int32_t>& bs, const std::vector<std::int32_t>& ft,
              const std::vector<std::int32_t>& bt) {
  std::vector<std::int32_t> h(a_s + 2, 0), g(a_s + 2, 0);  // indices 1..a_s; a_s + 1 is 0
  for (std::size_t v = 0; v < of.size(); ++v)
    if (of[v] == s) {
      h[fs[v]] = std::max(h[fs[v]], bt[v]);
      g[bs[v]] = std::max(g[bs[v]], ft[v]);
    }
  for (std::int32_t k = a_s - 1; k >= 1; --k) {
    h[k] = std::max(h[k], h[k + 1]);
    g[k] = std::max(g[k], g[k + 1]);
  }
  i64 best = INT64_MAX;
  for (i64 a = a_s; a + a_t < best; ++a) {
    i64 b = a_t;
    for (i64 k = std::max<i64>(1, a - a_s + 1); k <= a_s; ++k) b = std::max<i64>(b, h[k] + g[a - k + 1]);
    best = std::min(best, a + b);
  }
  return best;
}

// The pairs that may gain: s and t in one strongly connected component of the signature graph
// (an edge s -> t where an s-node feeds a t-node, leaves left out), since a pair gains only if
// some path holds s before t and another t before s. Pairs with direct edges both ways come
// first, the usual interleaving; then the rest of each component.
std::vector<std::pair<std::int32_t, std::int32_t>> interleaving_candidates(
    const Nodes& nodes, const Signatures& sigs, const std::vector<OpFlags>& flags,
    std::vector<std::array<std::int32_t, 3>>* triples = nullptr) {
  const auto n_sigs = static_cast<i64>(sigs.count());
  std::vector<i64> out, in;  // edges as s * n_sigs + t, and reversed
  for (Local v = 0; v < nodes.n; ++v)
    for_each_input(nodes, v, [&](Local u) {
      const std::int32_t s = sigs.of[u], t = sigs.of[v];
      if (s == t || flags[s].leaf || flags[t].leaf) return;
      out.push_back(s * n_sigs + t);
      in.push_back(t * n_sigs + s);
    });
  for (std::vector<i64>* edges : {&out, &in}) {
    std::sort(edges->begin(), edges->end());
    edges->erase(std::unique(edges->begin(), edges->end()), edges->end());
  }
  // Kosaraju, iteratively: post-order along `out`, then components along `in` in reverse.
  auto first_edge = [&](const std::vector<i64>& edges, i64 s) {
    return static_cast<std::size_t>(std::lower_bound(edges.begin(), edges.end(), s * n_sigs) -
                                    edges.begin());
  };
  std::vector<std::int32_t> post, component(n_sigs, -1);
  std::vector<bool> seen(n_sigs, false);
  std::vector<std::pair<i64, std::size_t>> stack;  // (signature, next edge)
  for (i64 root = 0; root < n_sigs; ++root) {
    if (seen[root]) continue;
    seen[root] = true;
    stack.emplace_back(root, first_edge(out, root));
    while (!stack.empty()) {
      auto& [s, e] = stack.back();
      if (e < out.size() && out[e] / n_sigs == s) {
        const i64 t = out[e++] % n_sigs;
        if (!seen[t]) {
          seen[t] = true;
          stack.emplace_back(t, first_edge(out, t));
        }
      } else {
        post.push_back(static_cast<std::int32_t>(s));
        stack.pop_back();
      }
    }
  }
  std::vector<std::vector<std::int32_t>> members;
  for (auto root = post.rbegin(); root != post.rend(); ++root) {
    if (component[*root] >= 0) continue;
    const auto id = static_cast<std::int32_t>(members.size());
    members.push_back({*root});
    component[*root] = id;
    for (std::size_t i = 0; i < members[id].size(); ++i)
      for (std::size_t e = first_edge(in, members[id][i]);
           e < in.size() && in[e] / n_sigs == members[id][i]; ++e)
        if (component[in[e] % n_sigs] < 0) {
          component[in[e] % n_sigs] = id;
          members[id].push_back(static_cast<std::int32_t>(in[e] % n_sigs));
        }
  }
  std::vector<std::pair<std::int32_t, std::int32_t>> direct, rest;
  for (const auto& group : members)
    for (std::size_t i = 0; i < group.size(); ++i)
      for (std::size_t j = i + 1; j < group.size(); ++j) {
        const std::int32_t s = std::min(group[i], group[j]), t = std::max(group[i], group[j]);
        const bool both = std::binary_search(out.begin(), out.end(), s * n_sigs + t) &&
                          std::binary_search(in.begin(), in.end(), s * n_sigs + t);
        (both ? direct : rest).emplace_back(s, t);
      }
  direct.insert(direct.end(), rest.begin(), rest.end());
  if (triples) {  // triples of a component linked by direct edges (two of their three pairs)
    auto linked = [&](std::int32_t a, std::int32_t b) {
      return std::binary_search(out.begin(), out.end(), a * n_sigs + b) ||
             std::binary_search(in.begin(), in.end(), a * n_sigs + b);
    };
    for (const auto& group : members)
      for (std::size_t i = 0; i < group.size(); ++i)
        for (std::size_t j = i + 1; j < group.size(); ++j)
          for (std::size_t k = j + 1; k < group.size(); ++k) {
            if (triples->size() >= kMaxTriples) return direct;
            std::array<std::int32_t, 3> b{group[i], group[j], group[k]};
            std::sort(b.begin(), b.end());
            if (linked(b[0], b[1]) + linked(b[0], b[2]) + linked(b[1], b[2]) >= 1)
              triples->push_back(b);
          }
  }
  return direct;
}

// ---- blocks of two or three signatures, searched exactly ------------------------------------
//
// The pair bound above reads only counts before and after each node; on shift-reduce stacks
// and mixed-operator DAGs the fewest launches of a pair or a triple of signatures is often
// higher. So each candidate block B (two or three signatures of one strongly connected
// component) gets a bound of its own from a search: the restricted problem P_B.
//
// P_B: the forward with every node whose signature is not in B made free (it is done as soon
// as its inputs are; leaves have no inputs and are done at once). Any schedule of the forward,
// its launches of B's signatures kept in order and the others dropped, is a schedule of P_B (a
// node of B still runs after its inputs of B, and a free node is done no later than in the
// schedule), so it launches B's signatures at least opt(P_B) times; blocks of a partition of the
// signatures count disjoint launches: launches >= sum over blocks of opt(P_B), a block of one
// signature s giving opt = A_s. Blocks that are not searched count as their signatures' A_s,
// and a pair keeps the pair bound where that is higher.
//
// Search (iterative-deepening A*). A launch may as well take every ready node of its
// signature, so a state is the set of done nodes and a move a signature with ready nodes.
// Heuristic: for each signature s of B, the most s-nodes on one path from a ready node (a path
// from a not-done node starts at a ready node or is one; a launch takes at most one node of each
// path, since no two nodes of one path are ready together): admissible, and each move lowers
// it by at most 1. With threshold T, a depth-first search over moves with g + h <= T that finds
// no complete schedule proves opt(P_B) > T, so T + 1 is a bound, and the first T at which it
// finds one is opt(P_B). Out of budget, the last proven T is the bound: still valid.
//
// Pruning, proven not to lose the optimum. Among the schedules of fewest launches take Z, the
// least in lexicographic order of signatures (any fixed order). (a) No launch of Z is empty (it
// could be dropped). (b) If launch i + 1 (signature t) holds no node with an input in launch i
// (signature s), then t != s (else its nodes were ready at launch i, which took them) and t > s:
// otherwise swap the two; t at i takes the same nodes (all were ready then, none waited on
// launch i), s at i + 1 takes at least as many, every later launch at least as many, so the
// swapped word is as short and lexicographically smaller, a contradiction. So the search tries
// after a launch of s only signatures t that it made ready nodes of, or with t > s, and finds Z.
//
// Cost: a pass over the forward to build P_B on the nodes that matter (those with a node of B
// before and after them), then per move the nodes and edges it touches; every block stops at
// its share of a work budget (kSearchWork and per node), so the bound stays cheap on large
// graphs, and every pair keeps at least the pair bound.
constexpr i64 kSearchWork = i64{1} << 24;  // node and edge visits per forward, at least,
constexpr i64 kSmallWorkPerEdge = 4096;    // ... unless the forward is smaller than this allows
constexpr i64 kSearchWorkPerEdge = 8;      // ... or this many per node and edge
// (The floor makes a 1.5k-node SPINN forward's bound tight, and 2^24 rather than 2^23 visits
// bench quality's 13.5k-node child-sum Tree-LSTM forward's: 76 -> 77, the A* optimum, found in
// 33 s; stats()' tight bounds of bench quality's 18 graphs 87 -> 115 ms in all, spinn 16 -> 30.
// Capped per node and edge, a model of a hundred 75-node forwards does not pay 2^24 visits a
// hundred times per stats().)
constexpr i64 kBuildPasses = 6;            // what building a block's problem costs, in passes
constexpr i64 kMaxSearchDepth = 4096;      // launches deep, at most
constexpr std::size_t kPackStarts = 64;    // greedy packings tried

class BlockSearch {
 public:
  // `block`: 2 or 3 signatures that launch kernels.
  BlockSearch(const Nodes& nodes, const Signatures& sigs, const std::vector<std::int32_t>& block)
      : k_(static_cast<int>(block.size())) {
    const Local n = nodes.n;
    std::vector<std::int8_t> letter(n, -1);
    std::vector<bool> before(n, false), after(n, false);  // a node of B at or before / after v
    for (Local v = 0; v < n; ++v) {
      for (int l = 0; l < k_; ++l)
        if (sigs.of[v] == block[l]) letter[v] = static_cast<std::int8_t>(l);
      bool b = letter[v] >= 0;
      for_each_input(nodes, v, [&](Local u) { b = b || before[u]; });
      before[v] = b;
    }
    for (Local v = n - 1; v >= 0; --v) {
      if (letter[v] >= 0) after[v] = true;
      if (after[v]) for_each_input(nodes, v, [&](Local u) { after[u] = true; });
    }
    // Nodes of P_B: B's nodes and the free nodes between two of them; a free node with nothing
    // of B before it is done from the start, one with nothing of B after it does not matter.
    std::vector<std::int32_t> id(n, -1);
    for (Local v = 0; v < n; ++v)
      if (before[v] && after[v]) {
        id[v] = static_cast<std::int32_t>(letter_.size());
        letter_.push_back(letter[v]);
        left_ += letter[v] >= 0;
      }
    const auto m = static_cast<std::int32_t>(letter_.size());
    indegree_.assign(m, 0);
    ptr_.assign(static_cast<std::size_t>(m) + 1, 0);
    for (Local v = 0; v < n; ++v)
      if (id[v] >= 0)
        for_each_input(nodes, v, [&](Local u) {
          if (id[u] >= 0) ++indegree_[id[v]], ++ptr_[id[u] + 1];
        });
    std::partial_sum(ptr_.begin(), ptr_.end(), ptr_.begin());
    consumers_.resize(ptr_[m]);
    std::vector<std::int32_t> fill(ptr_.begin(), ptr_.end() - 1);
    for (Local v = 0; v < n; ++v)
      if (id[v] >= 0)
        for_each_input(nodes, v, [&](Local u) {
          if (id[u] >= 0) consumers_[fill[id[u]]++] = id[v];
        });
    // Per letter l and node: the most l-nodes on one path from the node, counting it.
    most_after_.assign(static_cast<std::size_t>(k_) * m, 0);
    for (std::int32_t v = m - 1; v >= 0; --v)
      for (int l = 0; l < k_; ++l) {
        std::int32_t best = 0;
        for (std::int32_t e = ptr_[v]; e < ptr_[v + 1]; ++e)
          best = std::max(best, most_after_[l * m + consumers_[e]]);
        most_after_[l * m + v] = best + (letter_[v] == l);
      }
    built_work_ = kBuildPasses * (n + nodes.arg_ptr[n] - nodes.arg_ptr[0]);
  }

  i64 built_work() const { return built_work_; }

  // A lower bound on opt(P_B), at least `known` (itself a valid bound), exact unless the search
  // ran past `limit` node and edge visits; adds the visits to `work`.
  i64 bound(i64 known, i64 limit, i64& work) {
    waiting_ = indegree_;
    for (auto& r : ready_) r.clear();
    trail_.clear();
    for (std::int32_t v = 0; v < static_cast<std::int32_t>(letter_.size()); ++v)
      if (waiting_[v] == 0 && letter_[v] >= 0) ready_[letter_[v]].push_back(v);  // free nodes wait on B
    limit_ = limit;
    work_ = 0;
    i64 threshold = std::max<i64>(known, heuristic());
    for (;; ++threshold) {
      threshold_ = threshold;
      out_of_budget_ = false;
      const bool found = search(0, -1, 0);
      if (found || out_of_budget_) break;  // opt, or the last threshold proven
    }
    work += work_;
    return threshold;
  }

 private:
  i64 heuristic() {
    const auto m = static_cast<std::int32_t>(letter_.size());
    i64 h = 0;
    for (int l = 0; l < k_; ++l) {
      std::int32_t best = 0;
      for (const auto& r : ready_)
        for (std::int32_t v : r) best = std::max(best, most_after_[l * m + v]);
      h += best;
    }
    for (const auto& r : ready_) work_ += static_cast<i64>(r.size());
    return h;
  }

  // Whether a schedule of at most threshold_ launches in all exists after g launches, the last
  // of letter `last` (-1: none) having made ready nodes of the letters in `enabled`.
  bool search(i64 g, int last, unsigned enabled) {
    if (left_ == 0) return true;
    if (g + heuristic() > threshold_) return false;
    if (work_ > limit_ || g > kMaxSearchDepth) {  // the depth: recursion, on the stack
      out_of_budget_ = true;
      return false;
    }
    for (int l = 0; l < k_; ++l) {
      if (ready_[l].empty()) continue;
      if (last >= 0 && !(enabled >> l & 1u) && l <= last) continue;  // pruning (b)
      // Launch l: its ready nodes, then the free nodes that become done, onto the trail.
      const std::size_t mark = trail_.size(), taken = ready_[l].size();
      std::array<std::size_t, 3> sizes{};
      trail_.insert(trail_.end(), ready_[l].begin(), ready_[l].end());
      ready_[l].clear();
      for (int o = 0; o < k_; ++o) sizes[o] = ready_[o].size();
      unsigned made = 0;
      for (std::size_t i = mark; i < trail_.size(); ++i) {
        const std::int32_t v = trail_[i];
        for (std::int32_t e = ptr_[v]; e < ptr_[v + 1]; ++e) {
          const std::int32_t w = consumers_[e];
          if (--waiting_[w] > 0) continue;
          if (letter_[w] >= 0) {
            ready_[letter_[w]].push_back(w);
            made |= 1u << letter_[w];
          } else {
            trail_.push_back(w);
          }
        }
        work_ += 1 + ptr_[v + 1] - ptr_[v];
      }
      left_ -= static_cast<i64>(taken);
      const bool found = search(g + 1, l, made);
      // Undo.
      left_ += static_cast<i64>(taken);
      for (std::size_t i = mark; i < trail_.size(); ++i)
        for (std::int32_t e = ptr_[trail_[i]]; e < ptr_[trail_[i] + 1]; ++e)
          ++waiting_[consumers_[e]];
      for (int o = 0; o < k_; ++o) ready_[o].resize(sizes[o]);
      ready_[l].assign(trail_.begin() + static_cast<std::ptrdiff_t>(mark),
                       trail_.begin() + static_cast<std::ptrdiff_t>(mark + taken));
      trail_.resize(mark);
      if (found) return true;
      if (out_of_budget_) return false;
    }
    return false;
  }

  int k_;
  std::vector<std::int8_t> letter_;  // per node of P_B: its index in B, -1 if free
  std::vector<std::int32_t> indegree_, ptr_, consumers_, most_after_;
  i64 left_ = 0;  // nodes of B not done
  i64 built_work_ = 0;
  // Search state.
  std::vector<std::int32_t> waiting_, trail_;
  std::array<std::vector<std::int32_t>, 3> ready_;
  i64 threshold_ = 0, limit_ = 0, work_ = 0;
  bool out_of_budget_ = false;
};

// The forward's sum of A_s plus what blocks add over their signatures' A_s, the best of two
// packings of disjoint blocks: the pairs alone by the pair bound (greedy by gain), and pairs
// and triples by their searched bounds (greedy by gain per signature).
i64 tight_bound_of(const Nodes& nodes, const OpFlagsOf& flags_of, bool pairs_only) {
  const Signatures sigs = compact_signatures(nodes);
  const std::vector<OpFlags> flags = signature_flags(nodes, sigs, flags_of);
  const std::vector<std::int32_t> rank = ranks_of(nodes, sigs, flags);
  const auto n_sigs = static_cast<i64>(sigs.count());
  std::vector<std::int32_t> most(n_sigs, 0);
  for (Local v = 0; v < nodes.n; ++v) most[sigs.of[v]] = std::max(most[sigs.of[v]], rank[v]);
  const i64 base = std::accumulate(most.begin(), most.end(), i64{0});
  const i64 edges = nodes.n + nodes.arg_ptr[nodes.n] - nodes.arg_ptr[0];
  std::vector<std::array<std::int32_t, 3>> triples;
  const auto pairs = interleaving_candidates(nodes, sigs, flags, &triples);
  // Per block (a pair: third signature -1): its gain over its signatures' A_s.
  struct Block {
    std::array<std::int32_t, 3> sigs;
    i64 gain;
  };
  std::vector<Block> pair_gains, blocks;
  std::vector<std::pair<i64, i64>> pair_value;  // (s * n_sigs + t, bound), sorted by key
  PairCounts c;
  i64 work = 0;
  for (const auto& [s, t] : pairs) {
    if (work > kPairWork) break;
    work += edges;
    c.count(nodes, sigs.of, s, t);
    const i64 pair = std::max(pair_side(sigs.of, s, most[s], most[t], c.fs, c.bs, c.ft, c.bt),
                              pair_side(sigs.of, t, most[t], most[s], c.ft, c.bt, c.fs, c.bs));
    if (pair > most[s] + most[t]) pair_gains.push_back({{s, t, -1}, pair - most[s] - most[t]});
    pair_value.emplace_back(s * n_sigs + t, pair);
  }
  std::sort(pair_value.begin(), pair_value.end());
  auto value_of = [&](std::int32_t s, std::int32_t t) {  // s < t
    const auto it = std::lower_bound(pair_value.begin(), pair_value.end(),
                                     std::make_pair(s * n_sigs + t, i64{-1}));
    return it != pair_value.end() && it->first == s * n_sigs + t ? it->second
                                                                 : i64{most[s]} + most[t];
  };
  // The searches: pairs, then triples, each within its share of what is left of the budget.
  const i64 budget = pairs_only ? 0 : std::max(std::min(kSearchWork, kSmallWorkPerEdge * edges),
                                               kSearchWorkPerEdge * edges);
  i64 spent = 0;
  auto search = [&](const std::vector<std::int32_t>& block, i64 known) -> i64 {
    if (spent + kBuildPasses * edges > budget) return known;
    BlockSearch block_search(nodes, sigs, block);
    spent += block_search.built_work();
    const i64 share = std::max<i64>(edges, (budget - spent) / 8);
    return block_search.bound(known, share, spent);
  };
  for (const auto& [s, t] : pairs) {
    const i64 value = search({s, t}, value_of(s, t));
    auto it = std::lower_bound(pair_value.begin(), pair_value.end(),
                               std::make_pair(s * n_sigs + t, i64{-1}));
    if (it != pair_value.end() && it->first == s * n_sigs + t) it->second = value;
    if (value > most[s] + most[t]) blocks.push_back({{s, t, -1}, value - most[s] - most[t]});
  }
  for (const auto& b : triples) {
    const i64 own = i64{most[b[0]]} + most[b[1]] + most[b[2]];
    const i64 known = std::max({value_of(b[0], b[1]) + most[b[2]],
                                value_of(b[0], b[2]) + most[b[1]],
                                value_of(b[1], b[2]) + most[b[0]]});
    const i64 value = search({b[0], b[1], b[2]}, known);
    if (value > own) blocks.push_back({b, value - own});
  }
  // Any packing of disjoint blocks keeps the bound valid. Greedy by gain per signature, ties to
  // blocks whose signatures fewer other blocks want, started from each of the first few blocks
  // in that order; and the pairs alone in the pair bound's own order, so never below it.
  auto pack = [&](const std::vector<Block>& list, std::size_t first) {
    std::vector<bool> used(n_sigs, false);
    i64 gain = 0;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Block& b = list[i == 0 ? first : i <= first ? i - 1 : i];
      const int size = b.sigs[2] < 0 ? 2 : 3;
      bool free = true;
      for (int j = 0; j < size; ++j) free = free && !used[b.sigs[j]];
      if (!free) continue;
      for (int j = 0; j < size; ++j) used[b.sigs[j]] = true;
      gain += b.gain;
    }
    return gain;
  };
  std::vector<i64> wanted(n_sigs, 0);
  for (const Block& b : blocks)
    for (std::int32_t s : b.sigs)
      if (s >= 0) ++wanted[s];
  auto demand = [&](const Block& b) {
    return wanted[b.sigs[0]] + wanted[b.sigs[1]] + (b.sigs[2] < 0 ? 0 : wanted[b.sigs[2]]);
  };
  std::stable_sort(blocks.begin(), blocks.end(), [&](const Block& a, const Block& b) {
    const i64 size_a = a.sigs[2] < 0 ? 2 : 3, size_b = b.sigs[2] < 0 ? 2 : 3;
    if (a.gain * size_b != b.gain * size_a) return a.gain * size_b > b.gain * size_a;
    return demand(a) < demand(b);
  });
  std::sort(pair_gains.begin(), pair_gains.end(), [](const Block& a, const Block& b) {
    return std::tie(a.gain, a.sigs) > std::tie(b.gain, b.sigs);  // the pair bound's own order
  });
  i64 gain = pack(pair_gains, 0);
  for (std::size_t first = 0; first < std::min<std::size_t>(blocks.size(), kPackStarts); ++first)
    gain = std::max(gain, pack(blocks, first));
  return base + gain;
}

}  // namespace

void check_nodes(const Nodes& nodes) {
  for (Local v = 0; v < nodes.n; ++v) {
    if (nodes.arg_ptr[v + 1] < nodes.arg_ptr[v])
      throw std::invalid_argument("arg_end must not decrease (node " +
                                  std::to_string(nodes.start + v) + ")");
    for (i64 e = nodes.arg_ptr[v]; e < nodes.arg_ptr[v + 1]; ++e)
      if (nodes.arg_flat[e] < 0 || nodes.arg_flat[e] >= nodes.start + v)
        throw std::invalid_argument("node " + std::to_string(nodes.start + v) + " reads node " +
                                    std::to_string(nodes.arg_flat[e]) +
                                    ", which is not an earlier node");
    if (nodes.depth && (nodes.depth[v] < 0 || nodes.depth[v] > nodes.n))
      throw std::invalid_argument("node " + std::to_string(nodes.start + v) + " has depth " +
                                  std::to_string(nodes.depth[v]) + ", outside 0.." +
                                  std::to_string(nodes.n) + " for a forward of that many nodes");
  }
}

i64 schedule(Strategy strategy, const Nodes& nodes, const OpFlagsOf& flags_of, Placement& out) {
  Placer placer(nodes, out);
  if (strategy == Strategy::none) {
    for (Local v = 0; v < nodes.n; ++v) placer.place(&v, 1);
    return out.batches;
  }
  const Signatures sigs = compact_signatures(nodes);
  const std::vector<OpFlags> flags = signature_flags(nodes, sigs, flags_of);
  Plan plan;
  if (strategy == Strategy::depth || one_depth_per_signature(nodes, sigs))
    plan = by_key(nodes, sigs, flags, nodes.depth);
  else if (strategy == Strategy::agenda)
    plan = ranked_agenda(nodes, groups_of(nodes, sigs, flags), Edges(nodes), sigs, flags,
                         nullptr, false);
  else
    plan = fewest_launches(nodes, sigs, flags);
  Local begin = 0;
  for (Local end : plan.ends) {
    placer.place(&plan.order[begin], static_cast<std::size_t>(end - begin));
    begin = end;
  }
  return out.batches;
}

std::vector<std::int32_t> signature_ranks(const Nodes& nodes, const OpFlagsOf& flags_of) {
  const Signatures sigs = compact_signatures(nodes);
  return ranks_of(nodes, sigs, signature_flags(nodes, sigs, flags_of));
}

i64 tight_bound(const Nodes& all, const std::vector<i64>& forward_ends,
                const OpFlagsOf& flags_of, bool pairs_only) {
  i64 bound = 0, begin = 0;
  for (i64 end : forward_ends) {  // forwards count on their own, as in lower_bound
    bound += tight_bound_of(one_forward(all, begin, end), flags_of, pairs_only);
    begin = end;
  }
  return bound;
}

i64 lower_bound(const Nodes& all, const std::vector<i64>& forward_ends,
                const OpFlagsOf& flags_of) {
  i64 bound = 0, begin = 0;
  for (i64 end : forward_ends) {
    // Nodes of different forwards never share a launch (a value was asked for in between),
    // so each forward counts on its own.
    const Nodes part = one_forward(all, begin, end);
    const Signatures sigs = compact_signatures(part);
    const std::vector<std::int32_t> rank =
        ranks_of(part, sigs, signature_flags(part, sigs, flags_of));
    std::vector<std::int32_t> most(sigs.count(), 0);
    for (Local v = 0; v < part.n; ++v) most[sigs.of[v]] = std::max(most[sigs.of[v]], rank[v]);
    for (std::int32_t m : most) bound += m;
    begin = end;
  }
  return bound;
}

}  // namespace flybatch

namespace flybatch {

std::vector<SignatureSplit> signature_splits(const Nodes& all, const std::vector<i64>& forward_ends,
                                             const OpFlagsOf& flags_of,
                                             const std::int32_t* node_batch) {
  std::vector<SignatureSplit> splits;
  KeyNumbers index;  // interned signature -> entry of `splits`
  auto entry = [&](i64 sig) -> SignatureSplit& {
    const std::size_t i = static_cast<std::size_t>(index.number(sig));
    if (i == splits.size()) splits.push_back({sig, 0, {}});
    return splits[i];
  };
  i64 begin = 0;
  for (i64 end : forward_ends) {
    const Nodes part = one_forward(all, begin, end);
    const Signatures sigs = compact_signatures(part);
    const std::vector<OpFlags> flags = signature_flags(part, sigs, flags_of);
    const std::vector<std::int32_t> rank = ranks_of(part, sigs, flags);
    // Each (signature, rank) group's first launch, and the deepest rank of each signature.
    KeyNumbers group_of;
    std::vector<i64> first;
    std::vector<std::int32_t> most(sigs.count(), 0);
    auto group = [&](Local v) {
      const auto g = static_cast<std::size_t>(
          group_of.number(static_cast<i64>(sigs.of[v]) * (part.n + 1) + rank[v]));
      if (g == first.size()) first.push_back(node_batch[part.start + v]);
      return g;
    };
    for (Local v = 0; v < part.n; ++v) {
      const std::size_t g = group(v);
      first[g] = std::min<i64>(first[g], node_batch[part.start + v]);
      most[sigs.of[v]] = std::max(most[sigs.of[v]], rank[v]);
    }
    for (std::size_t s = 0; s < sigs.count(); ++s)
      if (!flags[s].leaf) entry(part.sig[sigs.first[s]]).bound += most[s];
    // A node that missed its group's first launch waited on an input computed at or after it.
    for (Local v = 0; v < part.n; ++v) {
      const i64 start = first[group(v)];
      if (flags[sigs.of[v]].leaf || node_batch[part.start + v] == start) continue;
      SignatureSplit& split = entry(part.sig[v]);
      for_each_input(part, v, [&](Local u) {
        if (node_batch[part.start + u] >= start) ++split.waited_on[part.sig[u]];
      });
    }
    begin = end;
  }
  return splits;
}

}  // namespace flybatch
