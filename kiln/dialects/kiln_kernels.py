"""The `kiln` dialect: Kiln's fused kernel library (`kiln.kernels`, custom ops `torch.ops.kiln.*`).

Each op's kernel is the custom op's Python body, called directly by the generated step (`direct`: not
through the dispatcher, which costs about 15 us a call): on CPU its ATen implementation or native loops, on
CUDA the implementation registered in `kiln.kernels.GPU_IMPLS` (the ATen one until then). A model opts in
by calling `kiln.kernels.*` (capture keeps those calls as single nodes), or the dialect's fusions
below turn unfused code into these ops (written-out RMSNorm, RoPE pairs, SwiGLU, a large-vocabulary
lm_head + cross-entropy). With the dialect disabled (`kiln.dialects("aten")`), nothing is fused and
nodes a model created itself still run the same custom op, as the generic kernel every OpOverload
has, since Kiln cannot take an opaque custom op apart.
"""
from __future__ import annotations

import torch

from kiln import guards
from kiln.dialects.registry import dialect, fusion, kernel
from kiln.ir.graph import Value
from kiln.ir.pattern import Lit, Op, Opt, Seq, V
from kiln.kernels import OPS, activations
from kiln.kernels._common import direct
from kiln.kernels.embedding import embedding_backward_acc
from kiln.ops.common import reshape, shape
from kiln.ir.symbolic import hint, same

KILN = dialect("kiln", priority=5, devices=("cpu", "cuda"),
               doc="Kiln's fused kernels: norms, SwiGLU, Linear+GELU, GELU (tanh), RoPE, chunked Linear+cross-entropy")

for _name, _op in OPS.items():
    # the op's Python body called directly (`direct`: no dispatcher, the same code and the same aliasing check);
    # no run-time fallback, which would run that same body again
    _body = direct(_op)
    kernel(KILN, _op, _body or _op, name=_name, fallback=_body is None)


def _gelu_ok(n) -> bool:
    """A CPU GELU (or its backward) Kiln's kernels run: bfloat16 in either form (by table: the forward ATen's own
    bits), or float32 in the tanh approximation (native.c's single pass)."""
    approximate = n.kwargs.get("approximate", n.args[-1] if isinstance(n.args[-1], str) else "none")
    metas = [v.meta for v in n.inputs] + [v.meta for v in n.outputs]
    if any(m is None or m.device.type != "cpu" for m in metas):
        return False
    dtypes = {m.dtype for m in metas}
    return (approximate in ("none", "tanh") and dtypes == {torch.bfloat16}) or (
        approximate == "tanh" and dtypes <= {torch.float32, torch.bfloat16})


kernel(KILN, torch.ops.aten.gelu.default, activations.gelu, checker=_gelu_ok, name="gelu")
kernel(KILN, torch.ops.aten.gelu_backward.default, activations.gelu_backward, checker=_gelu_ok,
       name="gelu_backward")
# gelu_backward with its bias's gradient (kiln/passes/accumulate.py `fold_column_sums` places it)
kernel(KILN, activations.gelu_backward_sums, activations.gelu_backward_sums, name="gelu_backward_sums")


def _on_cpu(n) -> bool:
    return all(v.meta is not None and v.meta.device.type == "cpu" for v in n.inputs)


# a tied embedding's two gradients summed in one pass (kiln/passes/accumulate.py places it; exact everywhere)
kernel(KILN, embedding_backward_acc, embedding_backward_acc, name="embedding_backward_acc")

# the non-finite guard as one scan of exponent bits (native.c) instead of the gradients' norms
kernel(KILN, guards.check_finite, guards.check_finite_scan, checker=_on_cpu, name="finite_scan")


# ---- fusions: unfused subgraphs -> kiln kernels (the `fuse` pass) ------------------------------
aten, kiln_ops = torch.ops.aten, torch.ops.kiln
CAST = aten._to_copy.default
MUL = aten.mul.Tensor


def T(name: str) -> V:
    """A tensor argument (a graph Value, not a Python number), bound to name."""
    return V(name, where=lambda x: isinstance(x, Value))


