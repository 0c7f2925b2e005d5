"""DyNet peer for the benchmarks: the five models of ``notes/model_spec.md`` in DyNet.

Run inside a peer virtual environment (``make peers`` builds ``.venv-peers`` with DyNet 2.1.2
from source and ``.venv-peers-22`` with the DyNet 2.2 wheel of PyPI's ``dynet38``)::

    .venv-peers-22/bin/python -m flybatch.bench.dynet_peer TASK --strategy {noauto,depth,agenda}
        [--data-dir D] [--batch-size 64] [--seconds S] [--threads N] [--init params.npz]
        [--warmup K] [--seed 0] [--eval-seconds E] [--mem MB] [--dump-init out.npz]

and it prints ONE JSON line on stdout::

    {"mode": "dynet-<strategy>", "dynet": "2.2", "task": ..., "train_per_s": ...,
     "eval_per_s": ..., "first_loss": ..., "peak_rss_mb": ...,
     "seconds": {"build": ..., "forward": ..., "backward": ..., "update": ...}, ...}

``train_per_s`` = batch size / median seconds of a training minibatch (build the graph,
forward, backward, Adam update), over the minibatches timed after ``--warmup`` untimed ones
for ``--seconds``; ``seconds`` holds the medians of each phase per minibatch.
``eval_per_s`` = batch size / median seconds to build and run one dev minibatch of
predictions.  ``first_loss`` is the summed loss of the first training minibatch, before
any update.

Autobatching strategies (DyNet's ``--dynet-autobatch``): ``noauto`` = 0, ``agenda`` = 1,
``depth`` = 2.  DyNet's CPU backend is single-threaded (Eigen without threads);
``--threads`` only sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``/``OPENBLAS_NUM_THREADS``
before numpy and dynet are imported, which caps any threaded library they may use.

The code runs unchanged on both builds: the 2.2 wheel's bindings are compiled with Cython 3,
where an Expression has no reflected operators (``1.0 - e`` raises TypeError), so scalars only
ever stand right of an operator here.

Models are written per instance in DyNet's idiomatic Python API, as
neulab/dynet-benchmark's ``dynet-py`` scripts do: one ``dy.renew_cg()`` per minibatch,
loss = ``dy.esum`` of per-instance losses, ``dy.AdamTrainer`` (lr 0.001, gradient
clipping off, sparse updates of lookup parameters).  LSTMs are ``dy.VanillaLSTMBuilder``
with ``forget_bias=0.0`` (its default 1.0 would add 1 to the forget gate, off spec);
then its cell is exactly the spec's.  ``--init`` loads every parameter from the spec's
``.npz`` (PyTorch layout and gate order i,f,g,o; converted to the builder's i,f,o,g);
``--dump-init`` writes the initial values back in that layout.  Keys (float32):

* bilstm-synthetic: ``E`` (1000x200), ``lstm{1,2}.{fwd,bwd}.{W_ih,W_hh,b}``, ``H``, ``O``
* bilstm: ``E`` (Vx256), ``lstm1.{fwd,bwd}.{W_ih,W_hh,b}``, ``H`` (256x512), ``O`` (Tx256)
* bilstm-char: as bilstm plus ``C`` (nchars x 64), ``char.{fwd,bwd}.{W_ih,W_hh,b}``
* treelstm: ``E``, ``W_i W_o W_u U_f1 U_f2`` (256x256), ``U_i U_o U_u`` (256x512),
  ``b_i b_o b_u b_f`` (256), ``W_out`` (5x256), ``b_out`` (5)
* parser: ``E_word`` (Vw x100), ``E_pos`` (Vp x25), ``lstm1.{fwd,bwd}.{W_ih,W_hh,b}``,
  ``pad`` (400), ``M_h`` (100x1600), ``m_h`` (100), ``M_o`` (3x100), ``m_o`` (3)

LSTM ``W_ih`` is 4H x X, ``W_hh`` 4H x H, ``b`` 4H.  Vocabulary sizes and instance ids come
from :func:`flybatch.bench.tasks_data.prepare`, shared with the PyTorch modes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from flybatch.bench.tasks_data import TASKS, eval_batches, minibatches, prepare

STRATEGIES = {"noauto": 0, "agenda": 1, "depth": 2}
LSTM_KEYS = ("W_ih", "W_hh", "b")

dy = None  # the dynet module, imported in main() after the environment is set
np = None


# ---------------------------------------------------------------------------
# Parameters: spec names <-> DyNet objects
# ---------------------------------------------------------------------------


def _torch_to_dynet_gates(a, hid):
    """Rows in PyTorch gate order (i, f, g, o) -> VanillaLSTMBuilder order (i, f, o, g)."""
    return np.concatenate([a[0:hid], a[hid:2 * hid], a[3 * hid:4 * hid], a[2 * hid:3 * hid]])


def _dynet_to_torch_gates(a, hid):
    """Rows in VanillaLSTMBuilder order (i, f, o, g) -> PyTorch order (i, f, g, o)."""
    return np.concatenate([a[0:hid], a[hid:2 * hid], a[3 * hid:4 * hid], a[2 * hid:3 * hid]])


class Params:
    """Registry of a model's parameters under the spec's names."""

    def __init__(self, pc):
        self.pc = pc
        self.dense = {}  # name -> dy.Parameters
        self.lookup = {}  # name -> dy.LookupParameters
        self.lstms = {}  # prefix -> (builder, hidden)

    def add(self, name, shape):
        p = self.pc.add_parameters(shape)
        self.dense[name] = p
        return p

    def add_lookup(self, name, shape):
        p = self.pc.add_lookup_parameters(shape)
        self.lookup[name] = p
        return p

    def add_lstm(self, prefix, input_dim, hidden):
        b = dy.VanillaLSTMBuilder(1, input_dim, hidden, self.pc, forget_bias=0.0)
        self.lstms[prefix] = (b, hidden)
        return b

    def names(self):
        out = list(self.dense) + list(self.lookup)
        for prefix in self.lstms:
            out += [f"{prefix}.{k}" for k in LSTM_KEYS]
        return out

    def load(self, path):
        """Set every parameter from a spec ``.npz`` (every name must be present)."""
        data = np.load(path)
        missing = [n for n in self.names() if n not in data.files]
        if missing:
            raise KeyError(f"{path}: missing parameters {missing}")
        extra = sorted(set(data.files) - set(self.names()))
        if extra:
            print(f"dynet_peer: warning: unused entries in {path}: {extra}", file=sys.stderr)

        def get(name, shape):
            a = np.asarray(data[name], dtype=np.float32)
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{path}: {name} has shape {a.shape}, the model needs {shape}")
            return a

        for name, p in self.dense.items():
            p.set_value(get(name, p.shape()))
        for name, p in self.lookup.items():
            p.init_from_array(get(name, p.shape()))
        for prefix, (b, hid) in self.lstms.items():
            (p_x, p_h, p_b), = b.get_parameters()
            p_x.set_value(_torch_to_dynet_gates(get(f"{prefix}.W_ih", p_x.shape()), hid))
            p_h.set_value(_torch_to_dynet_gates(get(f"{prefix}.W_hh", p_h.shape()), hid))
            p_b.set_value(_torch_to_dynet_gates(get(f"{prefix}.b", p_b.shape()), hid))

    def dump(self, path):
        """Write the current values in the spec's names and layout (float32)."""
        out = {}
        for name, p in self.dense.items():
            out[name] = p.as_array()
        for name, p in self.lookup.items():
            out[name] = p.as_array()
        for prefix, (b, hid) in self.lstms.items():
            (p_x, p_h, p_b), = b.get_parameters()
            for key, p in zip(LSTM_KEYS, (p_x, p_h, p_b)):
                out[f"{prefix}.{key}"] = _dynet_to_torch_gates(p.as_array(), hid)
        np.savez(path, **{k: np.asarray(v, dtype=np.float32) for k, v in out.items()})


