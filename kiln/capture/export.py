"""torch.export (non-strict) -> Kiln IR.

PyTorch captures the forward; Kiln never traces by itself. `run_decompositions({})` gives a functional
ATen graph that still holds the high-level ops with fast kernels (linear, layer_norm, sdpa,
cross_entropy_loss, embedding, ...). Parameters, buffers and lifted constants become graph inputs;
buffer mutations (BatchNorm running statistics) become the graph's `mutations`.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from kiln.capture import aliasing, branches, decomps, functions, hf, modes
from kiln.errors import CaptureError, KilnError, UnsupportedError
from kiln.guards import BRANCH_GUARD, branch_guard
from kiln.ir import symbolic
from kiln.ir.graph import Graph, Node, Phase, Role, TensorMeta, Value
from kiln.ops import registry

# Nodes export leaves for its own runtime checks; they compute nothing.
# (`_assert_scalar`, the assertions over tensor values, become branch guards: kiln/capture/branches.py)
_DROP = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_async.msg}


def extract_loss(out: Any) -> torch.Tensor:
    """The loss from what a model returns: a tensor, a tuple/list led by it, or an object with .loss."""
    loss = out
    if hasattr(out, "loss"):
        loss = out.loss
    elif isinstance(out, dict) and "loss" in out:
        loss = out["loss"]
    elif isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        kind = type(out).__name__
        hint = (" (a Hugging Face model returns loss=None when no labels are passed)"
                if hasattr(out, "loss") else "")
        raise UnsupportedError(f"the forward returned {kind}, not a loss tensor{hint}; return a scalar "
                               "tensor, a tuple led by it, an object with .loss, or pass loss_fn=")
    if loss.numel() != 1:
        raise UnsupportedError(f"the loss must be a scalar, got shape {tuple(loss.shape)}; reduce it (e.g. .mean()) "
                               "or pass loss_fn=")
    if not loss.dtype.is_floating_point:
        raise UnsupportedError(f"the loss must be a floating-point tensor, got {loss.dtype}")
    return loss.reshape(())


class LossModule(torch.nn.Module):
    """model + loss as one module, so export sees parameters under `model.`. Its forward takes the step's
    tensors only, flat (`leaves`/`spec`: the call's flattened arguments; `slots`: where the tensors go),
    so each can be given dynamic dimensions; the other arguments (Python numbers, strings, None) are
    constants of the program, part of its cache key."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, leaves: list | None = None,
                 spec=None, slots: list[int] | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self._call = (leaves, spec, slots)

    def forward(self, *tensors):
        leaves, spec, slots = self._call
        if spec is None:                    # called like the model itself
            args, kwargs = tensors, {}
        else:
            filled = list(leaves)
            for i, t in zip(slots, tensors):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, spec)
        if self.loss_fn is not None:
            return extract_loss(self.loss_fn(self.model, *args, **kwargs))
        return extract_loss(self.model(*args, **kwargs))


def leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """A readable name per flattened argument leaf: `input_ids`, `arg0`, `pixel_values_1` (nested)."""
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = []
    for path, _leaf in paths:
        parts = []
        for k in path[1:]:
            v = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
            parts.append(str(v))
        if path and getattr(path[0], "idx", None) == 0 and parts:
            parts[0] = f"arg{parts[0]}"
        names.append("_".join(parts) or "input")
    return names


@contextlib.contextmanager
def _training_config(model: torch.nn.Module):
    """Hugging Face models: no KV cache while training (caches are inference state)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "use_cache")}
    saved = [(c, c.use_cache) for c in configs.values()]
    try:
        for c, _ in saved:
            c.use_cache = False
        yield
    finally:
        for c, v in saved:
            c.use_cache = v


def _scope(fx_node) -> str:
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    for prefix in ("L['self'].", "L__self__."):
        path = path.removeprefix(prefix)
    if path == "model":                  # LossModule's `model`: the user's model itself
        return ""
    return path.removeprefix("model.")


def _meta(val: Any) -> TensorMeta | None:
    return TensorMeta.of(val) if isinstance(val, torch.Tensor) else None


def capture(model: torch.nn.Module, loss_fn: Callable | None, args: tuple, kwargs: dict,
            dims: dict[int, dict] | None = None) -> tuple[Graph, dict]:
    """Export model+loss on (args, kwargs). Returns the forward graph (outputs[0] is the loss) and
    {lifted constant name: tensor}. `dims`: {flattened leaf index: {dim: torch.export.Dim}} for the
    dimensions to capture symbolically (kiln/runtime/shapes.py decides them); None: every size static."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    wrapper = LossModule(model, loss_fn, leaves, spec, slots)
    tensors = tuple(leaves[i] for i in slots)
    dynamic = {"tensors": tuple((dims or {}).get(i) for i in slots)} if dims else None
    stack: list[str] = []
    try:
        with _training_config(model), _module_tracker(model, stack), _quiet_torch_logs(), \
                functions.honour_autograd_functions(), _capturable_ctc(), _no_causal_mask_detection(), \
                decomps.refuse_packed_sequences(), modes.refuse_no_grad_in_autocast(stack), \
                hf.honour_autocast_off(), hf.eager_mask_decisions(), modes.warn_rebound_buffers(model):
            ep = _export(wrapper, tensors, dynamic, stack)
        modes.detach_no_grad_regions(ep)
        modes.mark_autocast_off(ep)
        aliasing.own_mutated_detaches(ep, lambda fx: f"in {_scope(fx) or type(model).__name__}, {_user_line(fx)}")
        ep = ep.run_decompositions(_decompositions())     # one pass: functional ATen, composites written out
    except KilnError:
        raise
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, KilnError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if _constraint_violation(e):
            raise UnsupportedError(_describe_violation(e, leaf_names(args, kwargs), slots)) from None
        raise CaptureError(_describe_failure(model, stack, e)) from e
    return _to_kiln(ep, model, slots, leaf_names(args, kwargs))