def _last_dim(dims, v) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, len(shape(v)) - 1)


def _is_cast(x, dtype=None) -> bool:
    n = getattr(x, "producer", None)
    return n is not None and n.target is CAST and set(n.kwargs) <= {"dtype"} and \
        (dtype is None or n.kwargs.get("dtype") == dtype)


# RMSNorm written out (Hugging Face's LlamaRMSNorm and its copies):
#   xf = x.to(fp32); xf * rsqrt(mean(xf**2, -1, keepdim) + eps) -> .to(x.dtype) -> weight * (...)
RMS_NORM = Op(MUL, T("w"), Opt(CAST, Op(MUL, V("xf"), Op(aten.rsqrt.default, Op(
    aten.add.Tensor, Op(aten.mean.dim, Op(aten.pow.Tensor_Scalar, Opt(CAST, T("x"), name="xf"), Lit(2)),
                        V("dims"), Lit(True)), V("eps", where=lambda e: isinstance(e, float)), Lit(1))),
    commutative=True), name="normed"), commutative=True)


def build_rms_norm(b, matches):
    (m,) = matches
    x, w, normed = m["x"], m["w"], m["normed"]
    if not (_last_dim(m["dims"], m["xf"]) and same(shape(w), shape(x)[-1:]) and w.is_float):
        return None
    if m["xf"] is not x and not _is_cast(m["xf"], torch.float32):
        return None            # statistics in a dtype other than fp32: not the kernel's numerics
    if normed.producer.target is CAST and normed.meta.dtype != x.meta.dtype:
        return None            # the normalized value is cast to a third dtype
    out, _rstd = b(kiln_ops.rms_norm.default, x, w, m["eps"])
    return [out] if out.meta.dtype == m.root.outputs[0].meta.dtype else None


fusion(KILN, "rms_norm", RMS_NORM, build_rms_norm, priority=10,
       doc="x * rsqrt(mean(x^2) + eps) * w written out -> kiln.rms_norm (one pass, fp32 statistics)")


# The residual add before an RMSNorm (a pre-norm transformer's `h = h + attn(...)`, then `norm(h)`): one pass adds,
# writes the sum (the residual stream, used on by the next block: a shared value) and normalizes it. The sum is
# rounded to the inputs' promoted dtype as ATen's add rounds it, and a float32 sum's statistics are eager's own
# (kiln/kernels/norms.py), so the result is the unfused ops' bit for bit.
ADD_RMS_NORM = Op(kiln_ops.rms_norm.default, Op(aten.add.Tensor, T("x"), T("r"), Lit(1), name="sum"), T("w"),
                  V("eps"), Lit(None))


def build_add_rms_norm(b, matches):
    (m,) = matches
    x, r, total = m["x"], m["r"], m["sum"]
    if not (x.is_float and r.is_float and same(shape(x), shape(r)) and same(shape(total), shape(x))):
        return None            # broadcasting: the kernel adds rows of one shape
    out, s, rstd = b(kiln_ops.add_rms_norm.default, x, r, m["w"], m["eps"])
    if s.meta.dtype != total.meta.dtype or out.meta.dtype != m.root.outputs[0].meta.dtype:
        return None
    return [([out, rstd], {"sum": s})]


fusion(KILN, "add_rms_norm", ADD_RMS_NORM, build_add_rms_norm, priority=9, shared=("sum",),
       doc="x + r, then kiln.rms_norm of the sum -> kiln.add_rms_norm (one pass writes the sum and the norm)")


# SwiGLU gating: silu(gate) * up, same shapes (Llama/Mistral/Qwen MLPs)
SWIGLU = Op(MUL, Op(aten.silu.default, T("gate")), T("up"), commutative=True)


def build_swiglu(b, matches):
    (m,) = matches
    gate, up = m["gate"], m["up"]
    if not same(shape(gate), shape(up)) or gate.meta.dtype != up.meta.dtype:
        return None            # broadcasting or mixed dtypes: the kernel takes neither
    return [b(kiln_ops.swiglu.default, gate, up)]