# ---------------------------------------------------------------------------
# Models (per instance, DyNet idiom)
# ---------------------------------------------------------------------------


class Tagger:
    """bilstm-synthetic, bilstm, bilstm-char."""

    def __init__(self, params, task, sizes):
        synthetic = task == "bilstm-synthetic"
        wdim = 200 if synthetic else 256
        self.char = task == "bilstm-char"
        self.E = params.add_lookup("E", (sizes["words"], wdim))
        self.layers = []
        indim = wdim
        for layer in range(1, 3 if synthetic else 2):
            self.layers.append((params.add_lstm(f"lstm{layer}.fwd", indim, 256),
                                params.add_lstm(f"lstm{layer}.bwd", indim, 256)))
            indim = 512
        self.pH = params.add("H", (256, 512))
        self.pO = params.add("O", (sizes["tags"], 256))
        if self.char:
            self.C = params.add_lookup("C", (sizes["chars"], 64))
            self.cfwd = params.add_lstm("char.fwd", 64, 128)
            self.cbwd = params.add_lstm("char.bwd", 64, 128)

    def begin(self):
        """Call after each dy.renew_cg().  (In DyNet 2.1 a Parameters object is an
        Expression, added to the current graph once on first use: no dy.parameter.)"""
        self.H = self.pH
        self.O = self.pO
        self.inits = [(f.initial_state(), b.initial_state()) for f, b in self.layers]
        if self.char:
            self.cf0 = self.cfwd.initial_state()
            self.cb0 = self.cbwd.initial_state()

    def word_rep(self, w, chars):
        if w != 0 or not self.char:
            return self.E[w]
        cembs = [self.C[c] for c in chars]
        f = self.cf0.transduce(cembs)[-1]
        b = self.cb0.transduce(cembs[::-1])[-1]
        return dy.concatenate([f, b])

    def logits(self, inst):
        if self.char:
            xs = [self.word_rep(w, cs) for w, cs in zip(inst.words, inst.chars)]
        else:
            xs = [self.E[w] for w in inst.words]
        for f0, b0 in self.inits:
            fs = f0.transduce(xs)
            bs = b0.transduce(xs[::-1])[::-1]
            xs = [dy.concatenate([f, b]) for f, b in zip(fs, bs)]
        H, O = self.H, self.O
        return [O * dy.tanh(H * x) for x in xs]

    def loss(self, inst):
        return dy.esum([dy.pickneglogsoftmax(r, t) for r, t in zip(self.logits(inst), inst.tags)])

    def predict(self, batch):
        exprs = [r for inst in batch for r in self.logits(inst)]
        return np.argmax(dy.concatenate_cols(exprs).npvalue().reshape(-1, len(exprs)), axis=0)


