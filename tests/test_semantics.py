"""Value semantics: a lazy, batched graph computes what eager PyTorch computes at each call.

- Values are read at the call for inputs (tensors and arrays are copied then, so a buffer
  reused afterwards does not change the node), and when the forward runs for parameters and
  embedding tables (an optimizer step between forwards is seen by the next forward).
- Grad mode is the one in force when a node is written, as eagerly: a node written under
  `torch.no_grad()` carries no gradient; a forward forced under `no_grad` (a value peek)
  computes the same autograd graph as any other.
- Randomness: every random node draws its own sample (two dropouts of one expression have
  independent masks, whatever the batching), and draws it when it is written: a seeded program
  draws the masks eager PyTorch draws, under every strategy.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flybatch as fb
from flybatch.errors import ExecutionError
from flybatch.graph import STRATEGIES

F64 = torch.float64


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, dtype=F64))


# ---- grad mode (item 1) --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_value_peeked_under_no_grad_keeps_the_gradient_of_the_forward_it_forced(strategy, mode):
    torch.manual_seed(0)
    W = _param(3, 3)
    x = torch.randn(3, dtype=F64)
    with fb.Graph(strategy, dtype=F64):
        score = fb.sum_elems(fb.tanh(fb.matmul(W, x)))
        with mode():
            peeked = score.item()  # forces the forward with grad off
        score.backward()
    expected = torch.tanh(W @ x).sum()
    assert peeked == pytest.approx(expected.item())
    (grad,) = torch.autograd.grad(expected, W)
    assert W.grad is not None
    torch.testing.assert_close(W.grad, grad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_node_written_under_no_grad_carries_no_gradient(strategy):
    torch.manual_seed(0)
    W = _param(3, 3)
    x = torch.randn(3, dtype=F64)
    with fb.Graph(strategy, dtype=F64):
        with torch.no_grad():
            target = fb.matmul(W, x)  # a fixed target, as eagerly
        loss = fb.squared_distance(fb.matmul(W, x) * 2.0, target)
        assert not target.value().requires_grad
        loss.backward()
    target_eager = (W @ x).detach()
    expected = ((W @ x * 2.0 - target_eager) ** 2).sum()
    (grad,) = torch.autograd.grad(expected, W)
    torch.testing.assert_close(W.grad, grad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_loss_made_with_grad_inside_a_no_grad_region_back_propagates_as_eagerly(strategy):
    torch.manual_seed(0)
    W = _param(3, 3)
    x = torch.randn(3, dtype=F64)
    with torch.no_grad(), fb.Graph(strategy):
        with torch.enable_grad():
            loss = torch.tanh(W @ x).sum()
        assert loss.requires_grad
        loss.backward()  # backward needs no grad mode, eagerly either
    expected = torch.tanh(W @ x).sum()
    (grad,) = torch.autograd.grad(expected, W)
    torch.testing.assert_close(W.grad, grad)


def test_each_node_takes_the_grad_mode_in_force_at_its_call_through_nesting_and_switches():
    W = _param(2, 2)
    x = torch.ones(2, dtype=F64)
    with fb.Graph("agenda", dtype=F64) as graph:
        on = fb.matmul(W, x)
        with torch.no_grad():
            off = fb.matmul(W, x)
            with torch.enable_grad():
                on_inside_off = fb.matmul(W, x)
            off_again = fb.matmul(W, x)
        with torch.inference_mode():
            off_inference = fb.tanh(on)
        torch.set_grad_enabled(False)
        try:
            off_switched = fb.tanh(on)
        finally:
            torch.set_grad_enabled(True)
        on_again = fb.tanh(on)
        nodes = [on, off, on_inside_off, off_again, off_inference, off_switched, on_again]
        graph.forward(nodes)
        assert [n.value().requires_grad for n in nodes] == [True, False, True, False, False,
                                                            False, True]


def test_nodes_written_with_and_without_grad_do_not_share_a_kernel():
    W = _param(2, 2)
    with fb.Graph("agenda", dtype=F64) as g:
        a = fb.matmul(W, torch.ones(2, dtype=F64))
        with torch.no_grad():
            b = fb.matmul(W, torch.ones(2, dtype=F64))
        g.forward([a, b])
        assert a.value().requires_grad and not b.value().requires_grad


# ---- randomness (item 2) -------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_dropouts_of_one_expression_draw_independent_masks(strategy):
    torch.manual_seed(0)
    with fb.Graph(strategy, dtype=F64):
        x = fb.input(torch.ones(4096, dtype=F64))
        d1, d2 = fb.dropout(x, 0.5), fb.dropout(x, 0.5)
        m1, m2 = d1.value() != 0, d2.value() != 0
    assert not torch.equal(m1, m2)
    agree = (m1 == m2).double().mean().item()
    assert 0.45 < agree < 0.55  # independent halves agree about half the time


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dropouts_of_one_shared_parameter_draw_independent_masks(strategy):
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.ones(64, 64, dtype=F64))
    with fb.Graph(strategy, dtype=F64) as g:
        ds = [fb.dropout(W, 0.5) for _ in range(3)]
        masks = [v != 0 for v in g.forward(ds)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_seeded_program_draws_the_dropout_masks_eager_draws(strategy):
    """Masks are drawn in program order, as eagerly, even with other draws between them and
    dropouts at several depths (a kernel drawing per batch would draw in batch order)."""
    torch.manual_seed(0)
    W = _param(6, 6)
    xs = [torch.randn(6, dtype=F64) for _ in range(4)]

    def instance(B, x):
        h = B.dropout(B.tanh(B.matmul(W, x)), 0.5)
        noise = torch.rand(6, dtype=F64)  # another draw of the same generator, in between
        return B.sum_elems(B.cmult(B.dropout(B.tanh(B.matmul(W, h)), 0.3), noise))

    torch.manual_seed(7)
    eager = torch.stack([instance(_Eager, x) for x in xs])
    eager.sum().backward()
    eager_grad, W.grad = W.grad, None
    torch.manual_seed(7)
    with fb.Graph(strategy, dtype=F64) as g:
        losses = [instance(fb, x) for x in xs]
        batched = torch.stack(g.forward(losses))
        fb.esum(losses).backward()
    torch.testing.assert_close(batched, eager.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(W.grad, eager_grad, rtol=0, atol=1e-12)


class _Eager:
    """The ops of `instance` above, eagerly."""
    dropout = staticmethod(lambda x, p: torch.nn.functional.dropout(x, p))
    tanh, matmul, cmult = staticmethod(torch.tanh), staticmethod(torch.matmul), \
        staticmethod(torch.mul)
    sum_elems = staticmethod(torch.sum)


def test_dropout_scales_kept_elements_and_passes_gradients_through_the_mask():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.ones(1000, dtype=F64))
    with fb.Graph(dtype=F64):
        d = fb.dropout(W, 0.25)
        fb.sum_elems(d).backward()
        value = d.value().detach()
    kept = value != 0
    torch.testing.assert_close(value[kept], torch.full_like(value[kept], 1 / 0.75))
    torch.testing.assert_close(W.grad, value)  # d(sum)/dW = mask / (1 - p)


def test_dropout_with_training_false_is_the_identity():
    with fb.Graph(dtype=F64):
        x = fb.input(torch.randn(5, dtype=F64))
        assert fb.dropout(x, 0.5, training=False) is x
        torch.testing.assert_close(fb.dropout(x, 0.9, training=False).value(), x.value())


# ---- inputs are read at the call (items 3, 22) ----------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_an_input_keeps_the_value_it_had_at_the_call(strategy, kind):
    buf = torch.zeros(3, dtype=F64) if kind == "tensor" else np.zeros(3)
    with fb.Graph(strategy, dtype=F64) as g:
        xs = []
        for i in range(3):
            buf.fill(3 * i) if kind == "ndarray" else buf.fill_(3 * i)
            xs.append(fb.input(buf))
        values = g.forward(xs)
    assert [v.tolist() for v in values] == [[0, 0, 0], [3, 3, 3], [6, 6, 6]]


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_an_operand_keeps_the_value_it_had_at_the_call(kind):
    buf = torch.zeros(2, dtype=F64) if kind == "tensor" else np.zeros(2)
    with fb.Graph(dtype=F64) as g:
        one = fb.input(torch.ones(2, dtype=F64))
        sums = []
        for i in range(3):
            buf[:] = i
            sums.append(one + buf)
        values = g.forward(sums)
    assert [v.tolist() for v in values] == [[1, 1], [2, 2], [3, 3]]


def test_an_input_on_the_meta_device_raises_at_the_call():
    with fb.Graph():
        with pytest.raises(ValueError, match="meta"):
            fb.input(torch.zeros(3, device="meta"))


# ---- computed tensors with grad history (item 4) ----------------------------------------------------
@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_computed_tensors_with_grad_are_batched_inputs_whose_gradient_flows_back(strategy):
    torch.manual_seed(0)
    A = _param(3, 4)
    x = torch.randn(4, dtype=F64)
    per_instance = [A * (i + 1) for i in range(5)]  # non-leaf, requires grad
    with fb.Graph(strategy, dtype=F64) as g:
        total = fb.esum([fb.sum_elems(fb.tanh(fb.matmul(M, x))) for M in per_instance])
        total.backward()
        launches = g.stats().by_signature
    expected = sum(torch.tanh(M @ x).sum() for M in per_instance)
    (grad,) = torch.autograd.grad(expected, A)
    torch.testing.assert_close(A.grad, grad)
    matmuls = sum(n for sig, n in launches.items() if sig.startswith("matmul"))
    assert matmuls == 1  # the five per-instance matrices share one batched product


# ---- parameters and tables are read when the forward runs (item 10) ---------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_and_tables_rebound_between_forwards_are_read_at_the_next_forward(strategy):
    W = torch.nn.Parameter(torch.ones(2, 2, dtype=F64))
    E = torch.nn.Parameter(torch.ones(3, 2, dtype=F64))
    x = torch.ones(2, dtype=F64)
    with fb.Graph(strategy, dtype=F64):
        before = (fb.matmul(W, x) + fb.lookup(E, 0)).value().tolist()
        W.data = torch.full((2, 2), 2.0, dtype=F64)
        E.data = torch.full((3, 2), 2.0, dtype=F64)
        after = (fb.matmul(W, x) + fb.lookup(E, 0)).value().tolist()
    assert before == [3.0, 3.0]
    assert after == [6.0, 6.0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_parameter_updated_in_place_between_forwards_is_read_at_the_next_forward(strategy):
    W = torch.nn.Parameter(torch.ones(2, dtype=F64))
    with fb.Graph(strategy, dtype=F64):
        first = fb.sum_elems(W * 1.0).item()
        with torch.no_grad():
            W.mul_(3.0)
        second = fb.sum_elems(W * 1.0).item()
    assert (first, second) == (2.0, 6.0)


# Eagerly a node is computed at its call: one recorded before a parameter or table is written
# in place or rebound, and not computed yet, must not see the write.
WRITES = {
    "W.data.copy_": lambda W, E: W.data.copy_(W.data * 2),
    "W.data[0] = 5": lambda W, E: W.data.__setitem__(0, 5.0),
    "W.add_ under no_grad": lambda W, E: W.add_(1.0),
    "W.data = ...": lambda W, E: setattr(W, "data", W.data * 3),
    "nn.init.normal_(W)": lambda W, E: torch.nn.init.normal_(W),
    "an optimizer's step": lambda W, E: torch.optim.Adam([W, E], lr=0.5).step(),
    "E.data.mul_": lambda W, E: E.data.mul_(-2.0),
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nodes_recorded_before_a_parameter_is_written_keep_its_value_at_their_call(strategy,
                                                                                       write):
    torch.manual_seed(0)
    W, E = _param(3, 3), _param(4, 3)
    W.grad, E.grad = torch.ones_like(W), torch.ones_like(E)
    x = torch.randn(3, dtype=F64)

    def model():  # the torch code and the fb ops, both read when the forward runs
        return torch.tanh(W @ x) + fb.lookup(E, 1) * fb.sum_elems(fb.matmul(W, x))

    with torch.no_grad():
        expected_before = torch.tanh(W @ x) + E[1] * (W @ x).sum()
    with fb.Graph(strategy):
        before = model()  # recorded, not computed
        with torch.no_grad():
            WRITES[write](W, E)
        after = model()
        values = [before.value().detach(), after.value().detach()]
    with torch.no_grad():
        expected_after = torch.tanh(W @ x) + E[1] * (W @ x).sum()
    torch.testing.assert_close(values, [expected_before, expected_after], rtol=0, atol=1e-12)


# A write with expressions into another tensor object of a frozen table's storage (`.data`,
# `.detach()`) is in the storage, as eagerly, when the table itself is read: by an eager torch
# call (no expression among its arguments), as an input or as an embedding's table.
ALIAS_WRITES = {
    "E.weight.data[1] = h": lambda E, h: E.weight.data.__setitem__(1, h),
    "E.weight.detach()[1] = h": lambda E, h: E.weight.detach().__setitem__(1, h),
    "E.weight.data.copy_(rows)": lambda E, h: E.weight.data.copy_(
        torch.stack([h, 2 * h, -h, h + 1, h * h])),
    "buffer.detach().add_(h)": lambda E, h: E.memory.detach().add_(h),
}
TABLE_READS = {
    "eager E(ids)": lambda E, h: E(torch.tensor([1, 2, 4])).sum(0) + E.memory,
    "eager E.weight.sum(0)": lambda E, h: E.weight.sum(0) + E.memory * 1.0,
    "input E.weight @ h": lambda E, h: E.weight.T @ (E.weight @ h) + E.memory.tanh() * h,
    "table F.embedding(ids)": lambda E, h: F.embedding((h > 9).long() + 1, E.weight).sum(0)
    + F.embedding((h > 9).long(), E.memory[None]).sum(0),  # ids computed per instance
}


def _frozen_table() -> torch.nn.Embedding:
    torch.manual_seed(0)
    E = torch.nn.Embedding(5, 3).double().requires_grad_(False)
    E.register_buffer("memory", torch.randn(3, dtype=F64))
    return E


@pytest.mark.parametrize("read", TABLE_READS)
@pytest.mark.parametrize("write", ALIAS_WRITES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_frozen_table_written_through_an_alias_is_read_with_the_write(strategy, write, read):
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=F64))

    def step(E):
        h = torch.tanh(p * 2)
        ALIAS_WRITES[write](E, h)
        return ((TABLE_READS[read](E, h) * p).sum() + h.sum(),
                E.weight.detach().clone(), E.memory.detach().clone())

    E = _frozen_table()
    loss, *tables = step(E)
    loss.backward()
    want, grad, p.grad = loss.item(), p.grad, None
    E = _frozen_table()
    with fb.Graph(strategy):
        loss, *_ = step(E)
        loss.backward()
        got = loss.item()
    assert got == pytest.approx(want, abs=1e-12, rel=0)
    torch.testing.assert_close(p.grad, grad, rtol=0, atol=1e-12)
    torch.testing.assert_close([E.weight.detach(), E.memory], tables, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_lookup_of_a_frozen_table_written_through_an_alias_reads_the_write(strategy):
    E, p = _frozen_table(), torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=F64))
    with fb.Graph(strategy):
        E.weight.detach()[1] = torch.tanh(p * 2)
        row = fb.lookup(E.weight, 1)  # the table is read when the forward runs
        torch.testing.assert_close(row.value().detach(), torch.tanh(p.detach() * 2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_instance_tables_written_through_an_alias_under_map_batched(strategy):
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=F64))
    xs = [torch.randn(3, dtype=F64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    base = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(9))

    def loss_of(x):
        table = base.clone()
        table.data[int(x.abs().argmax())] = torch.tanh(p * x)  # a row per instance
        return (table[torch.tensor([0, 1, 2])].sum(0) * p).sum()

    want = sum(loss_of(x) for x in xs)
    want.backward()
    grad, p.grad = p.grad, None
    with fb.Graph(strategy):
        losses = fb.map_batched(loss_of, xs)
        total = torch.stack(losses).sum()
        total.backward()
        assert total.item() == pytest.approx(want.item(), abs=1e-12, rel=0)
    torch.testing.assert_close(p.grad, grad, rtol=0, atol=1e-12)


# ---- errors only a kernel can see (item 19) ----------------------------------------------------------
def test_a_kernel_failure_names_the_op_its_signature_and_the_nodes():
    E = torch.nn.Parameter(torch.randn(10, 3))
    g = fb.Graph()  # no graph block: nothing tells the graph of the rebind below
    row = fb.lookup(E, 9, graph=g)
    E.data = torch.randn(5, 3)  # the table shrank between building and forward
    with pytest.raises(fb.ExecutionError, match=r"lookup.*node") as info:
        row.value()
    assert isinstance(info.value.__cause__, IndexError)
    assert g.n_done == 0
    g.close()


def test_debug_mode_names_the_line_that_wrote_the_failing_node():
    E = torch.nn.Parameter(torch.randn(10, 3))
    g = fb.Graph(debug=True)
    row = fb.lookup(E, 9, graph=g)  # the line the error must name
    E.data = torch.randn(5, 3)
    with pytest.raises(fb.ExecutionError, match=r"test_semantics\.py:\d+") as info:
        row.value()
    assert "fb.lookup(E, 9, graph=g)" in str(info.value)
    g.close()


def test_debug_mode_names_the_users_line_of_a_failing_torch_call_not_torchs():
    embedding = torch.nn.Embedding(10, 3)
    w = torch.nn.Parameter(torch.ones(1))
    with fb.Graph(debug=True):
        row = embedding((w * 11).long())  # an index computed per instance, out of range
        with pytest.raises(fb.ExecutionError, match=r"node.*embedding") as info:
            row.value()
    assert isinstance(info.value.__cause__, IndexError)
    assert "embedding((w * 11).long())" in str(info.value)


# ---- time accounting (item 24) -------------------------------------------------------------------
def test_a_failed_forward_does_not_count_the_build_time_twice():
    E = torch.nn.Parameter(torch.randn(10, 3))
    g = fb.Graph()  # no graph block: nothing tells the graph of the rebinds below
    row = fb.lookup(E, 9, graph=g)
    time.sleep(0.2)  # "building" for 0.2 s
    E.data = torch.randn(5, 3)
    with pytest.raises(fb.ExecutionError):
        row.value()
    first_build = g.seconds["build"]
    E.data = torch.randn(10, 3)
    row.value()  # the retry builds nothing new
    build_again = g.seconds["build"] - first_build
    g.close()
    assert first_build >= 0.2
    assert build_again < 0.1


def test_a_forward_under_no_grad_runs_each_batch_in_its_own_grad_mode_and_leaves_grad_off():
    W = torch.nn.Parameter(torch.randn(3, 3, dtype=F64))
    with fb.Graph(strategy="agenda") as g:
        tracked = fb.tanh(W @ fb.input(torch.ones(3, dtype=F64)))
        with torch.no_grad():
            untracked = fb.tanh(W @ fb.input(torch.ones(3, dtype=F64)))
            g.forward()
            assert not torch.is_grad_enabled()
        assert tracked.value().requires_grad and not untracked.value().requires_grad
        torch.testing.assert_close(tracked.value().detach(), untracked.value())


def test_a_forward_under_no_grad_whose_kernel_fails_leaves_grad_off():
    W = torch.nn.Parameter(torch.randn(3, 3, dtype=F64))
    with fb.Graph(strategy="agenda") as g:
        x = fb.tanh(W @ fb.input(torch.ones(3, dtype=F64)))
        with torch._C.DisableTorchFunction():  # not seen by the graph's capture
            W.data = W.data.float()  # the kernel then multiplies float by double: it fails
        with torch.no_grad():
            with pytest.raises(ExecutionError):
                g.forward([x])
            assert not torch.is_grad_enabled()