def _constraint_violation(e: BaseException) -> bool:
    """Whether export refused a dimension the user asked to be dynamic (the model needs it fixed)."""
    return "Constraints violated" in str(e) or type(e).__name__ == "ConstraintViolationError"


def _describe_violation(e: BaseException, names: list[str], slots: list[int]) -> str:
    import re
    text = str(e)
    for k, i in enumerate(slots):        # export names the inputs tensors[k]: say which argument that is
        text = re.sub(rf"\[['\"]?tensors['\"]?\]\[{k}\]", f"[{names[i]!r}]", text)
        text = text.replace(f"tensors[{k}]", names[i])
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("For more")]
    return ("a dimension given as dynamic (kiln.compile(..., dynamic={...})) cannot be: the model's code fixes "
            "its size or ties it to another. Drop it from the spec, or name tied dimensions alike. torch.export "
            "says:\n  " + "\n  ".join(lines[:12]))


CTC_HINT = ("Hugging Face CTC heads check the labels' values and select targets by a mask; call the model "
            "without labels and compute the loss in loss_fn=, e.g. `log_probs = model(input_values=x).logits"
            ".log_softmax(-1).transpose(0, 1)` then `F.ctc_loss(log_probs, labels.clamp_min(0), input_lengths, "
            "(labels >= 0).sum(-1), blank=model.config.pad_token_id, reduction=model.config.ctc_loss_reduction, "
            "zero_infinity=model.config.ctc_zero_infinity)` with tensor lengths (docs/model-coverage.md)")


@functools.cache
def _decompositions() -> dict:
    return decomps.table(_handled)


def _handled(op) -> bool:
    """Whether Kiln has something for `op` of its own: a declaration in kiln.ops, or a dialect lowering
    (scaled_dot_product_attention, ...). Other composites are written out at capture."""
    from kiln.dialects import registry as dialect_registry
    return registry.registered(op) or op in dialect_registry.lowered_targets()


def _export(wrapper, tensors: tuple, dynamic, stack: list[str]):
    """torch.export; where it fails on a Python decision on tensor values, again with the example's values
    deciding (kiln/capture/branches.py). If that fails on values too (a shape that depends on them), the
    first failure is reported; if the model itself raises on this batch, that error is."""
    try:
        return torch.export.export(wrapper, tensors, dynamic_shapes=dynamic, strict=False)
    except KilnError:
        raise
    except Exception as e:
        if not branches.data_dependent(e):
            raise
        first, where = e, list(stack)
    try:
        stack.clear()
        with branches.values_decide():
            ep = torch.export.export(wrapper, tensors, dynamic_shapes=dynamic, strict=False)
    except KilnError:
        raise
    except Exception as second:
        if not branches.data_dependent(second) and _raised_by_model(second):
            raise                       # what the model itself does with this batch's values (its own raise)
        stack[:] = where
        raise first from None
    if branches.parameter_dependent(ep):
        stack[:] = where
        raise first
    return ep


@contextlib.contextmanager
def _capturable_ctc():
    """`F.ctc_loss` with tensor lengths lowers to `aten._ctc_loss.Tensor`, whose second output is shaped by
    the values of `target_lengths`, which export cannot capture; during capture it becomes
    `kiln.kernels.ctc_loss` (the same loss and gradients, an output shape known from the inputs)."""
    import torch.nn.functional as F
    from kiln.kernels.ctc import ctc_loss as kiln_ctc_loss
    original = F.ctc_loss

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                 zero_infinity=False):
        if isinstance(input_lengths, torch.Tensor) or isinstance(target_lengths, torch.Tensor):
            return kiln_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        return original(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)

    F.ctc_loss = ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = original


