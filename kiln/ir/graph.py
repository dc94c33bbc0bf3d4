"""Kiln's training graph: typed values, nodes in program order, and the graph that owns them.

A `Graph` is a straight-line program. Every `Value` is produced by exactly one `Node` (or is a graph
input), nodes are kept in a valid execution order, and every node carries typed facts that the passes
read: its op (an `OpDef` from the registry), which phase it belongs to, which module it came from,
and, once dispatch has run, which dialect implementation will execute it.
"""
from __future__ import annotations

import enum
import keyword
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from kiln.ir import symbolic

if TYPE_CHECKING:  # pragma: no cover
    from kiln.dialects.registry import Impl
    from kiln.ops.registry import OpDef


@dataclass(frozen=True, eq=False)
class TensorMeta:
    """Static facts about a tensor value: what shape inference and the printer need. Sizes and strides are
    ints, or `torch.SymInt`s in a program compiled for dynamic shapes (kiln/ir/symbolic.py)."""

    shape: tuple
    dtype: torch.dtype
    stride: tuple
    device: torch.device

    def __post_init__(self):
        # a SymInt whose value is known (a size a guard fixed) is that int: metas never hold constant SymInts
        for name in ("shape", "stride"):
            sizes = getattr(self, name)
            if any(isinstance(s, torch.SymInt) for s in sizes):
                object.__setattr__(self, name, tuple(symbolic.concrete(s) for s in sizes))

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(symbolic.concrete(s) if isinstance(s, torch.SymInt) else int(s) for s in t.shape), t.dtype,
                   tuple(symbolic.concrete(s) if isinstance(s, torch.SymInt) else int(s) for s in t.stride()),
                   t.device)

    @property
    def symbolic(self) -> bool:
        """Whether a size or stride is symbolic (varies from batch to batch)."""
        return symbolic.any_symbolic(self.shape) or symbolic.any_symbolic(self.stride)

    def as_meta_tensor(self) -> torch.Tensor:
        """An empty tensor with these facts, for shape inference: on the meta device, or for symbolic
        sizes a fake tensor of the program's ShapeEnv (`symbolic.fake_mode`)."""
        if self.symbolic:
            env = symbolic.shape_env((self.shape, self.stride))
            with symbolic.fake_mode(env):
                return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def contiguous(self) -> "TensorMeta":
        """The same tensor in the row-major (contiguous) layout."""
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc = acc * size if not isinstance(size, int) or size != 0 else acc
        return TensorMeta(self.shape, self.dtype, tuple(reversed(strides)), self.device)

    @property
    def numel(self):
        """The number of elements (a SymInt for symbolic shapes: `symbolic.hint` gives a number)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize

    def __eq__(self, other) -> bool:      # structural: compares size expressions, records no guard
        return isinstance(other, TensorMeta) and self.dtype == other.dtype and self.device == other.device and \
            symbolic.same(self.shape, other.shape) and symbolic.same(self.stride, other.stride)

    def __hash__(self) -> int:
        return hash((symbolic.key(self.shape), self.dtype, symbolic.key(self.stride), self.device))

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


class Role(enum.Enum):
    """What a graph input is, so the runtime knows where to fetch it from."""

    PARAM = "param"          # trainable parameter: gets a gradient and an update
    FROZEN = "frozen"        # parameter with requires_grad=False: read only
    BUFFER = "buffer"        # module buffer (may be mutated, e.g. BatchNorm running stats)
    CONSTANT = "constant"    # tensor constant lifted by capture
    INPUT = "input"          # a tensor the user passes to step(...)
    STATE = "state"          # optimizer state (exp_avg, momentum buffer, step count, ...)
    SCALAR = "scalar"        # a Python number read at call time (an optimizer hyper-parameter: lr, betas, ...)


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


_ids = itertools.count()
_RESERVED = {"torch", "float", "const"}  # names the generated code uses


@dataclass(eq=False)
class Value:
    """One SSA value. `meta` is None for non-tensor values (opaque objects such as a fallback's
    saved VJP closure)."""

    name: str
    meta: TensorMeta | None
    producer: "Node | None" = None
    role: Role | None = None          # set for graph inputs only
    source: str | None = None         # graph inputs: parameter/buffer FQN, input name, state key
    uid: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"%{self.name}"

    @property
    def is_tensor(self) -> bool:
        return self.meta is not None

    @property
    def is_float(self) -> bool:
        return self.meta is not None and self.meta.dtype.is_floating_point


def tree_values(obj: Any) -> Iterator[Value]:
    """Every Value inside a (possibly nested) list/tuple/dict argument structure."""
    if isinstance(obj, Value):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tree_values(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tree_values(x)


def tree_map_values(fn: Callable[[Value], Any], obj: Any) -> Any:
    if isinstance(obj, Value):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map_values(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: tree_map_values(fn, x) for k, x in obj.items()}
    return obj


def depends_on(v: Value, roles: set) -> bool:
    """Whether v is computed from a graph input with one of `roles` (e.g. a trainable parameter)."""
    seen, stack = set(), [v]
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        if x.role in roles:
            return True
        if x.producer is not None:
            stack.extend(x.producer.inputs)
    return False


@dataclass(frozen=True)
class Fused:
    """What a fused node replaced: the fusion ("dialect:name") and the ops it covered, in order."""

    fusion: str
    ops: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.fusion} [{', '.join(self.ops)}]"


@dataclass(eq=False)
class Node:
    """One op application. `args`/`kwargs` hold Values and Python constants (nested lists allowed)."""

    op: "OpDef"                      # every fact about the op
    target: Any                      # the exact overload that runs (aten.add.Tensor, ...)
    args: tuple
    kwargs: dict
    outputs: list[Value]
    phase: Phase
    scope: str = ""                  # module path it came from, e.g. "model.layers.0.self_attn"
    impl: "Impl | None" = None       # chosen by the dispatch pass
    fused: "Fused | None" = None     # set by the fuse pass on the op(s) that replaced a subgraph
    full_precision: bool = False     # the model runs it under torch.autocast(enabled=False): amp keeps fp32
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def inputs(self) -> list[Value]:
        return list(tree_values((self.args, self.kwargs)))

    @property
    def out(self) -> Value:
        assert len(self.outputs) == 1, f"{self.op.name} has {len(self.outputs)} outputs"
        return self.outputs[0]

    def __repr__(self) -> str:
        return f"Node({self.op.name}, outputs={self.outputs})"


class Graph:
    """The whole training step: inputs, nodes in execution order, the loss, and the effects.

    `mutations` are (graph input, new value) pairs: after the step, the input's storage is updated
    with the new value (BatchNorm running statistics). Ops with side effects (the optimizer's in-place
    updates) are ordinary nodes whose OpDef says so.
    """

    def __init__(self) -> None:
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []          # outputs[0] is the loss
        self.mutations: list[tuple[Value, Value]] = []
        self._names: dict[str, int] = {}     # base name -> last suffix tried
        self._used: set[str] = set()

    # ---- naming -------------------------------------------------------------------------
    def fresh_name(self, hint: str) -> str:
        base = "".join(c if (c.isalnum() or c == "_") else "_" for c in hint) or "t"
        if base[0].isdigit() or keyword.iskeyword(base) or base in _RESERVED:
            base = "t" + base
        name, n = base, self._names.get(base, 0)
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._names[base] = n
        self._used.add(name)
        return name

    # ---- building -----------------------------------------------------------------------
    def add_input(self, hint: str, meta: TensorMeta | None, role: Role, source: str | None = None) -> Value:
        v = Value(self.fresh_name(hint), meta, None, role, source)
        self.inputs.append(v)
        return v

    def inputs_with(self, role: Role) -> list[Value]:
        return [v for v in self.inputs if v.role is role]

    # ---- queries ------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        out: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v, []).append(n)
        return out

    def live_outputs(self) -> set[Value]:
        """Values the step must produce: its outputs and the new values of mutated inputs."""
        return set(self.outputs) | {new for _, new in self.mutations}

    def replace_uses(self, old: Value, new: Value, start: int = 0) -> None:
        swap = lambda v: new if v is old else v  # noqa: E731
        for n in self.nodes[start:]:
            n.args = tree_map_values(swap, n.args)
            n.kwargs = tree_map_values(swap, n.kwargs)
        self.outputs = [swap(v) for v in self.outputs]
        self.mutations = [(t, swap(v)) for t, v in self.mutations]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def nodes_in(self, phase: Phase) -> Iterable[Node]:
        return (n for n in self.nodes if n.phase is phase)
