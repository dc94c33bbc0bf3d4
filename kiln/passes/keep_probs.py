"""Attention keeps its probabilities for the backward where they are no larger than what it keeps anyway.

CPU flash attention's backward (ATen's kernel, or the `attention` dialect's products) computes the scores
q k^T and P = exp(z - lse) again from the forward's log-sum-exp: the flash design, which keeps nothing
(queries x keys)-sized between forward and backward. At short sequences that recomputation is a fifth of the
backward's products plus an exp per score, while P itself is no bigger than the q, k, v and output the
backward keeps anyway. This pass replaces each such forward and the backward that reads its log-sum-exp by
the `attention` dialect's pair `kiln.attention_keeping_probs` / `kiln.attention_backward_from_probs`: the
forward also returns P (normalized, rounded once to bf16, `kiln.kernels.attention.probs_shape`), the
backward reads it. P is an ordinary value of the graph, so the memory model counts it from the forward to
the backward like any activation.

A pair is rewritten when all of these hold (else it stays as it is):
- the `attention` dialect is enabled and the step has no memory budget (remat would rather recompute the
  whole forward than drop P; without the rewrite the backward recomputes P alone);
- this machine runs the one-pass bf16 kernels that write and read P (`keeps_probs_here`: AVX-512 BF16, no
  AMX, where the measured choice between ATen's flash kernels and the products stays as it was);
- bf16 q, k, v on the CPU, static sizes, no dropout, at least as many (batch x head) slices as threads (the
  one-pass backward's grain), and the log-sum-exp read by that backward alone;
- P's bytes are at most those of q, k, v and the output together (t s <= t d + s d + s dv + t dv per head: for
  t = s and d = dv, s <= 4 d; 256 tokens at head size 64): the attention's saved memory at most doubles.

Measured on the AMD EPYC (Zen 4) of docs/bf16.md, one attention layer B8 H8 T256 d64 in bf16: with a padding
mask the backward takes 9.8 against 12.1 ms and the forward 5.8 against 5.5 ms (writing P); causal, 6.7
against 7.9 and 4.2 against 3.9 ms.

Where a rewritten backward's three gradients reach one concatenation only, each transposed to (batch, tokens,
heads x d), joined along the last dimension (a model that splits one joined q/k/v projection: GPT-2's `c_attn`,
whose backward reads that concatenation), the backward becomes `kiln.attention_backward_packed`
(`_pack_gradients`), which writes each gradient into its columns of the concatenation: the (batch, heads,
tokens, d) gradients, their transposes and merges, and the concatenation itself go (GPT-2 bench model: 0.45
ms a layer of concatenation).
"""
from __future__ import annotations

import math

import torch

from kiln.ir.graph import Graph, Node, Phase, Value
from kiln.kernels import native
from kiln.kernels.attention import keeps_probs_here, probs_shape
from kiln.ops.common import arg
from kiln.ops.nn import ATTENTION_FROM_PROBS, ATTENTION_KEEPING_PROBS, ATTENTION_PACKED

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def keep_attention_probs(graph: Graph, dialects: tuple[str, ...], budget) -> int:
    """Rewrite each eligible (forward, backward) pair in place. Returns how many were rewritten."""
    if "attention" not in dialects or budget is not None or not any(n.target is BACKWARD for n in graph.nodes):
        return 0
    if not keeps_probs_here():
        return 0
    users = graph.users()
    done = 0
    for n in graph.nodes:
        f = _forward_of(n, users)
        if f is None or not _small(f):
            continue
        probs_meta = ATTENTION_KEEPING_PROBS.infer(f.args, f.kwargs)[2]
        probs = _add_output(graph, f, probs_meta)
        f.op, f.target = ATTENTION_KEEPING_PROBS, ATTENTION_KEEPING_PROBS.targets[0]
        n.op, n.target = ATTENTION_FROM_PROBS, ATTENTION_FROM_PROBS.targets[0]
        n.args = n.args[:6] + (probs,) + n.args[6:]
        _pack_gradients(graph, n, users)
        done += 1
    return done