@contextlib.contextmanager
def _no_causal_mask_detection():
    """`nn.TransformerEncoder/Decoder` given a mask but no `is_causal` compare the mask's values with a
    causal one to pick a faster path, which export cannot capture. The flag is only a hint: the mask
    itself is applied either way, so during capture the comparison is skipped (the hint stays what the
    user passed)."""
    from torch.nn.modules import transformer
    original = transformer._detect_is_causal_mask

    def detect(mask, is_causal=None, size=None):
        return original(mask, is_causal, size) if mask is None else is_causal is True

    transformer._detect_is_causal_mask = detect
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs its internal graphs as warnings on failure; Kiln reports the failure itself."""
    import logging
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _module_tracker(model: torch.nn.Module, stack: list[str]):
    """Keep the path of the module whose forward is running, so capture errors can name it."""
    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(mod.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _pop(stack: list) -> None:   # a forward hook must return None, or it replaces the output
    if stack:
        stack.pop()


def _ours(filename: str) -> bool:
    """Whether a source file is torch's or Kiln's (not the user's model)."""
    import os
    return filename.startswith((os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))))


def _raised_by_model(e: BaseException) -> bool:
    """Whether the innermost frame of `e` is the model's code (a `raise` or `assert` of its own), not
    torch's or Kiln's."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and not _ours(frames[-1].filename)


def _user_frame(e: BaseException) -> str:
    """file:line and code of the innermost frame outside torch and kiln."""
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not _ours(f.filename)]
    if frames:
        f = frames[-1]
        return f"{f.filename}:{f.lineno}" + (f": `{f.line.strip()}`" if f.line else "")
    # an error raised while export re-traces an op carries the model's frames in its text only
    import re
    lines = str(e).splitlines()
    found = [(m.group(1), m.group(2), lines[i + 1].strip() if i + 1 < len(lines) else "")
             for i, line in enumerate(lines) if (m := re.match(r'\s*File "([^"]+)", line (\d+)', line))
             and not _ours(m.group(1))]
    if not found:
        return ""
    file, line, code = found[-1]
    return f"{file}:{line}" + (f": `{code}`" if code else "")


def _describe_failure(model, stack: list[str], e: Exception) -> str:
    where = stack[-1] if stack else ""
    mod = model.get_submodule(where) if where else model
    path = f"module `{where}` ({type(mod).__name__})" if where else f"{type(model).__name__}.forward"
    frame = _user_frame(e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    hint = ""
    if "data-dependent" in str(e) or "DataDependent" in type(e).__name__:
        hint = ("\n  hint: Python control flow or .item()/.tolist() on a tensor's value; the forward must "
                "branch on shapes only (use torch.where / masking instead)")
        if type(model).__name__.endswith("ForCTC"):
            hint += "\n  hint: " + CTC_HINT
    return (f"torch.export could not capture the forward, in {path}" + (f" at {frame}" if frame else "") +
            f":\n  {type(e).__name__}: {first}{hint}")


def _static(t: torch.Tensor) -> bool:
    """Whether t's shape is set by input sizes alone (static, or symbolic in the input sizes), not by values."""
    return not symbolic.unbacked(t)


def _user_line(fx) -> str:
    """The model's source line an exported node came from (export keeps the stack trace)."""
    trace = (fx.meta.get("stack_trace") or "").strip().splitlines()
    lines = [f"{here.strip()}: `{code.strip()}`" for here, code in zip(trace, trace[1:])
             if here.strip().startswith("File ") and "/torch/" not in here and "/kiln/" not in here]
    return lines[-1] if lines else "source line unknown"


class _FromValues:
    """A Python number the forward read from tensor values (`.item()` and arithmetic on it)."""

    def __init__(self, fx):
        self.fx = fx


