"""Random programs with value semantics traps, against eager PyTorch under every strategy.

Each instance runs a random program that reuses one input buffer (a tensor) and one ndarray
for every input it writes, mutates them right after writing, mixes `torch.no_grad()` regions,
dropouts and value peeks (some under `no_grad`, some steering value-dependent branches), and
passes computed tensors with grad history as operands. flybatch (under each strategy, with a
plain loop over instances and with `map_batched`) must give eager PyTorch's values and
gradients. Dropout masks are random, so the eager run replays the masks flybatch drew (read off
its outputs; dropout inputs are kept positive so a zero output means a dropped element).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import eager
import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64
TOL = eager.TOLERANCE[F64]
H = 3
P_DROP = 0.5

KINDS = ("input", "operand", "ndarray", "matmul", "lookup", "no_grad", "peek", "peek_no_grad",
         "branch", "dropout", "computed")
instruction = st.tuples(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 50))
program = st.lists(instruction, min_size=1, max_size=8)


def _value(x) -> torch.Tensor:
    return x.value() if isinstance(x, fb.Expression) else x


class Params:
    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.W = torch.nn.Parameter(torch.randn(H, H, generator=gen, dtype=F64) * 0.5)
        self.E = torch.nn.Parameter(torch.randn(5, H, generator=gen, dtype=F64))
        self.v = torch.nn.Parameter(torch.randn(H, generator=gen, dtype=F64))

    def all(self):
        return [self.W, self.E, self.v]


def run_program(B, params: Params, steps, dropout) -> list:
    """One instance: the program over a pool of values; returns every value it made."""
    buf = torch.zeros(H, dtype=F64)
    arr = np.zeros(H)
    pool = [B.mul(params.v, 1.0)]
    for kind, a, b in steps:
        x = pool[a % len(pool)]
        if kind == "input":
            buf.fill_(a - b)
            pool.append(B.input(buf))
            buf.fill_(1000.0)  # written after the call: must not be seen
        elif kind == "operand":
            buf.copy_(torch.arange(H, dtype=F64) * b)
            pool.append(B.add(x, buf))
            buf.zero_()
        elif kind == "ndarray":
            arr[:] = np.arange(H) - b
            pool.append(B.mul(x, arr))
            arr[:] = -1000.0
        elif kind == "matmul":
            pool.append(B.tanh(B.matmul(params.W, x)))
        elif kind == "lookup":
            pool.append(B.add(B.lookup(params.E, b % 5), x))
        elif kind == "no_grad":
            with torch.no_grad():
                pool.append(B.tanh(B.matmul(params.W, x)))
        elif kind == "peek":
            pool.append(B.mul(x, float(_value(B.sum_elems(x)).detach())))
        elif kind == "peek_no_grad":
            with torch.no_grad():
                peeked = _value(B.sum_elems(B.matmul(params.W, x))).clone()
            pool.append(B.add(x, float(peeked)))
        elif kind == "branch":  # value-dependent control flow
            if float(_value(B.sum_elems(x)).detach()) > 0:
                pool.append(B.sigmoid(x))
            else:
                pool.append(B.tanh(B.neg(x)))
        elif kind == "dropout":
            pool.append(dropout(B, B.exp(B.tanh(x))))
        elif kind == "computed":  # a tensor with grad history as an operand
            computed = params.W * (b % 3 + 1)
            pool.append(B.tanh(B.matmul(computed, x)))
    return pool


def _fb_dropout(drawn: list):
    def dropout(B, x):
        d = fb.dropout(x, P_DROP)
        drawn.append(d)
        return d
    return dropout


def _replayed_dropout(masks: list):
    masks = iter(masks)

    def dropout(B, x):
        return x * next(masks) / (1 - P_DROP)
    return dropout


def _loss(B, outputs):
    gen = torch.Generator().manual_seed(3)
    terms = [B.sum_elems(B.cmult(o, torch.randn(tuple(o.shape), generator=gen, dtype=F64)))
             for o in outputs]
    return B.esum(terms)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("driver", ["loop", "map_batched"])
@given(programs=st.lists(program, min_size=1, max_size=3))
def test_random_programs_with_value_semantics_traps_match_eager(strategy, driver, programs):
    params = Params()
    drawn: list = []
    with fb.Graph(strategy, dtype=F64) as g:
        fb_dropout = _fb_dropout(drawn)
        if driver == "loop":
            pools = [run_program(fb, params, steps, fb_dropout) for steps in programs]
        else:
            pools = fb.map_batched(lambda steps: run_program(fb, params, steps, fb_dropout),
                                   programs)
        outputs = [x for pool in pools for x in pool]
        loss = _loss(fb, outputs)
        loss.backward()
        values = [v.detach().clone() for v in g.forward(outputs)]
        masks = [(d.value() != 0).to(F64) for d in drawn]
        grad_mode_after = torch.is_grad_enabled()
    grads = [p.grad for p in params.all()]
    assert grad_mode_after

    # Eager reference: the same programs, one instance after another, each replaying the
    # masks its own dropouts drew (instances interleave under map_batched).
    ref_params = Params()
    masks = _masks_by_instance(drawn, masks, pools)
    with eager.Graph(dtype=F64):
        ref_pools = [run_program(eager, ref_params, steps, _replayed_dropout(masks[i]))
                     for i, steps in enumerate(programs)]
        ref_outputs = [x for pool in ref_pools for x in pool]
        _loss(eager, ref_outputs).backward()

    assert len(values) == len(ref_outputs)
    for k, (v, r) in enumerate(zip(values, ref_outputs)):
        torch.testing.assert_close(v, r.detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m, k=k: f"value {k}: {m}")
    for p, (gr, ref) in zip("WEv", zip(grads, [q.grad for q in ref_params.all()])):
        assert (gr is None) == (ref is None), f"gradient presence of {p} differs"
        if ref is not None:
            torch.testing.assert_close(gr, ref, rtol=TOL, atol=TOL,
                                       msg=lambda m, p=p: f"gradient of {p}: {m}")


def _masks_by_instance(drawn, masks, pools):
    """Group the drawn masks by the instance whose pool holds the dropout's expression."""
    owner = {id(x): i for i, pool in enumerate(pools) for x in pool}
    grouped = [[] for _ in pools]
    for d, m in zip(drawn, masks):
        grouped[owner[id(d)]].append(m)
    return grouped