# the views between an attention gradient (batch, heads, tokens, d) and the concatenation
_TRANSPOSE = aten.transpose.int
_MERGE = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _pack_gradients(graph: Graph, n: Node, users: dict) -> bool:
    """Where the backward `n`'s three gradients reach one concatenation only, each as `g.transpose(1, 2)` with its
    heads merged (`reshape(b, t, heads * d)`), joined along the last dimension (a model splitting one joined q/k/v
    projection, GPT-2's `c_attn`: the gradient of that projection's output), `n` becomes
    `kiln.attention_backward_packed`, which writes the gradients into the concatenation's columns: the
    transposes, merges and the concatenation go. Returns whether it did."""
    chain: list[Node] = []
    pieces: dict[Value, int] = {}
    for i, g in enumerate(n.outputs):
        (t, *more) = users.get(g, [None])
        if more or t is None or t.target is not _TRANSPOSE or sorted(t.args[1:3]) not in ([1, 2], [-3, -2]):
            return False
        (r, *more) = users.get(t.outputs[0], [None])
        if more or r is None or r.target not in _MERGE:
            return False
        b, h, s, d = g.meta.shape
        if tuple(r.outputs[0].meta.shape) != (b, s, h * d):
            return False
        chain += [t, r]
        pieces[r.outputs[0]] = i
    readers = [users.get(v, []) for v in pieces]
    if any(len(x) != 1 or x[0] is not readers[0][0] for x in readers):
        return False
    cat = readers[0][0]
    if cat.target is not aten.cat.default or not isinstance(cat.args[0], (list, tuple)) or len(cat.args[0]) != 3:
        return False
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in (2, -1) or any(v not in pieces for v in cat.args[0]) or len(set(cat.args[0])) != 3:
        return False
    if n.outputs[0].meta.shape[2] != n.outputs[1].meta.shape[2]:
        return False                    # keys of another length than the queries: no (b, t, ...) concatenation
    order = tuple(pieces[v] for v in cat.args[0])
    packed = cat.outputs[0]
    n.op, n.target = ATTENTION_PACKED, ATTENTION_PACKED.targets[0]
    n.kwargs = dict(n.kwargs, order=order)
    n.outputs = [packed]
    packed.producer = n
    gone = {x.uid for x in chain} | {cat.uid}
    graph.nodes = [x for x in graph.nodes if x.uid not in gone]
    return True


def _forward_of(n: Node, users: dict) -> Node | None:
    """The flash forward whose output and log-sum-exp the flash backward `n` reads, where the pair qualifies."""
    if n.target is not BACKWARD or n.phase is not Phase.BACKWARD or len(n.args) < 6:
        return None
    lse = n.args[5]
    f = getattr(lse, "producer", None)
    if f is None or f.target is not FORWARD or f.phase is not Phase.FORWARD:
        return None
    if tuple(f.args[:3]) != tuple(n.args[1:4]) or n.args[4] is not f.outputs[0] or lse is not f.outputs[1]:
        return None
    if users.get(lse) != [n]:
        return None                     # another reader of the log-sum-exp (not a pattern Kiln emits)
    if arg(f, 3, "dropout_p", 0.0) or arg(n, 6, "dropout_p", 0.0):
        return None
    if arg(f, 4, "is_causal", False) != arg(n, 7, "is_causal", False):
        return None
    for key in ("attn_mask", "scale"):
        if f.kwargs.get(key) is not n.kwargs.get(key) and f.kwargs.get(key) != n.kwargs.get(key):
            return None
    q, k, v = (x.meta for x in f.args[:3])
    if any(m is None or m.symbolic or m.device.type != "cpu" or m.dtype != torch.bfloat16 for m in (q, k, v)):
        return None
    if len(q.shape) != 4 or q.shape[0] * q.shape[1] < native.threads():
        return None
    return f


def _small(f: Node) -> bool:
    """P no larger than q, k, v and the output together."""
    q, k, v = (x.meta for x in f.args[:3])
    out = f.outputs[0].meta
    kept = sum(2 * math.prod(m.shape) for m in (q, k, v, out))
    return 2 * math.prod(probs_shape(q.shape, k.shape)) <= kept


def _add_output(graph: Graph, f: Node, meta) -> Value:
    """A new last output of f."""
    probs = Value(graph.fresh_name("attn_probs"), meta)
    probs.producer = f
    f.outputs = [*f.outputs, probs]
    return probs
