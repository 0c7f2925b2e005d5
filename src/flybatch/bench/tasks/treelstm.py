"""treelstm: binary Tree-LSTM sentiment on SST, a loss at every node (BENCHMARKS.md, "Models").

The tensors are those of one ``fb.nn.TreeLSTMCell`` (N-ary, arity 2), whose fused layout
holds the spec's parameters: ``W_iou = [W_i; W_o; W_u]``, ``b_iou = [b_i; b_o; b_u]``,
``U_iou = [U_i; U_o; U_u]``, ``U_f = [U_f1, U_f2]`` (stacked), ``b_f``; plus ``E`` and the
output layer ``W_out``, ``b_out``. :meth:`TreeLSTM.export_spec` splits them into the spec's
names for DyNet.

* eager: per tree, per node (post-order), the cell's equations in torch, one
  ``cross_entropy`` per node (what a PyTorch user writes today);
* flybatch: the same per-node code with ``fb.lookup``, ``TreeLSTMCell.leaf`` / ``cell`` and an
  ``fb.nn.Linear`` output layer;
* manual: level by level (a node's level = its height), every node of a level of every tree
  in one batched cell; one ``cross_entropy`` over all nodes;
* torch-native: the eager code, unchanged, inside ``fb.Graph(strategy="auto")`` (the capture
  layer records its torch calls as nodes); evaluation runs the trees under ``fb.map_batched``,
  since the eager code asks for each tree's prediction with ``int(...argmax())``;
* fb-unfused: the eager code transcribed op for op into ``fb`` ops (``fb.affine``,
  ``fb.logistic``, ``fb.slice_rows``...; no fused cell): what torch-native records, written
  by hand, so that the two differ only in the cost of capturing torch calls.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import flybatch as fb
from flybatch.bench.tasks.base import Task
from flybatch.bench.tasks_data import TaskData, tree_nodes

HIDDEN = 256
GATES = ("i", "o", "u")


class TreeLSTM(Task):
    name = "treelstm"
    TASK_EXTRA_MODES = {"torch-native": "auto", "fb-unfused": "auto"}

    def __init__(self, data: TaskData, device="cpu", seed: int = 0):
        super().__init__(data, device, seed)
        H = HIDDEN
        self.E = self.param("E", (data.sizes["words"], H), sparse=True)
        self.cell = fb.nn.TreeLSTMCell(H, H, arity=2)
        c = self.cell
        self.W_iou = self.adopt("W_iou", c.W_iou)
        self.b_iou = self.adopt("b_iou", c.b_iou)
        self.U_iou = self.adopt("U_iou", c.U_iou)
        self.U_f = self.adopt("U_f", c.U_f)
        self.b_f = self.adopt("b_f", c.b_f)
        self.out = fb.nn.Linear(H, data.sizes["labels"])
        self.W_out = self.adopt("W_out", self.out.weight)
        self.b_out = self.adopt("b_out", self.out.bias)

    # ---- spec names <-> fused layout -------------------------------------------------------
    def export_spec(self):
        a = {n: p.detach().cpu().numpy().astype(np.float32) for n, p in self.params.items()}
        out = {"E": a["E"], "W_out": a["W_out"], "b_out": a["b_out"], "b_f": a["b_f"],
               "U_f1": a["U_f"][0], "U_f2": a["U_f"][1]}
        for k, g in enumerate(GATES):
            rows = slice(k * HIDDEN, (k + 1) * HIDDEN)
            out[f"W_{g}"] = a["W_iou"][rows]
            out[f"U_{g}"] = a["U_iou"][rows]
            out[f"b_{g}"] = a["b_iou"][rows]
        return out

    def load_spec(self, arrays):
        fused = {
            "E": arrays["E"], "W_out": arrays["W_out"], "b_out": arrays["b_out"],
            "b_f": arrays["b_f"], "U_f": np.stack([arrays["U_f1"], arrays["U_f2"]]),
            "W_iou": np.concatenate([arrays[f"W_{g}"] for g in GATES]),
            "U_iou": np.concatenate([arrays[f"U_{g}"] for g in GATES]),
            "b_iou": np.concatenate([arrays[f"b_{g}"] for g in GATES]),
        }
        super().load_spec(fused)

    # ---- eager: per tree, per node ----------------------------------------------------------
    @staticmethod
    def _finish(iou: torch.Tensor, c: torch.Tensor | None):
        i, o, u = iou.chunk(3, -1)
        cell = torch.sigmoid(i) * torch.tanh(u)
        if c is not None:
            cell = cell + c
        return torch.sigmoid(o) * torch.tanh(cell), cell

    def _eager_tree(self, tree, per_node_loss: bool):
        """(h of the root, summed node losses or None)."""
        state, losses = {}, []
        for node in tree_nodes(tree):
            if not node.children:
                x = F.embedding(torch.tensor([node.word], device=self.device), self.E,
                                sparse=True)[0]
                h, c = self._finish(F.linear(x, self.W_iou, self.b_iou), None)
            else:
                (h1, c1), (h2, c2) = (state.pop(id(ch)) for ch in node.children)
                iou = F.linear(torch.cat([h1, h2]), self.U_iou, self.b_iou)
                f1 = torch.sigmoid(F.linear(h1, self.U_f[0], self.b_f))
                f2 = torch.sigmoid(F.linear(h2, self.U_f[1], self.b_f))
                h, c = self._finish(iou, f1 * c1 + f2 * c2)
            state[id(node)] = (h, c)
            if per_node_loss:
                logits = F.linear(h, self.W_out, self.b_out)
                losses.append(F.cross_entropy(logits.unsqueeze(0),
                                              torch.tensor([node.label], device=self.device),
                                              reduction="sum"))
        h_root = state[id(tree)][0]
        return h_root, (torch.stack(losses).sum() if per_node_loss else None)

    def forward_eager(self, batch, train):
        if not train:
            return [self._eager_prediction(t) for t in batch]
        return torch.stack([self._eager_tree(t, True)[1] for t in batch]).sum()

    # ---- torch-native: the eager code, recorded ----------------------------------------------
    def _eager_prediction(self, tree) -> int:
        return int(F.linear(self._eager_tree(tree, False)[0], self.W_out, self.b_out).argmax())

    def forward_mode(self, mode, batch, train):
        if mode == "fb-unfused":
            return self.forward_unfused(batch, train)
        if train:
            return self.forward_eager(batch, train)
        return fb.map_batched(self._eager_prediction, batch)

    # ---- fb-unfused: the eager code, op for op in fb ops ------------------------------------
    @staticmethod
    def _unfused_finish(iou: fb.Expression, c: fb.Expression | None):
        H = HIDDEN
        i, o, u = (fb.slice_rows(iou, k * H, (k + 1) * H) for k in range(3))
        cell = fb.logistic(i) * fb.tanh(u)
        if c is not None:
            cell = cell + c
        return fb.logistic(o) * fb.tanh(cell), cell

    def _unfused_tree(self, tree, losses: list | None):
        state = {}
        U_f = [self.U_f[0], self.U_f[1]]  # the stacked forget weights' two views
        for node in tree_nodes(tree):
            if not node.children:
                x = fb.lookup(self.E, node.word, sparse=True)
                h, c = self._unfused_finish(fb.affine(self.W_iou, x, self.b_iou), None)
            else:
                (h1, c1), (h2, c2) = (state.pop(id(ch)) for ch in node.children)
                iou = fb.affine(self.U_iou, fb.concat([h1, h2]), self.b_iou)
                f1 = fb.logistic(fb.affine(U_f[0], h1, self.b_f))
                f2 = fb.logistic(fb.affine(U_f[1], h2, self.b_f))
                h, c = self._unfused_finish(iou, f1 * c1 + f2 * c2)
            state[id(node)] = (h, c)
            if losses is not None:
                losses.append(fb.pick_neg_log_softmax(
                    fb.affine(self.W_out, h, self.b_out), node.label))
        return state[id(tree)][0]

    def forward_unfused(self, batch, train):
        return self._forward_trees(self._unfused_tree,
                                   lambda h: fb.affine(self.W_out, h, self.b_out), batch, train)

    # ---- flybatch: the same per-node code ----------------------------------------------------
    def _fb_tree(self, tree, losses: list | None):
        state = {}
        for node in tree_nodes(tree):
            if not node.children:
                hc = self.cell.leaf(fb.lookup(self.E, node.word, sparse=True))
            else:
                hc = self.cell([state.pop(id(ch)) for ch in node.children])
            state[id(node)] = hc
            if losses is not None:
                losses.append(fb.pick_neg_log_softmax(self.out(hc.h), node.label))
        return state[id(tree)].h

    def forward_flybatch(self, batch, train):
        return self._forward_trees(self._fb_tree, self.out, batch, train)

    @staticmethod
    def _forward_trees(tree_of, logits_of, batch, train):
        """`tree_of(tree, losses)` over the batch: the summed node losses (train), or each
        tree's predicted label from `logits_of(h of its root)`, read in one forward."""
        if not train:
            logits = fb.current_graph().forward([logits_of(tree_of(t, None)) for t in batch],
                                                stack=True)
            return logits.argmax(1).tolist()
        losses = []
        for t in batch:
            tree_of(t, losses)
        return fb.esum(losses)

    # ---- manual: level by level ----------------------------------------------------------------
    def _manual_levels(self, batch):
        """Number the nodes level by level; per level the node ids and their children's ids."""
        height, nodes = {}, []
        for t in batch:
            for n in tree_nodes(t):
                height[id(n)] = 1 + max(height[id(c)] for c in n.children) if n.children else 0
                nodes.append(n)
        order = sorted(range(len(nodes)), key=lambda k: height[id(nodes[k])])  # stable
        index = {id(nodes[k]): pos for pos, k in enumerate(order)}
        ordered = [nodes[k] for k in order]
        levels, start = [], 0
        while start < len(ordered):
            h = height[id(ordered[start])]
            end = start
            while end < len(ordered) and height[id(ordered[end])] == h:
                end += 1
            levels.append((start, end, [[index[id(c)] for c in n.children]
                                        for n in ordered[start:end]]))
            start = end
        return ordered, index, levels

    def forward_manual(self, batch, train):
        ordered, index, levels = self._manual_levels(batch)
        dev = self.device
        start, end, _ = levels[0]  # the preterminals
        words = torch.tensor([n.word for n in ordered[start:end]], device=dev)
        h, c = self._finish(F.linear(F.embedding(words, self.E, sparse=True), self.W_iou,
                                     self.b_iou), None)
        hs, cs = [h], [c]
        for start, end, children in levels[1:]:
            H, C = torch.cat(hs), torch.cat(cs)
            kids = torch.tensor(children, device=dev)  # [n, 2]
            left, right = kids[:, 0], kids[:, 1]
            h1, h2, c1, c2 = H[left], H[right], C[left], C[right]
            iou = F.linear(torch.cat([h1, h2], 1), self.U_iou, self.b_iou)
            f1 = torch.sigmoid(F.linear(h1, self.U_f[0], self.b_f))
            f2 = torch.sigmoid(F.linear(h2, self.U_f[1], self.b_f))
            h, c = self._finish(iou, f1 * c1 + f2 * c2)
            hs.append(h)
            cs.append(c)
        H = torch.cat(hs)
        if not train:
            roots = torch.tensor([index[id(t)] for t in batch], device=dev)
            return F.linear(H[roots], self.W_out, self.b_out).argmax(1).tolist()
        labels = torch.tensor([n.label for n in ordered], device=dev)
        return F.cross_entropy(F.linear(H, self.W_out, self.b_out), labels, reduction="sum")
