"""`fb.nn`'s recurrent cells and their `torch.nn` twins: torch's weights load, results agree.

A torch module's state_dict loads into its fb twin, `from_torch` copies it, and the fb twin
computes, per instance and batched over instances of different lengths, the values and the
gradients that the torch module computes eagerly on each instance alone. The only parameter that
does not map one to one is `fb.nn.LSTMCell.bias`: the sum of torch's `bias_ih` and `bias_hh`,
whose gradient is the gradient torch gives each of them. A cell's `State` is read by name.
"""

from __future__ import annotations

import pytest
import torch

import flybatch as fb

F64 = torch.float64
ATOL = 1e-9
IN, H = 4, 3
LENGTHS = [1, 4, 2, 5, 3]
STRATEGIES = ["depth", "agenda"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def seeded(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A float64 module with reproducible weights, each parameter different."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.double().parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.5)
    return module


def sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(IN, generator=gen, dtype=F64) for _ in range(n)] for n in LENGTHS]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)


def assert_same_as_torch(strategy, ours, theirs, ours_on, theirs_on, grads):
    """`ours_on(ours, xs)` in one fb graph over all sequences gives the outputs of
    `theirs_on(theirs, xs)` run eagerly per sequence, and under a random weighting of every
    output, the gradient of each `(our parameter, their parameter)` in `grads`."""
    expected = [o for xs in sequences() for o in theirs_on(theirs, xs)]
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(o.shape, generator=gen, dtype=F64) for o in expected]
    sum((o * w).sum() for o, w in zip(expected, weights)).backward()
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        outs = [o for xs in sequences() for o in ours_on(ours, [fb.input(x) for x in xs])]
        loss = fb.esum([fb.dot(o, w) for o, w in zip(outs, weights)])
        values = g.forward(outs)
        loss.backward()
    assert len(values) == len(expected)
    for value, want in zip(values, expected):
        close(value, want.detach())
    for mine, yours in grads:
        close(ours.get_parameter(mine).grad, theirs.get_parameter(yours).grad)


# ---- per-instance runs: torch eagerly, fb lazily ------------------------------------------------
def torch_lstm_cell_on(cell, xs):
    state, outs = None, []
    for x in xs:
        state = cell(x, state)
        outs += state  # torch's (h, c)
    return outs


def fb_lstm_cell_on(cell, xs):
    state, outs = None, []
    for x in xs:
        state = cell(x, state)
        outs += [state.h, state.c]
    return outs


def gru_cell_on(cell, xs):
    h, outs = None, []
    for x in xs:
        h = cell(x, h)
        outs.append(h)
    return outs


def torch_lstm_on(lstm, xs):
    return list(lstm(torch.stack(xs))[0])  # unbatched: [T, directions * H]


# (our parameter, torch's parameter of the same gradient)
LSTM_CELL_GRADS = [("weight_ih", "weight_ih"), ("weight_hh", "weight_hh"),
                   ("bias", "bias_ih"), ("bias", "bias_hh")]


def lstm_grads(layers: int, bidirectional: bool):
    pairs = []
    for k in range(layers):
        for cells, suffix in [("forward_cells", ""), ("backward_cells", "_reverse")][
                :1 + bidirectional]:
            pairs += [(f"{cells}.{k}.{mine}", f"{yours}_l{k}{suffix}")
                      for mine, yours in LSTM_CELL_GRADS]
    return pairs


LSTM_SHAPES = pytest.mark.parametrize(
    "layers, bidirectional", [(1, False), (3, False), (1, True), (2, True)],
    ids=["1-layer", "3-layer", "1-layer-bi", "2-layer-bi"])


# ---- state_dicts -----------------------------------------------------------------------------
def test_lstm_cell_loads_a_torch_lstm_cell_state_dict_summing_its_two_biases():
    theirs = seeded(torch.nn.LSTMCell(IN, H))
    ours = fb.nn.LSTMCell(IN, H).double()
    ours.load_state_dict(theirs.state_dict())
    close(ours.weight_ih, theirs.weight_ih)
    close(ours.weight_hh, theirs.weight_hh)
    close(ours.bias, theirs.bias_ih + theirs.bias_hh)


def test_gru_cell_loads_a_torch_gru_cell_state_dict_as_it_is():
    theirs = seeded(torch.nn.GRUCell(IN, H))
    ours = fb.nn.GRUCell(IN, H).double()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, p in theirs.named_parameters():
        close(ours.get_parameter(name), p)