fusion(KILN, "swiglu", SWIGLU, build_swiglu, priority=5,
       doc="silu(gate) * up -> kiln.swiglu (silu(gate) recomputed in the backward, not stored)")


# Rotary embedding, Llama's rotate_half convention: t * cos + cat(-t[..., h:], t[..., :h]) * sin.
# Queries and keys rotated by the same tables are paired into one kiln.rope call.
ROPE = Op(aten.add.Tensor, Op(MUL, T("t"), T("cos"), commutative=True), Op(MUL, Op(aten.cat.default, Seq(
    Op(aten.neg.default, Op(aten.slice.Tensor, T("t"), V("d1"), V("h1"), V("end"), Lit(1))),
    Op(aten.slice.Tensor, T("t"), V("d0"), Lit(0), V("h0"), Lit(1))), V("dcat")), T("sin"), commutative=True),
    Lit(1), commutative=True)


def _rope_ok(m) -> bool:
    t = m["t"]
    last, half = len(shape(t)) - 1, shape(t)[-1] // 2
    dims_ok = all(m[d] in (-1, last) for d in ("d0", "d1", "dcat"))
    return dims_ok and shape(t)[-1] % 2 == 0 and m["h0"] == half and m["h1"] == half and m["end"] >= 2 * half


def build_rope(b, matches):
    q, k = matches
    if not (_rope_ok(q) and _rope_ok(k)):
        return None
    qr, kr = b(kiln_ops.rope.default, q["t"], k["t"], q["cos"], q["sin"])
    if qr.meta.dtype != q.root.outputs[0].meta.dtype or kr.meta.dtype != k.root.outputs[0].meta.dtype:
        return None
    return [qr], [kr]


fusion(KILN, "rope", ROPE, build_rope, priority=5, group_by=lambda m: (m["cos"].uid, m["sin"].uid),
       group_size=2, min_group=2,
       doc="q*cos + rotate_half(q)*sin and the same for k -> one kiln.rope (paired by their cos/sin)")


# The vocabulary projection and its cross-entropy as one kernel, which computes no logits for tokens whose
# label is ignored (padding, masked prompts): those add nothing to the loss or the gradients. The kernel
# computes the loss's gradients in its forward, a chunk of logits at a time, and keeps them (hidden- and
# weight-sized) for the backward instead of any logits: 3 matmuls as eager, and no (tokens x vocab)
# tensor outlives its chunk. Below LOGITS_BYTES_TO_FUSE (a classifier's few classes) the matmuls are too
# small for skipping rows to pay for the gather: the ATen ops stay.
LOGITS_BYTES_TO_FUSE = 4 * 2 ** 20
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
VIEW = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
LINEAR_CE = Op(aten.nll_loss_forward.default, Op(aten._log_softmax.default, Opt(VIEW, Opt(CAST, Op(
    aten.linear.default, T("h"), T("w"), V("bias", where=lambda x: x is None or isinstance(x, Value)),
    name="logits"))), Lit(lambda d: d in (1, -1)), Lit(False)),
    Opt(VIEW, T("labels")), Lit(None), V("reduction"), V("ignore_index"))


def build_linear_cross_entropy(b, matches):
    (m,) = matches
    h, w, logits, labels = m["h"], m["w"], m["logits"], m["labels"]
    tokens = logits.meta.numel // shape(w)[0]
    if m["reduction"] not in REDUCTIONS or m["reduction"] == 0 or len(shape(w)) != 2:
        return None
    # whether fusing pays, judged on the compiled batch's size (a hint: no guard); it is right for any size
    size = hint(tokens) * hint(shape(w)[0]) * 4
    # nll_loss needs as many labels as rows of logits: with dynamic sizes they may be different symbols
    # (labels and input_ids are separate inputs), equal by the program's guard that nll_loss put there
    counted = same(labels.meta.numel, tokens) or hint(labels.meta.numel) == hint(tokens)
    if size < LOGITS_BYTES_TO_FUSE or not counted:
        return None
    bias = m["bias"]
    if bias is not None and (len(shape(bias)) != 1 or bias.meta.dtype != w.meta.dtype or not same(shape(bias)[0], shape(w)[0])):
        return None
    hidden = reshape(b, h, [tokens, shape(h)[-1]])
    args = (hidden, w, reshape(b, labels, [tokens]), m["ignore_index"], REDUCTIONS[m["reduction"]], 0)
    # a decoder's bias (BERT's MLM head) is added to the logits as the kernel's softmax reads them, in fp32
    loss, *_grads = b(kiln_ops.linear_cross_entropy_grads.default, *args, *(() if bias is None else (bias,)))
    if loss.meta.dtype != m.root.outputs[0].meta.dtype:
        loss = b(CAST, loss, dtype=m.root.outputs[0].meta.dtype)
    return [(loss, None)]


