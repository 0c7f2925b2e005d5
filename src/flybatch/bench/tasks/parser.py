"""`parser`: an arc-hybrid dependency parser (Kiperwasser & Goldberg 2016 style), five ways.

The model (notes/model_spec.md, "parser"): x_i = [E_word[w_i]; E_pos[p_i]] (100 + 25), one
BiLSTM layer of 200 per direction, v_i = [f_i; b_i] (400), ROOT appended at the END of the
sentence. A configuration is scored from the v of stack[-1], stack[-2], stack[-3] and
buffer[0] (a missing stack item reads the learned `pad`):

    scores = M_o . tanh(M_h . [v_s0; v_s1; v_s2; v_b0] + m_h) + m_o        (SHIFT, LEFT, RIGHT)

Training follows the static oracle; at each step the hinge loss relu(1 - s[gold] + s[wrong])
uses the highest-scoring wrong LEGAL transition, so the score VALUES are needed before the next
step can even be built. Evaluation applies the best legal transition.

The 64 parsers of a minibatch run in LOCKSTEP: at every step, every unfinished parser's scores
are computed together, read back, and only then do the parsers move. Per mode:

- eager:   one sentence at a time; nn.LSTM on the sentence, then one small MLP call and one
           `.tolist()` per transition (what a PyTorch user writes without batching).
- flybatch (none/depth/agenda): the per-sentence code again, with fb ops, in ONE graph per
           minibatch: the 64 BiLSTMs are recorded lazily, then each lockstep step creates every
           unfinished parser's score expression and asks for all of them with ONE
           `g.forward(scores)` (an incremental forward: the first one also runs the BiLSTMs).
- manual:  hand batched: one packed nn.LSTM call for the 64 sentences, then per step one
           `index_select` of the feature vectors and one batched MLP over every unfinished parser.

Two more modes (this task's own, issue 4) run the parser as written for ONE sentence
(`parse_sentence`: encode, then `while not config.done(): scores = ...; scores.value()...`),
with no lockstep by hand, on an agenda graph:

- parser-auto: `fb.map_batched(parse_sentence, batch)`: each sentence runs in its own greenlet
           and waits at its value request; when all wait, ONE forward serves them all, so there
           are as many forwards as in the lockstep modes (the longest sentence's 2n, +1 final).
- parser-seq:  the same function called for one sentence after the other: every value request
           forces its own forward (sum over sentences of 2n, +1 final); the baseline that
           parser-auto must beat.

All modes read the same Parameters (`Task.torch_lstm` hands the fb.nn.LSTM's tensors to an
nn.LSTM), so they compute the same minibatch loss up to float32 rounding. The minibatch loss is
the sum of every step loss of every sentence (a sentence's loss is the sum of its step losses;
one sum over all of them is equal, and in flybatch it is one esum node instead of 64 of
different arities, which would be 64 launches). Training uses projective trees only: the static
oracle cannot reproduce the others; `tasks_data.prepare` drops them and counts them in
`data.stats["train_nonprojective_skipped"]`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import flybatch as fb
from flybatch.bench.arc_hybrid import Config, static_oracle
from flybatch.bench.tasks.base import Task
from flybatch.bench.tasks_data import Parse, TaskData

WORD_DIM, POS_DIM, HIDDEN, MLP_HIDDEN, N_TRANSITIONS = 100, 25, 200, 100, 3
VECTOR = 2 * HIDDEN  # v_i = [f_i; b_i]
N_FEATURES = 4  # s0, s1, s2, b0


# ---- the transition logic, shared by every mode (plain Python on score values) --------------
def feature_tokens(config: Config) -> tuple[int | None, ...]:
    """Token indices of stack[-1], stack[-2], stack[-3], buffer[0]; None where the stack is short.

    buffer[0] always exists while the parse is unfinished: ROOT (token n) is never shifted.
    """
    st = config.stack
    k = len(st)
    return (st[-1] if k >= 1 else None, st[-2] if k >= 2 else None,
            st[-3] if k >= 3 else None, config.buf)


def gold_and_wrong(config: Config, gold_heads: Sequence[int],
                   scores: Sequence[float]) -> tuple[int, int | None]:
    """The oracle transition, and the best-scoring legal transition other than it (or None).

    Ties go to the lower transition id (strict `>`), as in the DyNet peer, so that every mode
    picks the same `wrong` from (nearly) equal scores.
    """
    gold = static_oracle(config, gold_heads)
    wrong = None
    for t in config.legal():
        if t != gold and (wrong is None or scores[t] > scores[wrong]):
            wrong = t
    return gold, wrong


def best_legal(config: Config, scores: Sequence[float]) -> int:
    """The legal transition with the highest score (the first one on ties)."""
    return max(config.legal(), key=scores.__getitem__)


def transition(config: Config, gold_heads: Sequence[int], scores, values: Sequence[float],
               train: bool, relu, losses: list) -> None:
    """Take one step: in training the oracle's transition, appending the hinge loss against the
    best wrong legal one (if any) to `losses`; in evaluation the best legal transition.
    `scores` is the step's score vector (a tensor or an expression), `values` its numbers, and
    `relu` the matching op (`torch.relu` or `fb.relu`)."""
    if train:
        gold, wrong = gold_and_wrong(config, gold_heads, values)
        if wrong is not None:
            losses.append(relu(1.0 - scores[gold] + scores[wrong]))
        config.apply(gold)
    else:
        config.apply(best_legal(config, values))


class ParserTask(Task):
    name = "parser"
    TASK_EXTRA_MODES = {"parser-auto": "auto", "parser-seq": "auto"}

    def __init__(self, data: TaskData, device: str | torch.device = "cpu", seed: int = 0):
        super().__init__(data, device, seed)
        self.E_word = self.param("E_word", (data.sizes["words"], WORD_DIM), sparse=True)
        self.E_pos = self.param("E_pos", (data.sizes["pos"], POS_DIM), sparse=True)
        # The BiLSTM's tensors live in the fb.nn module (flybatch's fused LSTM cells) under the
        # spec's names; eager and manual run the very same Parameters through an nn.LSTM.
        self.fb_lstm = fb.nn.LSTM(WORD_DIM + POS_DIM, HIDDEN, bidirectional=True)
        cells = (self.fb_lstm.forward_cells[0], self.fb_lstm.backward_cells[0])
        for direction, cell in zip(("fwd", "bwd"), cells):
            self.adopt(f"lstm1.{direction}.W_ih", cell.weight_ih)
            self.adopt(f"lstm1.{direction}.W_hh", cell.weight_hh)
            self.adopt(f"lstm1.{direction}.b", cell.bias)
        self.lstm = self.torch_lstm([cells])  # sequence-first, bias_hh = 0
        self.pad = self.param("pad", (VECTOR,))
        self.M_h = self.param("M_h", (MLP_HIDDEN, N_FEATURES * VECTOR))
        self.m_h = self.param("m_h", (MLP_HIDDEN,))
        self.M_o = self.param("M_o", (N_TRANSITIONS, MLP_HIDDEN))
        self.m_o = self.param("m_o", (N_TRANSITIONS,))

    def _zero_loss(self) -> torch.Tensor:
        """A zero loss that still reaches a parameter, for a minibatch without any step loss
        (only possible with one-word sentences), so that `backward()` works as usual."""
        return self.m_o.sum() * 0.0

    # ---- eager: one sentence at a time ---------------------------------------------------------
    def _encode_eager(self, inst: Parse) -> torch.Tensor:
        words = torch.tensor(inst.words, device=self.device)
        pos = torch.tensor(inst.pos, device=self.device)
        x = torch.cat([F.embedding(words, self.E_word, sparse=True),
                       F.embedding(pos, self.E_pos, sparse=True)], 1)
        out, _ = self.lstm(x.unsqueeze(1))  # a batch of one: [n + 1, 1, 400]
        return out[:, 0]  # v_i = [f_i; b_i]

    def _scores_eager(self, vectors: torch.Tensor, config: Config) -> torch.Tensor:
        feats = torch.cat([self.pad if t is None else vectors[t] for t in feature_tokens(config)])
        hidden = torch.tanh(torch.addmv(self.m_h, self.M_h, feats))
        return torch.addmv(self.m_o, self.M_o, hidden)

    def forward_eager(self, batch: list[Parse], train: bool):
        losses, predictions = [], []
        for inst in batch:
            vectors = self._encode_eager(inst)
            config = Config(len(inst.heads))
            while not config.done():
                s = self._scores_eager(vectors, config)
                values = s.tolist()  # the decision needs the values: one sync per transition
                transition(config, inst.heads, s, values, train, torch.relu, losses)
            predictions.append(config.heads)
        if not train:
            return predictions
        return torch.stack(losses).sum() if losses else self._zero_loss()

    # ---- flybatch: the same per-sentence code, one value request per lockstep step -----------
    def _encode_flybatch(self, inst: Parse) -> list[fb.Expression]:
        xs = [fb.concat([fb.lookup(self.E_word, w, sparse=True),
                         fb.lookup(self.E_pos, p, sparse=True)])
              for w, p in zip(inst.words, inst.pos)]
        return self.fb_lstm(xs)  # v_i = concat([f_i, b_i]), nothing computed yet

    def _scores_flybatch(self, vectors: list[fb.Expression], config: Config) -> fb.Expression:
        feats = fb.concat([self.pad if t is None else vectors[t] for t in feature_tokens(config)])
        hidden = fb.tanh(fb.affine(self.M_h, feats, self.m_h))
        return fb.affine(self.M_o, hidden, self.m_o)

    def forward_flybatch(self, batch: list[Parse], train: bool):
        graph = fb.current_graph()  # opened by Task.step with the mode's strategy
        parsers = [(inst, Config(len(inst.heads)), self._encode_flybatch(inst)) for inst in batch]
        losses = []
        active = parsers
        while active:
            scores = [self._scores_flybatch(vectors, config) for _, config, vectors in active]
            # ONE value request for every unfinished parser: one batched forward of all the
            # new nodes (this step's MLPs, the previous step's losses; the BiLSTMs the first
            # time). Read back stacked: one `.tolist()` instead of 64. (Not under no_grad: the
            # forward must record autograd for the backward.)
            values = graph.forward(scores, stack=True).detach().tolist()
            for (inst, config, _), s, row in zip(active, scores, values):
                transition(config, inst.heads, s, row, train, fb.relu, losses)
            active = [p for p in active if not p[1].done()]
        if not train:
            return [config.heads for _, config, _ in parsers]
        return self._minibatch_loss_flybatch(losses)

    def _minibatch_loss_flybatch(self, losses: list[fb.Expression]) -> fb.Expression:
        if not losses:  # as `_zero_loss`: zero, but backward() still works
            return fb.mul(fb.sum_elems(self.m_o), 0.0)
        # One sum over every step loss; Task.step's `.item()` runs it in one last forward,
        # together with the last step's hinge losses.
        return fb.esum(losses)

    # ---- parser-auto / parser-seq: the parser written for ONE sentence ------------------------
    def parse_sentence(self, inst: Parse, train: bool) -> list[fb.Expression] | list[int]:
        """Parse one sentence, as plain single-sentence flybatch code.

        Every transition asks for the VALUES of its scores (`scores.value()`) before it can
        choose the next one. Returns the step losses (train; their sum is the sentence loss) or
        the predicted heads. Called directly, each value request forwards the graph on its own;
        under `fb.map_batched` it waits until every other sentence asks too.
        """
        vectors = self._encode_flybatch(inst)
        config = Config(len(inst.heads))
        losses = []
        while not config.done():
            scores = self._scores_flybatch(vectors, config)
            values = scores.value().tolist()  # the decision needs the values: a value request
            transition(config, inst.heads, scores, values, train, fb.relu, losses)
        return losses if train else config.heads

    def forward_mode(self, mode: str, batch: list[Parse], train: bool):
        def parse(inst: Parse):
            return self.parse_sentence(inst, train)

        if mode == "parser-auto":
            results = fb.map_batched(parse, batch)
        elif mode == "parser-seq":
            results = [parse(inst) for inst in batch]
        else:
            raise ValueError(f"unknown parser mode {mode!r}")
        if not train:
            return results
        # The step losses of all sentences in one sum, as in the lockstep modes (one esum node;
        # a sum per sentence first would add one launch per distinct sentence arity).
        return self._minibatch_loss_flybatch([loss for losses in results for loss in losses])

    # ---- manual: hand-batched lockstep --------------------------------------------------------
    def _encode_manual(self, batch: list[Parse]) -> tuple[torch.Tensor, int, int]:
        """All sentences through ONE packed nn.LSTM call.

        Returns the feature table [B * T + 1, 400]: row i * T + t is v_t of sentence i, and the
        last row is `pad`, so that a missing stack item is just one more index to gather.
        Only real tokens are embedded (no padding ids), so the sparse gradients touch exactly
        the rows the other modes touch.
        """
        lengths = [len(inst.words) for inst in batch]
        words = torch.tensor([w for inst in batch for w in inst.words], device=self.device)
        pos = torch.tensor([p for inst in batch for p in inst.pos], device=self.device)
        x = torch.cat([F.embedding(words, self.E_word, sparse=True),
                       F.embedding(pos, self.E_pos, sparse=True)], 1)
        packed = nn.utils.rnn.pack_sequence(x.split(lengths), enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)  # [B, T, 400]
        B, T = padded.shape[:2]
        table = torch.cat([padded.reshape(B * T, VECTOR), self.pad.unsqueeze(0)])
        return table, T, B * T

    def forward_manual(self, batch: list[Parse], train: bool):
        table, T, pad_row = self._encode_manual(batch)
        configs = [Config(len(inst.heads)) for inst in batch]
        step_losses = []
        active = list(range(len(batch)))
        while active:
            rows = [pad_row if t is None else i * T + t
                    for i in active for t in feature_tokens(configs[i])]
            index = torch.tensor(rows, device=self.device)
            feats = table.index_select(0, index).view(len(active), N_FEATURES * VECTOR)
            hidden = torch.tanh(torch.addmm(self.m_h, feats, self.M_h.T))
            s = torch.addmm(self.m_o, hidden, self.M_o.T)  # [len(active), 3]
            values = s.tolist()  # one sync per step, for every parser at once
            if train:
                hinge_rows, golds, wrongs = [], [], []
                for j, i in enumerate(active):
                    gold, wrong = gold_and_wrong(configs[i], batch[i].heads, values[j])
                    if wrong is not None:
                        hinge_rows.append(j)
                        golds.append(gold)
                        wrongs.append(wrong)
                    configs[i].apply(gold)
                if hinge_rows:
                    r = torch.tensor(hinge_rows, device=self.device)
                    g = torch.tensor(golds, device=self.device)
                    w = torch.tensor(wrongs, device=self.device)
                    step_losses.append(torch.relu(1.0 - s[r, g] + s[r, w]).sum())
            else:
                for j, i in enumerate(active):
                    configs[i].apply(best_legal(configs[i], values[j]))
            active = [i for i in active if not configs[i].done()]
        if not train:
            return [config.heads for config in configs]
        return torch.stack(step_losses).sum() if step_losses else self._zero_loss()