@LSTM_SHAPES
def test_lstm_loads_a_torch_lstm_state_dict_layer_by_layer_and_direction(layers, bidirectional):
    theirs = seeded(torch.nn.LSTM(IN, H, num_layers=layers, bidirectional=bidirectional))
    ours = fb.nn.LSTM(IN, H, num_layers=layers, bidirectional=bidirectional).double()
    ours.load_state_dict(theirs.state_dict())
    for k in range(layers):
        for cells, suffix in [(ours.forward_cells, ""), (ours.backward_cells, "_reverse")][
                :1 + bidirectional]:
            torch_param = lambda name: theirs.get_parameter(f"{name}_l{k}{suffix}")  # noqa: E731
            close(cells[k].weight_ih, torch_param("weight_ih"))
            close(cells[k].weight_hh, torch_param("weight_hh"))
            close(cells[k].bias, torch_param("bias_ih") + torch_param("bias_hh"))


def test_a_torch_lstm_inside_a_model_loads_into_the_fb_lstm_in_its_place():
    theirs = torch.nn.ModuleDict({"encoder": seeded(torch.nn.LSTM(IN, H, bidirectional=True)),
                                  "out": torch.nn.Linear(2 * H, 2).double()})
    ours = torch.nn.ModuleDict({"encoder": fb.nn.LSTM(IN, H, bidirectional=True),
                                "out": fb.nn.Linear(2 * H, 2)}).double()
    ours.load_state_dict(theirs.state_dict())
    close(ours["encoder"].backward_cells[0].weight_hh, theirs["encoder"].weight_hh_l0_reverse)


@pytest.mark.parametrize("make", [lambda: fb.nn.LSTMCell(IN, H), lambda: fb.nn.GRUCell(IN, H),
                                  lambda: fb.nn.LSTM(IN, H, num_layers=2, bidirectional=True)],
                         ids=["LSTMCell", "GRUCell", "LSTM"])
def test_fb_modules_still_load_their_own_state_dicts(make):
    saved = seeded(make()).state_dict()
    loaded = make().double()
    loaded.load_state_dict(saved)
    assert loaded.state_dict().keys() == saved.keys()
    for name, value in saved.items():
        close(loaded.state_dict()[name], value)


def test_loading_a_torch_state_dict_stays_strict_about_missing_keys():
    no_bias = torch.nn.LSTMCell(IN, H, bias=False).state_dict()
    with pytest.raises(RuntimeError, match="bias"):
        fb.nn.LSTMCell(IN, H).load_state_dict(no_bias)