fusion(KILN, "linear_cross_entropy", LINEAR_CE, build_linear_cross_entropy, priority=10,
       doc=f"lm_head + cross-entropy -> kiln.linear_cross_entropy (no logits for ignored labels) when the logits "
           f"take >= {LOGITS_BYTES_TO_FUSE >> 20} MiB; the gradients computed in the forward, in chunks")


# LayerNorm's backward in a mixed-precision step, with the gradient sums on either side of it: the residual
# stream's gradient plus its branch's (an fp32 add of a bf16 value) read as two inputs, the gradient its input
# gets through its other uses added in the same pass (`accumulates`: kiln/passes/accumulate.py), and the bf16
# copy the next matmul reads written beside it (`also_low`: kiln/passes/casts.py). ATen runs the add, the
# backward and the cast as three passes (Inductor's region of them as several): one pass per row here. Only
# where a gradient reaching it is bf16 (autocast's): an fp32 step keeps eager's arithmetic bit for bit, and an fp16
# one (which the native pass does not read) keeps ATen's ops and their regions.
LN_BACKWARD = aten.native_layer_norm_backward.default
_LN_REST = (T("x"), V("shape"), T("mean"), T("rstd"), V("w"), V("bias"), V("mask"))
LN_BACKWARD_OF_SUM = Op(LN_BACKWARD, Op(aten.add.Tensor, T("g1"), T("g2"), Lit(1), name="g"), *_LN_REST)
LN_BACKWARD_ALONE = Op(LN_BACKWARD, T("g1"), *_LN_REST)
_HALF = (torch.bfloat16,)


def _half_gradient(v: Value) -> bool:
    """A bf16 gradient, or one widened from bf16 (autocast's backward), seen through views."""
    while v.producer is not None and v.producer.target in VIEW and isinstance(v.producer.args[0], Value):
        v = v.producer.args[0]
    return v.meta.dtype in _HALF or (_is_cast(v) and v.producer.args[0].meta.dtype in _HALF)


def build_layer_norm_backward(b, matches):
    (m,) = matches
    x, w, bias, mask = m["x"], m["w"], m["bias"], m["mask"]
    terms = [m["g1"]] + ([m["g2"]] if "g2" in m.bindings else [])
    metas = [v.meta for v in (x, m["mean"], m["rstd"], *terms)]
    if any(meta is None or meta.device.type != "cpu" for meta in metas) or not any(_half_gradient(t) for t in terms):
        return None
    d = shape(x)[-1] if shape(x) else None
    if not (isinstance(m["shape"], (list, tuple)) and len(m["shape"]) == 1 and d is not None and same(m["shape"][0], d)):
        return None                # normalized over more than the last dimension
    if m["mean"].meta.dtype != torch.float32 or m["rstd"].meta.dtype != torch.float32:
        return None
    for p in (w, bias):
        if p is not None and not (isinstance(p, Value) and p.meta.dtype == torch.float32 and same(shape(p), [d])):
            return None
    if list(mask) != [True, w is not None, bias is not None] or any(not same(shape(t), shape(x)) for t in terms):
        return None
    if "g2" in m.bindings and m["g"].meta.dtype != torch.float32:
        return None                # a half-type sum is rounded before the backward reads it: the graph's bits
    gi, gw, gb, _low = b(kiln_ops.layer_norm_backward.default, terms[0], terms[1] if len(terms) > 1 else None, x,
                         m["mean"], m["rstd"], w, bias, None)
    return [(gi, gw, gb)[:len(m.root.outputs)]]


