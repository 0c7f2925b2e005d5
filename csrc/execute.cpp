// The read planner of the execution stage (see execute.h): linear in the forward's argument
// slots, plus a sort by result for the slots that read several results.
#include "execute.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace flybatch {
namespace {

class Planner {
 public:
  Planner(const ScheduledForward& forward, ReadPlan& plan) : f_(forward), plan_(plan) {}

  // The read of the nodes ids[0..n) (one per row); returns its id. With `broadcast`, a column
  // of one node read by every row is one row the kernel broadcasts; the parts of a multi read
  // are not (their rows are concatenated).
  i64 read(const i64* ids, std::size_t n, bool broadcast) {
    const i64 first = ids[0];
    const i64 source = where(first);
    const bool one_node = std::all_of(ids + 1, ids + n, [&](i64 v) { return v == first; });
    if (n == 1 || (broadcast && one_node))
      return add({ReadKind::view, source, f_.node_row[first], 1});
    const bool one_source =
        std::all_of(ids + 1, ids + n, [&](i64 v) { return where(v) == source; });
    if (!one_source) return multi(ids, n);
    bool in_run = true;  // consecutive rows, in order: a view
    for (std::size_t i = 1; i < n && in_run; ++i)
      in_run = f_.node_row[ids[i]] == f_.node_row[ids[i - 1]] + 1;
    if (in_run) return add({ReadKind::view, source, f_.node_row[first], static_cast<i64>(n)});
    const i64 at = static_cast<i64>(plan_.indices.size());
    for (std::size_t i = 0; i < n; ++i) plan_.indices.push_back(f_.node_row[ids[i]]);
    return add({ReadKind::rows, source, at, static_cast<i64>(n)});
  }

 private:
  // The batch of a node this forward reads; an unplaced one means the caller broke the
  // schedule (its inputs must be computed by it or before).
  i64 where(i64 node) const {
    const i64 batch = f_.node_batch[node];
    if (batch < 0)
      throw std::invalid_argument("node " + std::to_string(node) +
                                  " is read by the forward but has no place in any batch");
    return batch;
  }

  i64 add(Read read) {
    plan_.reads.push_back(read);
    return static_cast<i64>(plan_.reads.size()) - 1;
  }

  // Rows of several results: one part per result, in ascending result order (each part keeps
  // its nodes' order), concatenated; then the permutation back to the nodes' order.
  i64 multi(const i64* ids, std::size_t n) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return where(ids[a]) < where(ids[b]); });
    std::vector<i64> part_reads, part_ids;
    for (std::size_t i = 0; i < n;) {
      const i64 source = where(ids[order[i]]);
      part_ids.clear();
      for (; i < n && where(ids[order[i]]) == source; ++i) part_ids.push_back(ids[order[i]]);
      part_reads.push_back(read(part_ids.data(), part_ids.size(), /*broadcast=*/false));
    }
    Read out{ReadKind::multi};
    out.start = static_cast<i64>(plan_.parts.size());
    out.length = static_cast<i64>(part_reads.size());
    out.rows = static_cast<i64>(n);
    plan_.parts.insert(plan_.parts.end(), part_reads.begin(), part_reads.end());
    bool in_order = true;
    for (std::size_t i = 0; i < n && in_order; ++i) in_order = order[i] == i;
    if (!in_order) {
      out.inverse = static_cast<i64>(plan_.indices.size());
      plan_.indices.resize(plan_.indices.size() + n);
      for (std::size_t i = 0; i < n; ++i) plan_.indices[out.inverse + order[i]] = i;
    }
    if (out.length >= kWholeResultsMinParts) {  // each node's row in the whole results, in
      out.whole = static_cast<i64>(plan_.indices.size());  // the nodes' order
      plan_.indices.resize(plan_.indices.size() + n);
      i64 first = 0;  // row of the current result's first row in the concatenation
      for (std::size_t i = 0; i < n;) {
        const i64 source = where(ids[order[i]]);
        for (; i < n && where(ids[order[i]]) == source; ++i)
          plan_.indices[out.whole + order[i]] = first + f_.node_row[ids[order[i]]];
        first += f_.batch_size[source];
      }
    }
    return add(out);
  }

  const ScheduledForward& f_;
  ReadPlan& plan_;
};

