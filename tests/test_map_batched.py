"""`fb.map_batched`: per-instance code with value-dependent control flow, batched across instances.

Each instance runs in its own greenlet; a value request suspends it until every live instance is
suspended or finished, then ONE batched forward serves them all. These tests check that values
and gradients equal running `fn` sequentially per item (every strategy, float64), that the
number of forwards is exactly the largest number of value requests of one instance, that batching
really happens, and the edge cases: order, recursion, nesting, exceptions, graph hygiene.
"""

from __future__ import annotations

import greenlet
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flybatch as fb
from flybatch import nn
from flybatch.bench.arc_hybrid import Config, static_oracle
from flybatch.graph import STRATEGIES, Op

RTOL, ATOL = 1e-10, 1e-12


# ---- a small model with value-dependent loops and branches --------------------------------------
class StepModel(torch.nn.Module):
    """Embed a token, step a GRU, score 3 classes; the scores decide the loss and when to stop."""

    def __init__(self, seed: int = 0, vocab: int = 7, dim: int = 4, hidden: int = 5):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.cell = nn.GRUCell(dim, hidden)
        self.out = nn.MLP([hidden, 6, 3])
        self.double()


def stepper(model: StepModel):
    """fn(item): keep stepping while the best score stays >= threshold, up to max_steps."""

    def fn(item):
        tokens, max_steps, threshold = item
        h, losses, trace = None, [], []
        t = 0
        while True:
            h = model.cell(model.emb(tokens[t % len(tokens)]), h)
            scores = model.out(h)
            best = scores.argmax()                      # value request: suspends
            if best == 2:
                losses.append(fb.pick_neg_log_softmax(scores, 0))
            elif float(fb.sum_elems(h)) > 0:            # value request on a new node
                losses.append(fb.square(scores[best]))
            else:
                losses.append(fb.tanh(fb.sum_elems(h)) * 0.5)
            trace.append(best)
            t += 1
            if t >= max_steps or scores[best] < threshold:   # comparison: a value request
                break
        return fb.esum(losses), trace

    return fn


def _zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_sequential(model, fn, items, strategy):
    """The reference: `fn` on each item alone, in its own graph; grads summed over items."""
    _zero_grads(model)
    values, traces = [], []
    for item in items:
        with fb.Graph(strategy, dtype=torch.float64):
            loss, trace = fn(item)
            values.append(loss.value().detach().clone())
            traces.append(trace)
            loss.backward()
    return values, traces, _grads(model)


def run_batched(model, fn, items, strategy):
    _zero_grads(model)
    with fb.Graph(strategy, dtype=torch.float64) as g:
        results = fb.map_batched(fn, items)
        losses = [loss for loss, _ in results]
        fb.esum(losses).backward()
        values = [loss.value().detach().clone() for loss in losses]
        traces = [trace for _, trace in results]
        assert g.before_value_request is None
    return values, traces, _grads(model)


def assert_same(a, b):
    values_a, traces_a, grads_a = a
    values_b, traces_b, grads_b = b
    assert traces_a == traces_b
    for x, y in zip(values_a, values_b):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=RTOL, atol=ATOL)


MODEL = StepModel()
STEP = stepper(MODEL)

item_strategy = st.tuples(
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.integers(1, 8),
    st.sampled_from([-1.0, 0.0, 0.1, 0.2, 0.3]),
)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(items=st.lists(item_strategy, min_size=1, max_size=6), strategy=st.sampled_from(STRATEGIES))
def test_equals_sequential_property(items, strategy):
    assert_same(run_batched(MODEL, STEP, items, strategy),
                run_sequential(MODEL, STEP, items, strategy))