def _to_kiln(ep, model, slots: list[int], names: list[str]) -> tuple[Graph, dict]:
    g = Graph()
    sig = ep.graph_signature
    env: dict[str, Any] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    leaf_index = 0
    for fx, spec in zip(placeholders, sig.input_specs):
        meta = _meta(fx.meta.get("val"))
        target = (spec.target or "").removeprefix("model.")
        if spec.kind is InputKind.PARAMETER:
            role = Role.PARAM if named[target].requires_grad else Role.FROZEN
            env[fx.name] = g.add_input(target.replace(".", "_"), meta, role, target)
        elif spec.kind is InputKind.BUFFER:
            env[fx.name] = g.add_input(target.replace(".", "_"), meta, Role.BUFFER, target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            constants[fx.name] = ep.constants[spec.target]
            env[fx.name] = g.add_input(fx.name, meta, Role.CONSTANT, fx.name)
        elif spec.kind is InputKind.USER_INPUT:
            leaf = slots[leaf_index]            # LossModule takes the tensors of the flattened call
            env[fx.name] = g.add_input(names[leaf], meta, Role.INPUT, str(leaf))
            leaf_index += 1
        else:
            raise UnsupportedError(f"unsupported graph input kind {spec.kind} ({spec.target})")

    guarded, consumed, unguardable = branches.decisions(ep.graph, lambda fx: f"in {_scope(fx) or type(model).__name__}, "
                                                                f"{_user_line(fx)}")
    for fx in ep.graph.nodes:
        if fx in guarded:
            reads = [env[r.name] for r in guarded[fx][0].reads]
            node = Node(BRANCH_GUARD, branch_guard, (reads, tuple(guarded[fx]), guarded[fx][0].line), {}, [],
                        Phase.FORWARD, _scope(fx))
            g.nodes.append(node)
            continue
        if fx.op != "call_function" or fx.target in _DROP or fx in consumed:
            continue
        if fx.target is operator.getitem:
            src, i = fx.args
            env[fx.name] = env[src.name][i]
            continue
        vals = fx.meta.get("val")
        if isinstance(vals, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if symbolic.unbacked(vals):     # a Python number read from tensor values: refused where an op uses it
                env[fx.name] = _FromValues(fx)
            else:                           # a size computed from input sizes: an expression in the program
                env[fx.name] = symbolic.concrete(vals)
            continue
        if not isinstance(fx.target, torch._ops.OpOverload):
            raise UnsupportedError(f"captured a call to {fx.target} (in {_scope(fx) or '<top>'}); Kiln handles "
                                   "ATen ops only (data-dependent Python on tensor values is not supported)")
        a, kw = pytree.tree_map(lambda x: env[x.name] if hasattr(x, "op") and hasattr(x, "name") else x,
                                (fx.args, fx.kwargs))
        vlist = list(vals) if isinstance(vals, (tuple, list)) else [vals]
        if any(isinstance(v, torch.Tensor) and not _static(v) for v in vlist):
            if type(model).__name__.endswith("ForCTC"):
                raise UnsupportedError(f"{CTC_HINT[0].upper()}{CTC_HINT[1:]}; here {registry.lookup(fx.target).name} "
                                       f"(in {_scope(fx) or type(model).__name__}) gives a tensor whose shape "
                                       f"depends on the labels ({_user_line(fx)})")
            raise UnsupportedError(
                f"{registry.lookup(fx.target).name} (in {_scope(fx) or '<top>'}) gives a tensor whose shape depends on "
                f"tensor values ({_user_line(fx)}): boolean-mask indexing `x[mask]`, nonzero, masked_select, unique "
                "and the like. Kiln compiles static shapes: keep the shape fixed (torch.where(mask, x, 0), gather "
                "with a fixed count, or a mask multiplied in), or compute that part in a loss_fn outside the model")
        number = next((x for x in pytree.tree_leaves((a, kw)) if isinstance(x, _FromValues)), None)
        if number is not None:
            raise UnsupportedError(
                f"{registry.lookup(fx.target).name} (in {_scope(fx) or '<top>'}) takes a Python number computed from "
                f"tensor values ({_user_line(number.fx)}); Kiln compiles the step for every batch's values: keep it "
                "a tensor (`x * t` rather than `x * t.item()`), or compute it outside the model")
        outs_meta = [_meta(v) for v in vlist]
        op = registry.lookup(fx.target)
        outs = [Value(g.fresh_name(fx.name), m) for m in outs_meta]
        node = Node(op, fx.target, tuple(a), dict(kw), outs, Phase.FORWARD, _scope(fx),
                    full_precision=modes.full_precision(fx))
        for v in outs:
            v.producer = node
        g.nodes.append(node)
        env[fx.name] = outs if isinstance(vals, (tuple, list)) else outs[0]

    if unguardable:
        raise unguardable[0]
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    results = out_node.args[0]
    loss = None
    for spec, res in zip(sig.output_specs, results):
        if spec.kind is OutputKind.BUFFER_MUTATION:
            buf = next(v for v in g.inputs if v.role is Role.BUFFER and v.source == spec.target.removeprefix("model."))
            g.mutations.append((buf, env[res.name]))
        elif spec.kind is OutputKind.USER_OUTPUT:
            loss = env[res.name]
        else:
            raise UnsupportedError(f"the forward mutates {spec.target} ({spec.kind.name}); "
                                   "Kiln supports in-place updates of buffers only")
    g.outputs = [loss]
    return g, constants
