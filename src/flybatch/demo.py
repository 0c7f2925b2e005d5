"""`make demo`: a per-instance Tree-LSTM sentiment model trained under each strategy.

The model is written for ONE tree (plain recursion); flybatch batches a minibatch of trees.
Trees are generated in the Stanford Sentiment Treebank's format (or read from `--data-dir`).
For each strategy the demo trains for a few seconds and prints trees/s and kernel launches
per minibatch side by side, with the loss after the same number of updates (equal across
strategies up to float32 rounding: batching changes only the order of some sums).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import flybatch as fb
from flybatch.datasets import Tree, Vocab, load_split


class TreeSentiment(torch.nn.Module):
    def __init__(self, vocab_size: int, dim: int = 64, labels: int = 5):
        super().__init__()
        self.embed = fb.nn.Embedding(vocab_size, dim)
        self.cell = fb.nn.TreeLSTMCell(dim, dim)
        self.out = fb.nn.Linear(dim, labels)

    def encode(self, tree: Tree, vocab: Vocab, losses: list) -> fb.nn.State:
        """Per-instance code: recursion over one tree, a loss at every node."""
        if tree.word is not None:
            state = self.cell.leaf(self.embed(vocab[tree.word]))
        else:
            state = self.cell([self.encode(child, vocab, losses) for child in tree.children])
        losses.append(fb.pick_neg_log_softmax(self.out(state.h), tree.label))
        return state


def train(strategy: str, trees: list[Tree], vocab: Vocab, seconds: float, batch_size: int,
          steps: int) -> dict:
    torch.manual_seed(0)
    model = TreeSentiment(len(vocab))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rng = random.Random(0)
    done, timed, trees_seen, launches, losses = 0, 0.0, 0, [], []
    while done < steps or timed < seconds:
        batch = rng.sample(trees, batch_size)
        start = time.perf_counter()
        with fb.Graph(strategy=strategy) as g:
            node_losses: list = []
            for tree in batch:
                model.encode(tree, vocab, node_losses)
            loss = fb.esum(node_losses)
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = loss.item()
        timed += time.perf_counter() - start
        trees_seen += batch_size
        launches.append(g.stats().batches)
        done += 1
        if done == steps:
            losses.append(value)
    return {"trees/s": trees_seen / timed, "launches": sum(launches) / len(launches),
            f"loss@{steps}": losses[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="folder with sst/train.txt")
    parser.add_argument("--seconds", type=float, default=4.0, help="training time per strategy")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="updates before the loss is shown")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trees = load_split("sst", args.data_dir, "train", n_synthetic=1000)
    vocab = Vocab.build(w for t in trees for w in t.words())
    print(f"Tree-LSTM on {len(trees)} trees, minibatches of {args.batch_size}, "
          f"{args.threads} thread(s), about {args.seconds:.0f} s per strategy\n")
    rows = {s: train(s, trees, vocab, args.seconds, args.batch_size, args.steps)
            for s in ("none", "depth", "agenda", "auto")}
    columns = list(next(iter(rows.values())))
    print(f"| strategy | {' | '.join(columns)} |")
    print("|---" * (len(columns) + 1) + "|")
    for strategy, row in rows.items():
        cells = " | ".join(f"{row[c]:.4f}" if c.startswith("loss") else f"{row[c]:.0f}"
                           for c in columns)
        print(f"| {strategy} | {cells} |")
    speedup = rows["auto"]["trees/s"] / rows["none"]["trees/s"]
    print(f"\nauto (the default): {speedup:.1f}x the throughput of none, "
          f"{rows['none']['launches'] / rows['auto']['launches']:.0f}x fewer launches")


if __name__ == "__main__":
    main()