class TreeLSTM:
    """treelstm (SST, binary Tree-LSTM, loss at every node)."""

    def __init__(self, params, task, sizes):
        hd = 256
        self.E = params.add_lookup("E", (sizes["words"], hd))
        self.pW = [params.add(f"W_{g}", (hd, hd)) for g in "iou"]
        self.pU = [params.add(f"U_{g}", (hd, 2 * hd)) for g in "iou"]
        self.pUf = [params.add(f"U_f{k}", (hd, hd)) for k in (1, 2)]
        self.pb = [params.add(f"b_{g}", (hd,)) for g in "iouf"]
        self.pWout = params.add("W_out", (sizes["labels"], hd))
        self.pbout = params.add("b_out", (sizes["labels"],))

    def begin(self):
        self.W, self.U, self.Uf, self.b = self.pW, self.pU, self.pUf, self.pb
        self.Wout = self.pWout
        self.bout = self.pbout

    def expr_for_tree(self, tree, hs=None):
        """(h, c) of ``tree``; appends (h, label) of every node to ``hs`` if given."""
        bi, bo, bu, bf = self.b
        if tree.word is not None:
            x = self.E[tree.word]
            Wi, Wo, Wu = self.W
            i = dy.logistic(dy.affine_transform([bi, Wi, x]))
            o = dy.logistic(dy.affine_transform([bo, Wo, x]))
            u = dy.tanh(dy.affine_transform([bu, Wu, x]))
            c = dy.cmult(i, u)
        else:
            left, right = tree.children
            h1, c1 = self.expr_for_tree(left, hs)
            h2, c2 = self.expr_for_tree(right, hs)
            Ui, Uo, Uu = self.U
            Uf1, Uf2 = self.Uf
            e = dy.concatenate([h1, h2])
            i = dy.logistic(dy.affine_transform([bi, Ui, e]))
            o = dy.logistic(dy.affine_transform([bo, Uo, e]))
            u = dy.tanh(dy.affine_transform([bu, Uu, e]))
            f1 = dy.logistic(dy.affine_transform([bf, Uf1, h1]))
            f2 = dy.logistic(dy.affine_transform([bf, Uf2, h2]))
            c = dy.cmult(i, u) + dy.cmult(f1, c1) + dy.cmult(f2, c2)
        h = dy.cmult(o, dy.tanh(c))
        if hs is not None:
            hs.append((h, tree.label))
        return h, c

    def loss(self, tree):
        hs = []
        self.expr_for_tree(tree, hs)
        Wout, bout = self.Wout, self.bout
        return dy.esum([dy.pickneglogsoftmax(dy.affine_transform([bout, Wout, h]), label)
                        for h, label in hs])

    def predict(self, batch):
        exprs = [dy.affine_transform([self.bout, self.Wout, self.expr_for_tree(t)[0]])
                 for t in batch]
        return np.argmax(dy.concatenate_cols(exprs).npvalue().reshape(-1, len(exprs)), axis=0)


