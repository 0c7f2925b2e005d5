"""Results -> the paper's Table 1 (markdown) and two PNG charts (throughput; Figure-2 breakdown).

Input: result records (dicts, as appended to ``results.jsonl`` by the runner). When a
(task, mode) appears several times, the last record wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from flybatch.bench.runner import ALL_MODES
from flybatch.bench.tasks import TASKS

PHASES = ("build", "schedule", "forward", "backward", "allreduce", "update")
PHASE_COLORS = {"build": "#4c72b0", "schedule": "#dd8452", "forward": "#55a868",
                "backward": "#c44e52", "allreduce": "#937860", "update": "#8172b3"}


def load(path: str | Path, run_id: str | None = None) -> list[dict[str, Any]]:
    """Records of ``path`` (all, or those of one run)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if run_id is None or rec.get("run_id") == run_id:
                out.append(rec)
    return out


def latest(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        table[(r["task"], r["mode"])] = r
    return table


def _axes(cells):
    tasks = [t for t in TASKS if any(k[0] == t for k in cells)]
    tasks += sorted({k[0] for k in cells} - set(tasks))
    modes = [m for m in ALL_MODES if any(k[1] == m for k in cells)]
    return tasks, modes


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def markdown(records: Iterable[dict[str, Any]]) -> str:
    """Table 1 (train: instances/s and launches per minibatch), eval throughput, details."""
    cells = latest(records)
    if not cells:
        return "(no results)\n"
    tasks, modes = _axes(cells)
    head = "| task | " + " | ".join(modes) + " |\n|---|" + "---:|" * len(modes) + "\n"

    def table(fmt) -> str:
        rows = []
        for t in tasks:
            row = [fmt(cells[(t, m)]) if (t, m) in cells else "–" for m in modes]
            rows.append(f"| {t} | " + " | ".join(row) + " |")
        return head + "\n".join(rows) + "\n"

    def train_cell(r):
        s = _fmt_rate(r["train_per_s"])
        if "launches" in r:
            s += f" ({r['launches']:,.0f} L)"
        return s

    def detail_cell(r):
        if "launches" not in r:
            return "–"
        return (f"{r['launches_over_bound']:.2f}x; "
                f"{r['gathers']:,.0f} / {r['gathers_avoided']:,.0f}")

    def gflops_cell(r):
        if "gflop_per_s" not in r:
            return "–"
        return f"{r['gflop_per_s']:.1f} ({r['percent_of_peak']:.0f}%)"

    def build_cell(r):
        secs = r.get("seconds", {})
        if "build" not in secs:
            return "–"
        s = f"{1e3 * secs['build']:.1f}"
        if "build_split" in r:
            split = r["build_split"]
            user = split["user"] / max(split["user"] + split["flybatch"], 1e-12)
            s += (f" + {1e3 * secs.get('schedule', 0.0):.1f} (user {100 * user:.0f}% / "
                  f"flybatch {100 * (1 - user):.0f}%)")
        return s

    def memory_cell(r):
        s = f"{r.get('peak_rss_mb') or 0:,.0f}"
        if "peak_rss_growth_mb" in r:
            s += f" (+{r['peak_rss_growth_mb']:,.0f})"
        if "peak_cuda_mb" in r:
            s += f"; GPU {r['peak_cuda_mb']:,.0f}"
        return s

    any_rec = next(iter(cells.values()))
    dynets = sorted({r["dynet"] for r in cells.values() if r.get("dynet")})
    out = [f"Batch size {any_rec.get('batch_size')}, {any_rec.get('threads')} thread(s), "
           f"device {any_rec.get('device')}, data per task: "
           + ", ".join(f"{t} {cells[next(k for k in cells if k[0] == t)].get('data', '?')}"
                       for t in tasks) + "."
           + (f" dynet-* modes: DyNet {', '.join(dynets)}." if dynets else "") + "\n",
           "**Training** (instances/s, forward + backward + update; in brackets kernel launches "
           "per minibatch):\n", table(train_cell),
           "**Evaluation** (instances/s, forward only):\n",
           table(lambda r: _fmt_rate(r["eval_per_s"])),
           *([_gflops_heading(any_rec), table(gflops_cell)]
             if any("gflop_per_s" in r for r in cells.values()) else []),
           *_distributed(cells),
           "**Launches / lower bound; input copies made / avoided** (flybatch modes):\n",
           table(detail_cell),
           "**Build per training minibatch** (ms; flybatch modes: the graph's build + its "
           "scheduling, in brackets the build's shares of the task's own per-instance Python "
           "and of flybatch's op calls, measured on 3 more minibatches with flybatch's own-time "
           "clock on (shares, since those minibatches ran at another moment of a noisy "
           "machine); dynet-* modes: DyNet's graph build, the same per-instance Python "
           "included):\n",
           table(build_cell),
           "**Peak memory** (MB: peak RSS of the mode's own process, in brackets its growth "
           "over the RSS at the mode's start; DyNet reserves its --mem pool, 1 GB):\n",
           table(memory_cell),
           "**First-minibatch loss** (the correctness line: equal across modes):\n",
           table(lambda r: f"{r['first_loss']:.6g}")]
    return "\n".join(out)


def _gflops_heading(rec: dict[str, Any]) -> str:
    peak = rec.get("gemm_peak_gflop_per_s")
    shape = "x".join(map(str, rec.get("gemm_peak_shape", ())))
    return ("**GFLOP/s vs peak** (training: the model's matrix-product FLOPs per minibatch "
            "over the median seconds per minibatch; forward and backward, whose dX and dW are "
            "two products of the forward's size; elementwise work not counted; the eager, manual "
            "and DyNet modes get the FLOPs flybatch counts on the same minibatches; in brackets "
            "% of the measured GEMM "
            + (f"peak, {peak:.1f} GFLOP/s ({rec.get('gemm_peak_path', 'F.linear')} {shape}, "
               "best shape and path)" if peak else "peak")
            + "):\n")


def _distributed(cells) -> list[str]:
    """The data-parallel lines (`--distributed` runs of more than one process), else none."""
    rows = [(k, r) for k, r in cells.items() if r.get("world_size", 1) > 1]
    if not rows:
        return []

    def each(rates):
        return " + ".join(_fmt_rate(x) for x in rates)

    lines = ["| task | mode | processes | train per process | train total "
             "| eval per process | eval total |", "|---|---|---:|---:|---:|---:|---:|"]
    for (t, m), r in rows:
        lines.append(f"| {t} | {m} | {r['world_size']} | {each(r['per_process'])} "
                     f"| {_fmt_rate(r['total'])} | {each(r['eval_per_process'])} "
                     f"| {_fmt_rate(r['eval_total'])} |")
    return ["**Distributed** (data-parallel, `--distributed`; instances/s over each "
            "process's timed loop, and the total: all instances over the slowest process's "
            "time; the tables above show the totals):\n", "\n".join(lines) + "\n"]


def charts(records: Iterable[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """``throughput.png`` (train and eval instances/s per task and mode, log scale) and
    ``breakdown.png`` (seconds per training minibatch split into phases, Figure 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = latest(records)
    if not cells:
        return []
    tasks, modes = _axes(cells)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.8 * len(tasks) + 2), 8))
    width = 0.8 / len(modes)
    for ax, key, title in ((axes[0], "train_per_s", "training"),
                           (axes[1], "eval_per_s", "evaluation")):
        for j, m in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i, t in enumerate(tasks)
                  if (t, m) in cells]
            ys = [cells[(t, m)][key] for t in tasks if (t, m) in cells]
            ax.bar(xs, ys, width, label=m)
        ax.set_yscale("log")
        ax.set_xticks(range(len(tasks)), tasks, rotation=15)
        ax.set_ylabel("instances / s (log)")
        ax.set_title(f"{title} throughput")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=4, loc="upper left")
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(tasks), 1, figsize=(9, 1.0 + 0.38 * len(modes) * len(tasks)),
                             squeeze=False)
    for ax, t in zip(axes[:, 0], tasks):
        ms = [m for m in modes if (t, m) in cells]
        totals = [1e3 * sum(cells[(t, m)].get("seconds", {}).get(ph, 0.0) for ph in PHASES)
                  for m in ms]
        ranked = sorted(totals, reverse=True)
        # One far slower mode (usually "none") would flatten the others: clip it, label it.
        limit = 1.25 * ranked[1] if len(ranked) > 1 and ranked[0] > 1.8 * ranked[1] else None
        for y, m in enumerate(ms):
            secs = cells[(t, m)].get("seconds", {})
            left = 0.0
            for ph in PHASES:
                v = 1e3 * secs.get(ph, 0.0)
                ax.barh(y, v, left=left, color=PHASE_COLORS[ph],
                        label=ph if (t == tasks[0] and y == 0) else None)
                left += v
            if limit is not None and totals[y] > limit:
                ax.text(0.99 * limit, y, f"{totals[y]:,.0f} ms \u2192", ha="right",
                        va="center", fontsize=8, color="white", fontweight="bold")
        if limit is not None:
            ax.set_xlim(0, limit)
        ax.set_yticks(range(len(ms)), ms)
        ax.invert_yaxis()
        ax.set_title(f"{t}: ms per training minibatch", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="upper right", ncol=len(PHASES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    paths.append(out_dir / "breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
