"""Training step of an unchanged PyTorch BiLSTM tagger inside `fb.Graph()`, for A/B runs.

    PYTHONPATH=<checkout>/src taskset -c 0 python scripts/torch_native_tagger.py [--mode eager]

The model is written for ONE sentence (embedding -> bidirectional nn.LSTM -> nn.Linear ->
log_softmax -> NLL summed over its tokens); a minibatch is 64 synthetic sentences of 5-40
tokens, the same ones in every run. Prints one JSON line: the CPU milliseconds of a training
step (forward, backward, Adam step; thread time, so that other processes on a shared machine
count less) as the median over `--steps` minibatches after `--warmup`, the graph's phases and
kernel launches, and the first minibatch's loss. Alternate it between two checkouts, one
process per run, and compare medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flybatch as fb

VOCAB, TAGS, EMBED, HIDDEN, BATCH = 5000, 17, 64, 128, 64


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMBED)
        self.lstm = nn.LSTM(EMBED, HIDDEN, bidirectional=True)
        self.out = nn.Linear(2 * HIDDEN, TAGS)

    def forward(self, words: torch.Tensor) -> torch.Tensor:  # ONE sentence of word ids
        embeds = self.emb(words)
        lstm_out, _ = self.lstm(embeds.view(len(words), 1, -1))
        return F.log_softmax(self.out(lstm_out.view(len(words), -1)), dim=1)


def minibatches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        lengths = torch.randint(5, 41, (BATCH,), generator=gen).tolist()
        yield [(torch.randint(VOCAB, (n,), generator=gen),
                torch.randint(TAGS, (n,), generator=gen)) for n in lengths]


def step(model, opt, batch, mode: str):
    opt.zero_grad(set_to_none=True)
    if mode == "eager":
        loss = sum(F.nll_loss(model(words), tags, reduction="sum") for words, tags in batch)
        loss.backward()
        opt.step()
        return loss.item(), None
    with fb.Graph(strategy=mode) as g:
        loss = sum(F.nll_loss(model(words), tags, reduction="sum") for words, tags in batch)
        loss.backward()
        value, stats = loss.item(), g.stats()
    opt.step()
    return value, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="auto", help="eager, or a flybatch strategy")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = minibatches(0)
    first, _ = step(model, opt, next(batches), args.mode)
    for _ in range(args.warmup):
        step(model, opt, next(batches), args.mode)
    cpu, phases, launches = [], [], []
    for _ in range(args.steps):
        start = time.thread_time()
        _, stats = step(model, opt, next(batches), args.mode)
        cpu.append(time.thread_time() - start)
        if stats is not None:
            phases.append(stats.seconds)
            launches.append(stats.batches)
    names = sorted({name for p in phases for name in p})
    print(json.dumps({
        "mode": args.mode, "step_cpu_ms": round(1e3 * statistics.median(cpu), 1),
        **{f"{name}_ms": round(1e3 * statistics.median(p[name] for p in phases), 1)
           for name in names},
        "launches": statistics.median(launches) if launches else None,
        "first_loss": round(first, 4)}))


if __name__ == "__main__":
    main()