class Parser:
    """parser (arc-hybrid, Kiperwasser & Goldberg style), 64 parsers in lockstep."""

    def __init__(self, params, task, sizes):
        from flybatch.bench import arc_hybrid

        self.ah = arc_hybrid
        self.Ew = params.add_lookup("E_word", (sizes["words"], 100))
        self.Ep = params.add_lookup("E_pos", (sizes["pos"], 25))
        self.fwd = params.add_lstm("lstm1.fwd", 125, 200)
        self.bwd = params.add_lstm("lstm1.bwd", 125, 200)
        self.ppad = params.add("pad", (400,))
        self.pMh = params.add("M_h", (100, 1600))
        self.pmh = params.add("m_h", (100,))
        self.pMo = params.add("M_o", (3, 100))
        self.pmo = params.add("m_o", (3,))
        self.phase = {"build": 0.0, "forward": 0.0}

    def begin(self):
        self.pad = self.ppad
        self.Mh, self.mh = self.pMh, self.pmh
        self.Mo, self.mo = self.pMo, self.pmo
        self.f0 = self.fwd.initial_state()
        self.b0 = self.bwd.initial_state()

    def encode(self, inst):
        xs = [dy.concatenate([self.Ew[w], self.Ep[p]]) for w, p in zip(inst.words, inst.pos)]
        fs = self.f0.transduce(xs)
        bs = self.b0.transduce(xs[::-1])[::-1]
        return [dy.concatenate([f, b]) for f, b in zip(fs, bs)]

    def scores(self, vs, cfg):
        st, pad = cfg.stack, self.pad
        k = len(st)
        feats = [vs[st[-1]] if k >= 1 else pad,
                 vs[st[-2]] if k >= 2 else pad,
                 vs[st[-3]] if k >= 3 else pad,
                 vs[cfg.buf]]  # buffer[0] always exists before the end (ROOT is last)
        hid = dy.tanh(dy.affine_transform([self.mh, self.Mh, dy.concatenate(feats)]))
        return dy.affine_transform([self.mo, self.Mo, hid])

    def run(self, batch, train):
        """Parse ``batch`` in lockstep: per step, one forward over every unfinished parser.

        Returns the per-sentence losses (train) or the predicted heads (eval); adds the
        graph-building and forward time to ``self.phase``.
        """
        ah = self.ah
        t0 = time.perf_counter()
        states = []
        for inst in batch:
            states.append([ah.Config(len(inst.heads)), self.encode(inst), inst.heads, []])
        active = states
        build = fwd = 0.0
        while active:
            exprs = [self.scores(vs, cfg) for cfg, vs, _, _ in active]
            t1 = time.perf_counter()
            vals = dy.concatenate_cols(exprs).npvalue().reshape(3, len(exprs))
            t2 = time.perf_counter()
            build += t1 - t0
            fwd += t2 - t1
            t0 = t2
            nxt = []
            for j, st in enumerate(active):
                cfg, _, gold_heads, losses = st
                s = vals[:, j]
                legal = cfg.legal()
                if train:
                    gold = ah.static_oracle(cfg, gold_heads)
                    wrong = None
                    for t in legal:
                        if t != gold and (wrong is None or s[t] > s[wrong]):
                            wrong = t
                    if wrong is not None:
                        e = exprs[j]
                        # The spec's relu(1 - s[gold] + s[wrong]), the scalar on the right:
                        # the 2.2 wheel has no Expression.__rsub__ (see the module docstring).
                        losses.append(dy.rectify(dy.pick(e, wrong) - dy.pick(e, gold) + 1.0))
                    cfg.apply(gold)
                else:
                    best = legal[0]
                    for t in legal[1:]:
                        if s[t] > s[best]:
                            best = t
                    cfg.apply(best)
                if not cfg.done():
                    nxt.append(st)
            active = nxt
        out = ([dy.esum(st[3]) for st in states if st[3]] if train
               else [st[0].heads for st in states])
        build += time.perf_counter() - t0
        self.phase["build"] += build
        self.phase["forward"] += fwd
        return out

    def loss_batch(self, batch):
        return self.run(batch, train=True)

    def predict(self, batch):
        return self.run(batch, train=False)