// Rows of the result of batch `source`.
i64 rows_of(const ScheduledForward& f, i64 source) { return f.batch_size[source]; }

// Whether `read` takes only part of its result (a multi read takes parts through its parts).
bool partial(const ScheduledForward& f, const Read& read) {
  if (read.kind == ReadKind::rows) return true;
  return read.kind == ReadKind::view &&
         !(read.start == 0 && read.length == rows_of(f, read.source));
}

// Split the result into disjoint runs when every read is a view and no two distinct views
// overlap; else gather every read's rows at once and split that.
void plan_fan_out(const ScheduledForward& f, ReadPlan& plan, FanOut& fan) {
  std::vector<std::pair<i64, i64>> spans;  // (first row, rows) of each distinct view
  bool views = true;
  for (i64 k : fan.reads) {
    const Read& r = plan.reads[k];
    views = views && r.kind == ReadKind::view;
    if (views) spans.emplace_back(r.start, r.length);
  }
  if (views) {
    std::sort(spans.begin(), spans.end());
    spans.erase(std::unique(spans.begin(), spans.end()), spans.end());
    bool disjoint = true;
    for (std::size_t i = 1; i < spans.size() && disjoint; ++i)
      disjoint = spans[i - 1].first + spans[i - 1].second <= spans[i].first;
    if (disjoint) {
      std::vector<i64> piece_of_span;
      i64 at = 0;
      for (const auto& [start, length] : spans) {
        if (start > at) fan.sizes.push_back(start - at);  // rows nobody reads here
        piece_of_span.push_back(static_cast<i64>(fan.sizes.size()));
        fan.sizes.push_back(length);
        at = start + length;
      }
      if (at < rows_of(f, fan.source)) fan.sizes.push_back(rows_of(f, fan.source) - at);
      for (i64 k : fan.reads) {
        const Read& r = plan.reads[k];
        const auto span = std::lower_bound(spans.begin(), spans.end(),
                                           std::make_pair(r.start, r.length));
        fan.piece.push_back(piece_of_span[span - spans.begin()]);
      }
      return;
    }
  }
  fan.gather = static_cast<i64>(plan.indices.size());
  for (i64 k : fan.reads) {
    const Read& r = plan.reads[k];
    fan.piece.push_back(static_cast<i64>(fan.sizes.size()));
    fan.sizes.push_back(r.length);
    for (i64 i = 0; i < r.length; ++i) {  // copied: the gather's rows follow each other
      const i64 row = r.kind == ReadKind::rows ? plan.indices[r.start + i] : r.start + i;
      plan.indices.push_back(row);
    }
  }
}

// When a variadic op stacks its arguments below `stack_from`: ONE read of them all, node after
// node, viewed as [B, k, ...], against a read per argument position and the kernel's copy to
// concatenate them. Stacked when every argument of every node is a row of ONE result (one
// gather instead of k and a concatenation), or when no position is a zero-copy view (one
// gather per result read instead of one per position and result; the positions' own
// concatenations and reorderings become one).
bool one_result(const ScheduledForward& f, const i64* nodes, std::size_t size) {
  const i64 source = f.node_batch[f.arg_flat[f.arg_ptr[nodes[0]]]];
  for (std::size_t row = 0; row < size; ++row)
    for (i64 i = f.arg_ptr[nodes[row]]; i < f.arg_ptr[nodes[row] + 1]; ++i)
      if (f.node_batch[f.arg_flat[i]] != source) return false;
  return true;
}