for _pattern, _label in ((LN_BACKWARD_OF_SUM, "layer_norm_backward_of_sum"), (LN_BACKWARD_ALONE, "layer_norm_backward")):
    fusion(KILN, _label, _pattern, build_layer_norm_backward, phase="training", priority=10 if _pattern is
           LN_BACKWARD_OF_SUM else 5, doc="add + native_layer_norm_backward (+ the add after, + the bf16 cast of its "
           "result) in a mixed-precision step on the CPU -> kiln.layer_norm_backward (one pass per row)")


# RMSNorm's backward reading its output gradient as the two terms the graph added (the input gradients of two
# projections that read the norm's output: Llama's gate and up), and widened where autocast's backward widens the
# sum for the fp32 norm: the kernel adds the terms as the add did (in fp32, rounded once to their dtype) and reads
# the sum widened exactly, so it gets the graph's bits without the add's pass over three tensors or the cast's.
RMS_BACKWARD_OF_SUM = Op(kiln_ops.rms_norm_backward.default,
                         Opt(CAST, Op(aten.add.Tensor, T("g1"), T("g2"), Lit(1), name="g"), name="g_in"),
                         V("gsum"), T("x"), T("w"), T("rstd"), V("low"), Lit(None))
# three terms, the graph's ((g1 + g2) + g3) in either operand order of the outer add (Llama's q, k and v)
RMS_BACKWARD_OF_THREE = Op(kiln_ops.rms_norm_backward.default,
                           Opt(CAST, Op(aten.add.Tensor, Op(aten.add.Tensor, T("g1"), T("g2"), Lit(1), name="g12"),
                                        T("g3"), Lit(1), name="g", commutative=True), name="g_in"),
                           V("gsum"), T("x"), T("w"), T("rstd"), V("low"), Lit(None))


def build_rms_norm_backward_of_sum(b, matches):
    """The norm's backward reading the terms the graph added (two, or three where the first add's sum is itself
    an add's that only this sum reads), refused where the kernel's sums would not be the graph's bits."""
    (m,) = matches
    terms = [m[k] for k in ("g1", "g2", "g3") if k in m.bindings]
    sums = [m[k] for k in ("g12", "g") if k in m.bindings]
    g, g_in = m["g"], m["g_in"]
    if any(v.meta is None for v in (*terms, *sums, g_in)) or len({v.meta.dtype for v in (*terms, *sums)}) != 1:
        return None                # a promoting add: its sum is rounded to another dtype
    if g_in is not g and not (_is_cast(g_in, torch.float32) and g.meta.dtype in (torch.bfloat16, torch.float16)):
        return None                # only an exact widening between the sum and the norm's backward
    if not all(same(shape(t), shape(g)) for t in (*terms, *sums)):
        return None                # a broadcast addend
    low = {} if m["low"] is None else {"low_dtype": m["low"]}      # keywords, as the later passes give them
    more = dict(zip(("grad_out2", "grad_out3"), terms[1:]))
    outs = b(kiln_ops.rms_norm_backward.default, terms[0], m["gsum"], m["x"], m["w"], m["rstd"], **more, **low)
    return [tuple(outs)[:len(m.root.outputs)]]


fusion(KILN, "rms_norm_backward_of_three", RMS_BACKWARD_OF_THREE, build_rms_norm_backward_of_sum, phase="training",
       priority=11, doc="add + add + kiln.rms_norm_backward -> kiln.rms_norm_backward reading the three terms (each "
       "sum rounded as its add rounded it: the same bits, without the adds' passes)")
fusion(KILN, "rms_norm_backward_of_sum", RMS_BACKWARD_OF_SUM, build_rms_norm_backward_of_sum, phase="training",
       priority=10, doc="add + kiln.rms_norm_backward -> kiln.rms_norm_backward reading both terms (the sum rounded "
       "as the add rounded it: the same bits, without the add's pass)")
