"""BiLSTM taggers: bilstm-synthetic, bilstm (WikiNER) and bilstm-char (rare words from chars).

Model (BENCHMARKS.md, "Models"): word vectors from ``E`` (or, in bilstm-char, for a word of id
0, [final forward; final backward] state of a char BiLSTM over ``C`` vectors); a BiLSTM (two
layers in bilstm-synthetic); per token ``logits = O tanh(H [f_t; b_t])``; loss = sum over
tokens of ``pick_neg_log_softmax(logits, tag)``, summed over the minibatch.

The three implementations read the same tensors: the ``fb.nn.LSTMCell``s registered under the
spec's names, and a ``torch.nn.LSTM`` built on those very Parameters (``Task.torch_lstm``).

* eager: per sentence, ``nn.LSTM`` over the sentence (batch of one), the head as two matmuls,
  ``cross_entropy``; the char BiLSTM per rare word (what a PyTorch user writes today);
* flybatch: the per-instance code with ``fb.lookup``, ``fb.nn.LSTM`` and ``fb.nn.Linear``;
* manual: the minibatch padded and packed (``pack_padded_sequence``) through the same
  ``nn.LSTM``, the head over all real tokens at once; the rare words of the whole minibatch
  through one packed char BiLSTM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

import flybatch as fb
from flybatch.bench.tasks.base import Task
from flybatch.bench.tasks_data import TaskData

HIDDEN = 256
CHAR_DIM, CHAR_HIDDEN = 64, 128


class TaggerTask(Task):
    """The shared tagger; subclasses fix the name (and so the sizes)."""

    layers = 1
    word_dim = 256
    chars = False

    def __init__(self, data: TaskData, device="cpu", seed: int = 0):
        super().__init__(data, device, seed)
        n_words, n_tags = data.sizes["words"], data.sizes["tags"]
        self.E = self.param("E", (n_words, self.word_dim), sparse=True)
        # One fb.nn.LSTM; its cells' tensors carry the spec's names.
        self.fb_lstm = fb.nn.LSTM(self.word_dim, HIDDEN, num_layers=self.layers,
                                  bidirectional=True)
        for k in range(self.layers):
            for direction, cells in (("fwd", self.fb_lstm.forward_cells),
                                     ("bwd", self.fb_lstm.backward_cells)):
                cell = cells[k]
                for key, p in (("W_ih", cell.weight_ih), ("W_hh", cell.weight_hh),
                               ("b", cell.bias)):
                    self.adopt(f"lstm{k + 1}.{direction}.{key}", p)
        self.fb_H = fb.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.fb_O = fb.nn.Linear(HIDDEN, n_tags, bias=False)
        self.H = self.adopt("H", self.fb_H.weight)
        self.O = self.adopt("O", self.fb_O.weight)
        self.lstm = self.torch_lstm(list(zip(self.fb_lstm.forward_cells,
                                             self.fb_lstm.backward_cells)))
        if self.chars:
            self.C = self.param("C", (data.sizes["chars"], CHAR_DIM), sparse=True)
            self.char_fwd = self.lstm_cell("char.fwd", CHAR_DIM, CHAR_HIDDEN)
            self.char_bwd = self.lstm_cell("char.bwd", CHAR_DIM, CHAR_HIDDEN)
            self.char_lstm = self.torch_lstm([(self.char_fwd, self.char_bwd)])

    def _ids(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # ---- eager: one sentence at a time ------------------------------------------------------
    def _char_word_eager(self, chars) -> torch.Tensor:
        x = F.embedding(self._ids(chars), self.C, sparse=True).unsqueeze(1)  # [n, 1, 64]
        _, (h_n, _) = self.char_lstm(x)
        return h_n.reshape(-1)  # [final forward; final backward]

    def _logits_eager(self, inst) -> torch.Tensor:
        x = F.embedding(self._ids(inst.words), self.E, sparse=True)
        if self.chars:
            rows = [self._char_word_eager(cs) if w == 0 else x[i]
                    for i, (w, cs) in enumerate(zip(inst.words, inst.chars))]
            x = torch.stack(rows)
        out, _ = self.lstm(x.unsqueeze(1))  # [n, 1, 512]
        return F.linear(torch.tanh(F.linear(out.squeeze(1), self.H)), self.O)

    def forward_eager(self, batch, train):
        if not train:
            return [self._logits_eager(inst).argmax(1).tolist() for inst in batch]
        losses = [F.cross_entropy(self._logits_eager(inst), self._ids(inst.tags),
                                  reduction="sum") for inst in batch]
        return torch.stack(losses).sum()

    # ---- flybatch: the same per-instance code ---------------------------------------------
    def _char_word_fb(self, chars) -> fb.Expression:
        xs = [fb.lookup(self.C, c, sparse=True) for c in chars]
        f = fb.nn.LSTM.run(self.char_fwd, xs)[-1]
        b = fb.nn.LSTM.run(self.char_bwd, xs[::-1])[-1]
        return fb.concat([f, b])

    def _logits_fb(self, inst) -> list[fb.Expression]:
        if self.chars:
            xs = [self._char_word_fb(cs) if w == 0 else fb.lookup(self.E, w, sparse=True)
                  for w, cs in zip(inst.words, inst.chars)]
        else:
            xs = [fb.lookup(self.E, w, sparse=True) for w in inst.words]
        return [self.fb_O(fb.tanh(self.fb_H(h))) for h in self.fb_lstm(xs)]

    def forward_flybatch(self, batch, train):
        if not train:
            logits = [self._logits_fb(inst) for inst in batch]
            flat = fb.current_graph().forward([r for rs in logits for r in rs], stack=True)
            tags = flat.argmax(1).tolist()
            out, k = [], 0
            for rs in logits:
                out.append(tags[k:k + len(rs)])
                k += len(rs)
            return out
        return fb.esum([fb.esum([fb.pick_neg_log_softmax(r, t)
                                 for r, t in zip(self._logits_fb(inst), inst.tags)])
                        for inst in batch])

    # ---- manual: padded + packed, whole minibatch ------------------------------------------
    def _embed_manual(self, batch) -> torch.Tensor:
        """[total tokens, word_dim]: the minibatch's token vectors in sentence order."""
        words = self._ids([w for inst in batch for w in inst.words])
        x = F.embedding(words, self.E, sparse=True)
        if not self.chars:
            return x
        rare = [cs for inst in batch for w, cs in zip(inst.words, inst.chars) if w == 0]
        if not rare:
            return x
        clens = torch.tensor([len(cs) for cs in rare])
        cids = pad_sequence([torch.tensor(cs, dtype=torch.long) for cs in rare])  # [T, n]
        cx = F.embedding(cids.to(self.device), self.C, sparse=True)
        _, (h_n, _) = self.char_lstm(pack_padded_sequence(cx, clens, enforce_sorted=False))
        char_vecs = torch.cat([h_n[0], h_n[1]], 1)  # [n rare, 256]
        rows = (words == 0).nonzero().squeeze(1)  # the rare tokens, in the order of `rare`
        return x.index_put((rows,), char_vecs)

    def _logits_manual(self, batch):
        lengths = [len(inst.words) for inst in batch]
        x = self._embed_manual(batch)
        padded = pad_sequence(x.split(lengths))  # [T, B, d]
        packed = pack_padded_sequence(padded, torch.tensor(lengths), enforce_sorted=False)
        out, _ = pad_packed_sequence(self.lstm(packed)[0])  # [T, B, 512]
        mask = pad_sequence([torch.ones(n, dtype=torch.bool) for n in lengths]).to(self.device)
        tokens = out.transpose(0, 1)[mask.transpose(0, 1)]  # [total, 512] in sentence order
        return F.linear(torch.tanh(F.linear(tokens, self.H)), self.O), lengths

    def forward_manual(self, batch, train):
        logits, lengths = self._logits_manual(batch)
        if not train:
            tags = logits.argmax(1).tolist()
            out, k = [], 0
            for n in lengths:
                out.append(tags[k:k + n])
                k += n
            return out
        gold = self._ids([t for inst in batch for t in inst.tags])
        return F.cross_entropy(logits, gold, reduction="sum")


class BiLSTMSynthetic(TaggerTask):
    name = "bilstm-synthetic"
    layers = 2
    word_dim = 200


class BiLSTM(TaggerTask):
    name = "bilstm"


class BiLSTMChar(TaggerTask):
    name = "bilstm-char"
    chars = True