// Whether no argument position would be read as a view (Planner::read): one node for every
// row, or a run of consecutive rows of one result.
bool no_view(const ScheduledForward& f, const i64* nodes, std::size_t size, i64 arity) {
  if (size == 1) return false;
  for (i64 j = 0; j < arity; ++j) {
    const i64 first = f.arg_flat[f.arg_ptr[nodes[0]] + j];
    bool one_node = true, run = true;
    for (std::size_t row = 1; row < size && (one_node || run); ++row) {
      const i64 v = f.arg_flat[f.arg_ptr[nodes[row]] + j];
      const i64 u = f.arg_flat[f.arg_ptr[nodes[row - 1]] + j];
      one_node = one_node && v == first;
      run = run && f.node_batch[v] == f.node_batch[first] && f.node_row[v] == f.node_row[u] + 1;
    }
    if (one_node || run) return false;
  }
  return true;
}

}  // namespace

ReadPlan plan_reads(const ScheduledForward& f, const LayoutOf& layout_of) {
  ReadPlan plan;
  Planner planner(f, plan);
  std::vector<i64> column, widths;
  for (i64 b = 0; b < f.batches; ++b) {
    const i64* nodes = f.order + (b ? f.ends[b - 1] : 0);
    const std::size_t size = static_cast<std::size_t>(f.ends[b] - (b ? f.ends[b - 1] : 0));
    BatchReads batch;
    batch.begin = batch.end = static_cast<i64>(plan.args.size());
    const ArgumentLayout layout = layout_of(nodes[0]);
    const i64 arity = f.arg_ptr[nodes[0] + 1] - f.arg_ptr[nodes[0]];
    auto args_of = [&](std::size_t row) { return f.arg_flat + f.arg_ptr[nodes[row]]; };
    auto leading = [&](i64 node) { return f.leading[f.shape[node]]; };
    widths.clear();
    // The read of `column`, and its width.
    auto read_column = [&] {
      plan.args.push_back(planner.read(column.data(), column.size(), /*broadcast=*/true));
      i64 width = -1;
      for (i64 v : column) width = std::max(width, leading(v));
      widths.push_back(width);
    };
    // One read per argument position j < positions.
    auto read_positions = [&](i64 positions) {
      column.resize(size);
      for (i64 j = 0; j < positions; ++j) {
        for (std::size_t row = 0; row < size; ++row) column[row] = args_of(row)[j];
        read_column();
      }
    };
    if (layout.leaf) {
      // nothing to read
    } else if (layout.ragged) {
      // Its first `fixed` arguments one read each; then ONE read of the items of every node's
      // list after them, node after node (none when every list is empty), and the lists'
      // lengths.
      read_positions(layout.fixed);
      column.clear();
      batch.arities = static_cast<i64>(plan.indices.size());
      for (std::size_t row = 0; row < size; ++row) {
        const i64* list = args_of(row) + layout.fixed;
        const i64 items = f.arg_flat + f.arg_ptr[nodes[row] + 1] - list;
        column.insert(column.end(), list, list + items);
        plan.indices.push_back(items);
      }
      if (!column.empty()) read_column();
    } else if (layout.stack_from && arity > 1 &&
               (arity >= layout.stack_from || one_result(f, nodes, size) ||
                no_view(f, nodes, size, arity))) {
      // ONE read of every argument of every node, node after node.
      column.clear();
      for (std::size_t row = 0; row < size; ++row)
        column.insert(column.end(), args_of(row), args_of(row) + arity);
      batch.stacked = arity;
      read_column();
    } else {
      read_positions(arity);
    }
    batch.end = static_cast<i64>(plan.args.size());
    batch.widths = static_cast<i64>(plan.indices.size());
    plan.indices.insert(plan.indices.end(), widths.begin(), widths.end());
    for (std::size_t row = 1; row < size && !batch.uneven; ++row)
      batch.uneven = f.shape[nodes[row]] != f.shape[nodes[0]];
    if (layout.padded && arity > 0) {  // the lengths of the first arguments, if they differ
      auto length = [&](std::size_t row) {  // (or of the nodes: an operand may be broadcast)
        return leading(layout.result_length ? nodes[row] : args_of(row)[0]);
      };
      bool mixed = false;
      for (std::size_t row = 1; row < size && !mixed; ++row) mixed = length(row) != length(0);
      if (mixed) {
        batch.lengths = static_cast<i64>(plan.indices.size());
        for (std::size_t row = 0; row < size; ++row) plan.indices.push_back(length(row));
      }
    }
    plan.batches.push_back(batch);
  }
  // Results read in pieces by two or more reads, fanned out once each.
  std::unordered_map<i64, std::size_t> fan_of_source;
  std::vector<FanOut> candidates;
  for (i64 k = 0; k < static_cast<i64>(plan.reads.size()); ++k) {
    const Read& r = plan.reads[k];
    if (!partial(f, r)) continue;
    const auto [found, fresh] = fan_of_source.emplace(r.source, candidates.size());
    if (fresh) candidates.emplace_back().source = r.source;
    candidates[found->second].reads.push_back(k);
  }
  for (FanOut& fan : candidates) {
    if (fan.reads.size() < 2) continue;
    plan_fan_out(f, plan, fan);
    plan.fan_outs.push_back(std::move(fan));
  }
  plan.readers.assign(static_cast<std::size_t>(f.batches), 0);
  for (i64 k = 0; k < static_cast<i64>(plan.reads.size()); ++k) {
    const Read& r = plan.reads[k];
    if (r.kind == ReadKind::multi) continue;
    if (r.source >= f.first_batch)
      ++plan.readers[static_cast<std::size_t>(r.source - f.first_batch)];
    else if (partial(f, r))
      plan.earlier_partial.push_back(k);
  }
  return plan;
}