MODELS = {"bilstm-synthetic": Tagger, "bilstm": Tagger, "bilstm-char": Tagger,
          "treelstm": TreeLSTM, "parser": Parser}


# ---------------------------------------------------------------------------
# Benchmark driver
# ---------------------------------------------------------------------------


def train_minibatch(model, trainer, batch):
    """One renew_cg + esum loss + forward + backward + update; returns (loss, phases)."""
    t0 = time.perf_counter()
    dy.renew_cg()
    model.begin()
    if isinstance(model, Parser):
        model.phase = {"build": 0.0, "forward": 0.0}
        losses = model.loss_batch(batch)
    else:
        losses = [model.loss(inst) for inst in batch]
    loss = dy.esum(losses)
    t1 = time.perf_counter()
    value = loss.value()
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    trainer.update()
    t4 = time.perf_counter()
    if isinstance(model, Parser):
        pre = t1 - t0  # includes the lockstep forwards
        build = pre - model.phase["forward"]
        forward = model.phase["forward"] + (t2 - t1)
    else:
        build, forward = t1 - t0, t2 - t1
    return value, {"build": build, "forward": forward, "backward": t3 - t2, "update": t4 - t3}


def eval_minibatch(model, batch):
    t0 = time.perf_counter()
    dy.renew_cg()
    model.begin()
    model.predict(batch)
    return time.perf_counter() - t0