FIXED_ITEMS = [([1, 2, 3], 8, 0.0), ([4], 3, -1.0), ([0, 5], 8, 0.2), ([6, 6, 1], 1, 0.3),
               ([2, 2], 8, 0.1), ([3, 0, 4, 1], 6, -1.0), ([5], 8, 0.25), ([1], 2, 0.0)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_equals_sequential_every_strategy(strategy):
    batched = run_batched(MODEL, STEP, FIXED_ITEMS, strategy)
    assert_same(batched, run_sequential(MODEL, STEP, FIXED_ITEMS, strategy))
    lengths = {len(trace) for trace in batched[1]}
    assert len(lengths) > 2, "the fixed items should make loops of several lengths"


def test_batching_happens():
    items = [FIXED_ITEMS[i % len(FIXED_ITEMS)] for i in range(24)]
    with fb.Graph(dtype=torch.float64) as g:
        fb.map_batched(STEP, items)
        batched = len(g.launches)
    with fb.Graph(dtype=torch.float64) as g:
        [STEP(item) for item in items]              # plain loop: every request forwards alone
        sequential = len(g.launches)
    assert batched * 5 < sequential, (batched, sequential)


# ---- results, counting forwards -----------------------------------------------------------------
def requester(k: int):
    """k value requests, each on a new node, plus repeated requests that must not cost a round."""
    x = fb.input([1.0, -2.0])
    seen = []
    for i in range(k):
        x = fb.tanh(x * 0.5 + float(i))
        seen.append(x.numpy().tolist())              # suspends
        assert x.numpy().tolist() == seen[-1]        # already computed: no round
    return fb.sum_elems(x), seen, k


def test_results_in_order_and_equal_plain_calls():
    ks = [3, 0, 7, 2, 5, 7, 1]
    with fb.Graph():
        results = fb.map_batched(requester, ks)
        assert [k for _, _, k in results] == ks
        got = [(s.item(), seen) for s, seen, _ in results]
    with fb.Graph():
        want = [(s.item(), seen) for s, seen, _ in map(requester, ks)]
    assert got == want


def test_forward_count_is_the_max_not_the_sum():
    ks = [3, 0, 7, 2, 5, 7, 1]
    with fb.Graph() as g:
        results = fb.map_batched(requester, ks)
        assert g.forwards == max(ks)                 # one forward per round
        fb.esum([s for s, _, _ in results]).value()
        assert g.forwards == max(ks) + 1             # plus the final forward
    with fb.Graph() as g:                            # without map_batched: the sum
        [requester(k) for k in ks]
        assert g.forwards == sum(ks)


def test_computed_values_never_suspend():
    with fb.Graph() as g:
        base = fb.tanh(fb.input([0.5, 1.5]))
        base.value()
        assert g.forwards == 1

        shared = torch.ones(2, requires_grad=True)

        def fn(i):
            total = base.numpy().sum()                   # computed: no round
            total += float(fb.parameter(shared).value().detach().sum())   # one shared pending node
            return total + i

        expected = float(torch.tanh(torch.tensor([0.5, 1.5])).sum()) + 2
        assert fb.map_batched(fn, range(5)) == pytest.approx([expected + i for i in range(5)])
        assert g.forwards == 2                       # one round for all five instances


def test_empty_items_and_no_requests():
    with fb.Graph() as g:
        assert fb.map_batched(requester, []) == []
        out = fb.map_batched(lambda i: fb.input([float(i)]), range(4))
        assert g.forwards == 0 and all(e.graph is g for e in out)
        assert [e.item() for e in out] == [0.0, 1.0, 2.0, 3.0]
        assert g.forwards == 1


def test_explicit_graph_becomes_current_inside_fn():
    with fb.Graph() as outer:
        other = fb.Graph(dtype=torch.float64)
        out = fb.map_batched(lambda k: requester(k)[0], [1, 2], graph=other)
        assert all(e.graph is other for e in out) and other.forwards == 2
        assert fb.current_graph() is outer and outer.n_nodes == 0
    other.close()


def test_each_instance_keeps_its_own_current_graph():
    with fb.Graph() as g:
        def fn(i):
            with fb.Graph() as local:
                x = fb.input([float(i)], graph=g)
                x.item()                             # suspends while `local` is current
                assert fb.current_graph() is local
                y = fb.input([1.0])
                assert y.graph is local
            return fb.input([float(i)]).graph is g and fb.current_graph() is g

        assert fb.map_batched(fn, range(3)) == [True, True, True]
        assert fb.current_graph() is g


# ---- the transition parser and recursion ------------------------------------------------
class Parser(torch.nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 4, hidden: int = 8):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(vocab + 1, dim)      # the last row stands for "none"
        self.mlp = nn.MLP([2 * dim, hidden, 3])
        self.none = vocab
        self.double()


def parse_fn(parser: Parser):
    def parse(sentence):                             # ONE sentence, plain Python
        words, heads = sentence
        enc = [fb.tanh(parser.emb(w)) for w in words] + [parser.emb(parser.none)]
        state, loss = Config(len(words)), []
        while not state.done():
            s0 = enc[state.stack[-1]] if state.stack else enc[-1]
            scores = parser.mlp(fb.concat([s0, enc[state.buf]]))
            values = scores.numpy()                  # needs a value: this instance pauses
            legal = state.legal()
            best = max(legal, key=lambda t: values[t])
            loss.append(fb.pick_neg_log_softmax(scores, static_oracle(state, heads)))
            state.apply(best)
        return fb.esum(loss), list(state.heads)

    return parse


def test_transition_parser():
    parser = Parser()
    parse = parse_fn(parser)
    gen = torch.Generator().manual_seed(3)
    sentences = []
    for n in [3, 7, 1, 5, 6, 2]:
        words = torch.randint(0, 10, (n,), generator=gen).tolist()
        heads = [n] + [0] * (n - 1)                  # word 0 under ROOT, the rest under word 0
        sentences.append((words, heads))
    for strategy in STRATEGIES:
        want = run_sequential(parser, parse, sentences, strategy)
        with fb.Graph(strategy, dtype=torch.float64) as g:
            _zero_grads(parser)
            results = fb.map_batched(parse, sentences)
            assert g.forwards == max(2 * len(w) for w, _ in sentences)   # 2n steps, n words
            fb.esum([loss for loss, _ in results]).backward()
            got = ([loss.value().clone() for loss, _ in results],
                   [heads for _, heads in results], _grads(parser))
        assert_same(got, want)


class TreeModel(torch.nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        torch.manual_seed(2)
        self.node = nn.Linear(dim, dim)
        self.left, self.right = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.merge = nn.Linear(2 * dim, dim)
        self.double()


def tree_fn(model: TreeModel):
    def grow(x, depth, max_depth, shape):
        h = fb.tanh(model.node(x))
        if depth < max_depth and float(fb.sum_elems(h)) > -0.3:   # value-dependent recursion
            shape.append("(")
            left = grow(fb.tanh(model.left(h)), depth + 1, max_depth, shape)
            right = grow(fb.tanh(model.right(h)) + x, depth + 1, max_depth, shape)
            shape.append(")")
            return fb.tanh(model.merge(fb.concat([left, right])))
        shape.append(".")
        return h

    def fn(item):
        x, max_depth = item
        shape = []
        root = grow(fb.input(x), 0, max_depth, shape)
        return fb.squared_norm(root), "".join(shape)

    return fn


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_value_dependent_recursion(strategy):
    model = TreeModel()
    fn = tree_fn(model)
    gen = torch.Generator().manual_seed(5)
    items = [(torch.randn(4, generator=gen, dtype=torch.float64).tolist(), d)
             for d in [0, 3, 1, 4, 2, 3, 4]]
    got = run_batched(model, fn, items, strategy)
    assert_same(got, run_sequential(model, fn, items, strategy))
    assert len(set(got[1])) > 3, "the trees should have several shapes"


# ---- nesting ------------------------------------------------------------------------------------
def test_nested_map_batched_shares_the_outer_forwards():
    groups = [[3, 1], [0], [5, 2, 2], [1, 4]]
    own = [2, 0, 1, 3]                               # requests an outer instance makes itself

    def outer(group_index):
        requester(own[group_index])
        inner = fb.map_batched(requester, groups[group_index])
        return [s.item() for s, _, _ in inner]      # one more round: the inner results

    with fb.Graph() as g:
        got = fb.map_batched(outer, range(len(groups)))
        # outer instance i waits own[i] + max(groups[i]) + 1 rounds; the longest decides
        assert g.forwards == max(o + max(gr) + 1 for o, gr in zip(own, groups))
        assert g.before_value_request is None
    with fb.Graph():
        want = [[requester(k)[0].item() for k in gr] for gr in groups]
    assert got == want


def test_nested_map_batched_on_another_graph():
    def outer(k):
        requester(k)
        with fb.Graph() as inner:
            values = [s.item() for s, _, _ in fb.map_batched(requester, [k, k + 1])]
            return values, inner.forwards

    with fb.Graph() as g:
        results = fb.map_batched(outer, [1, 3, 2])
        assert g.forwards == 3
    assert [forwards for _, forwards in results] == [3, 5, 4]   # k+1 rounds + the final one


# ---- exceptions ---------------------------------------------------------------------------------
class Boom(ValueError):
    pass


def test_exception_propagates_with_index_and_kills_the_others():
    started, finished, cleaned, lets = [], [], [], []

    def fn(i):
        started.append(i)
        lets.append(greenlet.getcurrent())
        try:
            requester(2)
            if i == 3:
                raise Boom(f"bad item {i}")
            requester(5)
            finished.append(i)
            return i
        finally:
            cleaned.append(i)

    with fb.Graph() as g:
        with pytest.raises(fb.MapBatchedError, match=r"instance 3 .*Boom: bad item 3") as info:
            fb.map_batched(fn, range(6))
        err = info.value
        assert err.index == 3 and isinstance(err.original, Boom)
        assert err.__cause__ is err.original
        assert started == list(range(6)) and finished == []
        assert sorted(cleaned) == list(range(6))     # every instance unwound (finally ran)
        assert all(let.dead for let in lets)         # no greenlet left suspended
        assert g.before_value_request is None
        # The graph stays usable: the dead instances' pending nodes are just computed later.
        assert fb.input([2.0]).item() == 2.0
        results = fb.map_batched(requester, [2, 1])
        assert [s.item() for s, _, _ in results] == pytest.approx(
            [requester(2)[0].item(), requester(1)[0].item()])


def test_exception_before_any_request_stops_the_start():
    started = []

    def fn(i):
        started.append(i)
        if i == 1:
            raise KeyError("no")
        return requester(3)

    with fb.Graph() as g:
        with pytest.raises(fb.MapBatchedError) as info:
            fb.map_batched(fn, range(4))
        assert info.value.index == 1 and isinstance(info.value.__cause__, KeyError)
        assert started == [0, 1]                     # later items never start
        assert g.before_value_request is None and g.forwards == 0


def test_nested_exception_reports_both_indices():
    def outer(i):
        return fb.map_batched(lambda k: 1 / (requester(k)[2] - 2), [1, i])

    with fb.Graph() as g:
        with pytest.raises(fb.MapBatchedError) as info:
            fb.map_batched(outer, [0, 1, 2, 3])
        err = info.value
        assert err.index == 2 and isinstance(err.original, fb.MapBatchedError)
        assert err.original.index == 1 and isinstance(err.original.original, ZeroDivisionError)
        assert g.before_value_request is None


def test_failing_forward_propagates_unchanged():
    def broken(xs, attr, shape):
        raise RuntimeError("kernel failed")

    bad = Op("broken", broken)
    cleaned = []

    def fn(i):
        try:
            g = fb.current_graph()
            x = fb.input([float(i)])
            y = g.add(bad, (x.id,), (1,), ("broken",)) if i == 2 else fb.tanh(x)
            return y.item()
        finally:
            cleaned.append(i)

    with fb.Graph() as g:
        with pytest.raises(RuntimeError, match="kernel failed"):
            fb.map_batched(fn, range(4))
        assert sorted(cleaned) == [0, 1, 2, 3] and g.before_value_request is None
        assert g.forwards == 0


def test_user_hook_is_chained_and_restored():
    calls = []

    def user_hook():
        calls.append("hook")

    with fb.Graph() as g:
        g.before_value_request = user_hook
        fb.map_batched(requester, [1, 2])
        assert calls == ["hook", "hook"]             # once before each round's forward
        assert g.before_value_request is user_hook