bool concat_rows(const i64* nodes, i64 n, const ScheduledForward& c, ConcatRows& out) {
  if (n <= 0) return false;
  const i64 k = c.arg_ptr[nodes[0] + 1] - c.arg_ptr[nodes[0]];
  if (k <= 0) return false;
  out.k = k;
  out.sources.clear();
  for (i64 row = 0; row < n; ++row) {
    const i64 node = nodes[row];
    if (c.arg_ptr[node + 1] - c.arg_ptr[node] != k) return false;
    for (i64 i = 0; i < k; ++i) {  // (a concat reads a few sources: a linear search)
      const i64 arg = c.arg_flat[c.arg_ptr[node] + i];
      const i64 batch = c.node_batch[arg];
      if (batch < 0)
        throw std::invalid_argument("node " + std::to_string(arg) + " is read by node " +
                                    std::to_string(node) + " but has no place in any batch");
      if (std::find(out.sources.begin(), out.sources.end(), batch) == out.sources.end())
        out.sources.push_back(batch);
    }
  }
  std::sort(out.sources.begin(), out.sources.end());
  std::vector<i64> offsets(out.sources.size());
  out.source_rows.resize(out.sources.size());
  for (std::size_t s = 0, total = 0; s < out.sources.size(); ++s) {
    offsets[s] = static_cast<i64>(total);
    out.source_rows[s] = c.batch_size[out.sources[s]];
    total += static_cast<std::size_t>(out.source_rows[s]);
  }
  out.table_rows.resize(static_cast<std::size_t>(n * k));
  for (i64 row = 0; row < n; ++row) {
    const i64* args = c.arg_flat + c.arg_ptr[nodes[row]];
    for (i64 i = 0; i < k; ++i) {
      const i64 s = std::lower_bound(out.sources.begin(), out.sources.end(),
                                     c.node_batch[args[i]]) - out.sources.begin();
      out.table_rows[row * k + i] = (offsets[s] + c.node_row[args[i]]) * k + i;
    }
  }
  return true;
}

}  // namespace flybatch