def dynet_version() -> str:
    """The installed DyNet's release: "2.1.2" (the ``dyNET`` sdist) or "2.2" (``dynet38``).

    From the package metadata, since the 2.2 wheel's ``dynet.__version__`` still says 2.1."""
    from importlib import metadata

    for dist in ("dyNET38", "dyNET"):
        try:
            return metadata.version(dist).lstrip("v")
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _rss_mb():
    """Current resident set size in MB (Linux /proc), or None."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flybatch.bench.dynet_peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=TASKS)
    ap.add_argument("--strategy", choices=sorted(STRATEGIES), required=True)
    ap.add_argument("--data-dir", default=None,
                    help="benchmark data root (sst/, wikiner/, ud-english/); default synthetic")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0,
                    help="training time to measure, after warm-up (default 10)")
    ap.add_argument("--eval-seconds", type=float, default=None,
                    help="evaluation time to measure (default: seconds / 4, at least 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init", default=None, help="spec .npz with every parameter")
    ap.add_argument("--warmup", type=int, default=2, help="untimed minibatches (default 2)")
    ap.add_argument("--min-timed", type=int, default=3,
                    help="time at least this many minibatches (default 3)")
    ap.add_argument("--max-minibatches", type=int, default=None,
                    help="stop timing after this many minibatches")
    ap.add_argument("--seed", type=int, default=0, help="data shuffling / synthetic data seed")
    ap.add_argument("--n-synthetic", type=int, default=2000)
    ap.add_argument("--dynet-seed", type=int, default=1,
                    help="DyNet's random seed (initialisation without --init); 0 = random")
    ap.add_argument("--mem", default="1024", help="DyNet memory pool in MB (default 1024)")
    ap.add_argument("--dump-init", default=None,
                    help="write the initial parameters as a spec .npz before training")
    return ap.parse_args(argv)


def main(argv=None):
    global np
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy

    np = numpy
    import dynet_config

    dynet_config.set(mem=str(args.mem), random_seed=args.dynet_seed,
                     autobatch=STRATEGIES[args.strategy])
    # stdout carries exactly one JSON line: anything else printed while we run (DyNet's
    # messages, deprecation notes) goes to stderr.
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        result = _run(args)
    finally:
        sys.stdout.flush()
        os.dup2(json_fd, 1)
        os.close(json_fd)
    print(json.dumps(result), flush=True)
    return result


def _run(args):
    global dy
    import dynet

    dy = dynet

    # RSS after the imports (flybatch/__init__ imports torch) and DyNet's start-up, which
    # allocates and touches its whole --mem pool: most of peak_rss_mb is this baseline.
    baseline_rss = _rss_mb()
    data = prepare(args.task, args.data_dir, seed=args.seed, n_synthetic=args.n_synthetic)
    pc = dy.ParameterCollection()
    params = Params(pc)
    model = MODELS[args.task](params, args.task, data.sizes)
    if args.init:
        params.load(args.init)
    if args.dump_init:
        params.dump(args.dump_init)
    trainer = dy.AdamTrainer(pc, 0.001)
    trainer.set_clip_threshold(-1.0)  # no gradient clipping (DyNet clips at 5 by default)
    trainer.set_sparse_updates(True)

    bs = args.batch_size
    batches = minibatches(data.train, bs, args.seed)
    first_loss = None
    timed = []
    n = 0
    start = None
    while True:
        batch = next(batches)
        value, phases = train_minibatch(model, trainer, batch)
        if first_loss is None:
            first_loss = value
        n += 1
        if n <= args.warmup:
            continue
        if start is None:
            start = time.perf_counter() - sum(phases.values())
        timed.append((phases, len(batch)))
        if args.max_minibatches is not None and len(timed) >= args.max_minibatches:
            break
        if len(timed) >= args.min_timed and time.perf_counter() - start >= args.seconds:
            break

    eval_seconds = args.eval_seconds if args.eval_seconds is not None else max(1.0, args.seconds / 4)
    dev_batches = [b for b in eval_batches(data.dev, bs) if len(b) == bs] or [data.dev]
    eval_times = []
    eval_start = time.perf_counter()
    k = 0
    while True:
        batch = dev_batches[k % len(dev_batches)]
        t = eval_minibatch(model, batch)
        k += 1
        if k == 1:
            continue  # one warm-up batch
        eval_times.append((t, len(batch)))
        if len(eval_times) >= args.min_timed and time.perf_counter() - eval_start >= eval_seconds:
            break
        if args.max_minibatches is not None and len(eval_times) >= args.max_minibatches:
            break

    med = {key: statistics.median(p[key] for p, _ in timed) for key in timed[0][0]}
    train_med = statistics.median(sum(p.values()) for p, _ in timed)
    eval_med = statistics.median(t for t, _ in eval_times)
    eval_size = eval_times[0][1]
    result = {
        "mode": f"dynet-{args.strategy}",
        "dynet": dynet_version(),
        "task": args.task,
        "train_per_s": timed[0][1] / train_med,
        "eval_per_s": eval_size / eval_med,
        "first_loss": first_loss,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "seconds": med,
        "batch_size": bs,
        "threads": args.threads,
        "timed_minibatches": len(timed),
        "timed_eval_minibatches": len(eval_times),
        "data": "synthetic" if args.data_dir is None or args.task == "bilstm-synthetic" else "real",
        "init": "npz" if args.init else "dynet",
        "baseline_rss_mb": baseline_rss,
    }
    return result


if __name__ == "__main__":
    main()