# ---- from_torch ------------------------------------------------------------------------------
TWINS = {"LSTMCell": (lambda: torch.nn.LSTMCell(IN, H), lambda: fb.nn.LSTMCell(IN, H)),
         "GRUCell": (lambda: torch.nn.GRUCell(IN, H), lambda: fb.nn.GRUCell(IN, H)),
         "LSTM": (lambda: torch.nn.LSTM(IN, H, num_layers=2, bidirectional=True),
                  lambda: fb.nn.LSTM(IN, H, num_layers=2, bidirectional=True))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("twin", TWINS)
def test_from_torch_copies_weights_dtype_and_device(twin, dtype, device):
    make_theirs, make_ours = TWINS[twin]
    theirs = seeded(make_theirs()).to(device=device, dtype=dtype)
    loaded = make_ours().to(device=device, dtype=dtype)
    loaded.load_state_dict(theirs.state_dict())
    copy = type(loaded).from_torch(theirs)
    assert type(copy) is type(loaded)
    assert {(p.dtype, p.device.type) for p in copy.parameters()} == {(dtype, device)}
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(copy.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("twin", TWINS)
def test_from_torch_copies_the_weights_rather_than_sharing_them(twin):
    make_theirs, make_ours = TWINS[twin]
    theirs = make_theirs()
    before = {k: v.clone() for k, v in theirs.state_dict().items()}
    with torch.no_grad():
        for p in type(make_ours()).from_torch(theirs).parameters():
            p.add_(1.0)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("ours, other", [(fb.nn.LSTMCell, torch.nn.GRUCell(IN, H)),
                                         (fb.nn.GRUCell, torch.nn.LSTMCell(IN, H)),
                                         (fb.nn.LSTM, torch.nn.GRU(IN, H))],
                         ids=list(TWINS))
def test_from_torch_refuses_another_kind_of_module(ours, other):
    with pytest.raises(TypeError, match=f"takes a torch.nn.{ours.__name__}"):
        ours.from_torch(other)


@pytest.mark.parametrize("ours, theirs, option", [
    (fb.nn.LSTMCell, torch.nn.LSTMCell(IN, H, bias=False), "bias"),
    (fb.nn.GRUCell, torch.nn.GRUCell(IN, H, bias=False), "bias"),
    (fb.nn.LSTM, torch.nn.LSTM(IN, H, bias=False), "bias"),
    (fb.nn.LSTM, torch.nn.LSTM(IN, H, proj_size=2), "proj_size"),
    (fb.nn.LSTM, torch.nn.LSTM(IN, H, num_layers=2, dropout=0.5), "dropout"),
], ids=["LSTMCell-no-bias", "GRUCell-no-bias", "LSTM-no-bias", "LSTM-proj", "LSTM-dropout"])
def test_from_torch_refuses_options_the_fb_module_does_not_compute(ours, theirs, option):
    with pytest.raises(ValueError, match=option):
        ours.from_torch(theirs)


# ---- values and gradients against torch, batched -------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_cell_gives_torch_values_and_its_bias_grad_is_each_torch_bias_grad(strategy):
    theirs = seeded(torch.nn.LSTMCell(IN, H))
    ours = fb.nn.LSTMCell.from_torch(theirs)
    assert_same_as_torch(strategy, ours, theirs, fb_lstm_cell_on, torch_lstm_cell_on,
                         LSTM_CELL_GRADS)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gru_cell_gives_torch_values_and_gradients(strategy):
    theirs = seeded(torch.nn.GRUCell(IN, H))
    ours = fb.nn.GRUCell.from_torch(theirs)
    assert_same_as_torch(strategy, ours, theirs, gru_cell_on, gru_cell_on,
                         [(name, name) for name, _ in theirs.named_parameters()])


@LSTM_SHAPES
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_gives_torch_values_and_gradients(strategy, layers, bidirectional):
    theirs = seeded(torch.nn.LSTM(IN, H, num_layers=layers, bidirectional=bidirectional))
    ours = fb.nn.LSTM.from_torch(theirs)
    assert_same_as_torch(strategy, ours, theirs, lambda m, xs: m(xs), torch_lstm_on,
                         lstm_grads(layers, bidirectional))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_cell_reads_a_tuple_state_in_torch_order_h_then_c(strategy):
    theirs = seeded(torch.nn.LSTMCell(IN, H))
    ours = fb.nn.LSTMCell.from_torch(theirs)
    gen = torch.Generator().manual_seed(3)
    x, h, c = (torch.randn(n, generator=gen, dtype=F64) for n in (IN, H, H))
    want_h, want_c = theirs(x, (h, c))
    with fb.Graph(strategy=strategy, dtype=F64):
        state = ours(fb.input(x), (fb.input(h), fb.input(c)))
        close(state.h.value(), want_h.detach())
        close(state.c.value(), want_c.detach())


# ---- State: read by name -----------------------------------------------------------------------
def lstm_state():
    return fb.nn.LSTMCell(IN, H)(fb.input(torch.randn(IN)))


def tree_state():
    return fb.nn.TreeLSTMCell(IN, H).leaf(fb.input(torch.randn(IN)))


@pytest.mark.parametrize("make", [lstm_state, tree_state], ids=["LSTMCell", "TreeLSTMCell"])
def test_a_state_does_not_unpack(make):
    with fb.Graph():
        state = make()
        with pytest.raises(TypeError, match=r"state\.h and state\.c"):
            h, c = state


@pytest.mark.parametrize("make", [lstm_state, tree_state], ids=["LSTMCell", "TreeLSTMCell"])
def test_a_state_cannot_be_indexed(make):
    with fb.Graph():
        state = make()
        with pytest.raises(TypeError, match=r"state\.h and state\.c"):
            state[0]


def test_a_tree_lstm_state_has_h_the_output_and_c_the_memory_cell():
    cell = seeded(fb.nn.TreeLSTMCell(IN, H))
    x = torch.randn(IN, dtype=F64)
    i, o, u = (cell.W_iou @ x + cell.b_iou).chunk(3)
    c = torch.sigmoid(i) * torch.tanh(u)
    with fb.Graph(dtype=F64):
        state = cell.leaf(fb.input(x))
        close(state.c.value(), c.detach())
        close(state.h.value(), (torch.sigmoid(o) * torch.tanh(c)).detach())


def test_a_tree_lstm_cell_refuses_a_tuple_child():
    cell = fb.nn.TreeLSTMCell(IN, H)
    with fb.Graph():
        leaf = cell.leaf(fb.input(torch.randn(IN)))
        with pytest.raises(TypeError, match=r"State\.of\(h=\.\.\., c=\.\.\.\)"):
            cell([leaf, (leaf.h, leaf.c)])


def test_state_of_names_h_and_c_of_a_child_made_by_hand():
    cell = seeded(fb.nn.TreeLSTMCell(IN, H))
    with fb.Graph(dtype=F64):
        leaf = cell.leaf(fb.input(torch.randn(IN, dtype=F64)))
        by_hand = fb.nn.State.of(h=leaf.h, c=leaf.c)
        close(cell([by_hand, leaf]).h.value(), cell([leaf, leaf]).h.value())
