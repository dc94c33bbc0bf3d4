"""Loading rules: built-in `rules/*.kiln` files and user rule files, checked and compiled.

A rule's pattern lines are canonicalized like source (`torch.tanh($x)` and `.tanh($x)` are
`tanh($x)`), inlined into one tree and normalized, so the matcher compares meaning.  Problems a
parser cannot see (a replacement using an unbound variable, a pattern whose last line is not its
result, a rule name used twice) are reported with file and line too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.adopt import canon
from kiln.adopt.dsl import BINARY_OPS, DSLError, Node, Ref, Rule, Structure, Variant, operand_names, parse
from kiln.adopt.expr import Expr, TreeBuilder, normalize
from kiln.adopt.match import match

RULES_DIR = Path(__file__).with_name("rules")

# The rules written in Python (attention.py, detect.py): name -> the line `--list-rules` shows.
# Kept here so that listing them does not import libcst; the rule objects take their doc from it.
PYTHON_RULES = {
    "sdpa": "softmax(q @ k^T * scale + mask) @ v -> F.scaled_dot_product_attention (casts, masked_fill "
            "and causal buffers, any k^T spelling)",
    "swiglu": "down(silu(gate(x)) * up(x)) -> down(kiln.kernels.swiglu(gate(x), up(x)))",
    "linear_gelu": "gelu(fc(x)) -> kiln.kernels.linear_act(x, fc, act): fused when fc is a plain nn.Linear",
    "rope": "q * cos + rotate_half(q) * sin; k ... -> kiln.kernels.rope(q, k, cos, sin)",
    "dropout_add_layernorm": "LayerNorm(Dropout(h) + residual) (report only)",
    "fused_qkv": "three nn.Linear of one input and equal in_features (report only)",
    "linear_cross_entropy": "cross-entropy of lm_head(h) logits (report only)",
    "cross_entropy": "CrossEntropyLoss()(logits, labels), F.cross_entropy -> kiln.kernels.cross_entropy_of / "
                     "cross_entropy: one pass over the logits each way",
}


@dataclass
class CompiledVariant:
    variant: Variant
    tree: Expr                 # normalized pattern tree
    free: frozenset            # the $variables the pattern binds


@dataclass
class CompiledRule:
    rule: Rule
    variants: list[CompiledVariant]

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def doc(self) -> str:
        return self.rule.doc


def _structural() -> dict:
    from kiln.adopt.detect import DETECTIONS
    from kiln.adopt.attention import SDPA_RULE
    return {r.name: r for r in [SDPA_RULE, *DETECTIONS]}


def builtin_names() -> list[str]:
    return sorted([p.stem for p in RULES_DIR.glob("*.kiln")] + list(PYTHON_RULES))


def builtin_docs() -> list[tuple[str, str]]:
    """(name, doc) of every built-in rule, without loading the Python rules (libcst)."""
    docs = dict(PYTHON_RULES)
    for path in RULES_DIR.glob("*.kiln"):
        docs.update((r.name, r.doc) for r in parse(path.read_text(), str(path)) if isinstance(r, Rule))
    return sorted(docs.items())


def load_builtin(names: list[str] | None = None) -> list:
    """The built-in rules, all or the named ones (unknown names raise DSLError).

    Most are DSL rules (`rules/*.kiln`, CompiledRule); those the DSL cannot state are Python
    (`structural.StructuralRule`: sdpa and the detections of `detect.py`)."""
    available = builtin_names()
    unknown = [n for n in names or [] if n not in available]
    if unknown:
        raise DSLError(f"unknown rule {', '.join(map(repr, unknown))} (built-in: {', '.join(available)})")
    rules, structural = [], _structural()
    for name in names or available:
        if name in structural:
            rules.append(structural[name])
            continue
        path = RULES_DIR / f"{name}.kiln"
        rules += load_text(path.read_text(), str(path))
    return rules


def load_file(path: str | Path) -> list[CompiledRule]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise DSLError(f"{path}: cannot read rule file: {exc.strerror or exc}") from None
    return load_text(text, str(path))


def load_text(text: str, filename: str = "<string>") -> list[CompiledRule]:
    """Parse and compile rule text; structures (`def ...`) are not allowed in rule files."""
    rules, seen = [], set()
    for item in parse(text, filename):
        if isinstance(item, Structure):
            raise DSLError(f"{filename}: `def {item.name}` is a structure, not a rule")
        if item.name in seen:
            raise DSLError(f"{filename}:{item.line}: rule {item.name!r} is defined twice")
        seen.add(item.name)
        item.source = filename
        rules.append(compile_rule(item, filename))
    return rules


def compile_rule(rule: Rule, filename: str) -> CompiledRule:
    if not rule.variants:
        raise DSLError(f"{filename}:{rule.line}: rule {rule.name!r} has no pattern")
    where = f"{filename}:{rule.line}: rule {rule.name!r}"
    compiled = []
    for variant in rule.variants:
        variant.pattern = [canonical_node(n) for n in variant.pattern]
        root, free = _check_lines(variant.pattern, None, f"{where}, pattern at line {variant.line}")
        _check_lines(variant.replace, free, f"{where}, replacement at line {variant.line}")
        for node in variant.replace:
            if not (node.op in BINARY_OPS or node.op in ("neg", "=") or node.op.startswith(".")
                    or "." in node.op or node.module is not None):
                raise DSLError(f"{where}, line {node.line}: {node.op!r}: a replacement calls functions by "
                               f"qualified name (torch.nn.functional.gelu), methods as .name, or operators")
        defined = {n.out.name for n in variant.pattern if n.out is not None}
        builder = TreeBuilder(variant.pattern, inline=lambda name: True, pattern_vars=free)
        builder.defs = {k: v for k, v in builder.defs.items() if k in defined}
        tree = normalize(builder.value(root))
        compiled.append(CompiledVariant(variant, tree, frozenset(free)))
    for cv in compiled:     # a replacement its own rule matches again would break idempotence
        if _matches_own_replacement(rule, cv, compiled):
            raise DSLError(f"{where}, replacement at line {cv.variant.line}: the rule matches its own "
                           f"replacement, so a second run would rewrite again")
    unused = [v for v in rule.var_types if not any(v in c.free for c in compiled)]
    if unused:
        raise DSLError(f"{where}: `vars` declares {', '.join(unused)}, which no pattern uses")
    return CompiledRule(rule, compiled)


def _matches_own_replacement(rule: Rule, cv: CompiledVariant, compiled: list[CompiledVariant]) -> bool:
    lines = [canonical_node(n) for n in cv.variant.replace]
    builder = TreeBuilder(lines, inline=lambda name: True, pattern_vars=cv.free)
    result = normalize(builder.node(lines[-1]))
    return any(next(match(other.tree, result, rule.var_types), None) is not None for other in compiled)


def canonical_node(node: Node) -> Node:
    """A rule line with its op canonicalized the way the analysis canonicalizes source calls."""
    if node.op in ("=", "return") or node.module is not None:
        return node
    qualname = node.op
    if node.op.startswith("."):
        qualname = "Tensor" + node.op
    elif node.op in canon.SIGNATURES or node.op == "to":
        qualname = "Tensor." + _method_for(node.op)
    result = canon.canonical_call(qualname, list(node.args), list(node.kwargs), Ref)
    if result is None:
        return node
    op, args, kwargs = result
    return Node(op, tuple(args), tuple(kwargs), out=node.out, line=node.line)


def _method_for(op: str) -> str:
    for alias, target in canon.CANONICAL.items():
        if target == op and alias.startswith("Tensor."):
            return alias[len("Tensor."):]
    return op


def _check_lines(lines: list[Node], bound: set | None, where: str):
    """Check def-before-use; returns (name of the last line's output, free $variables).

    `bound` is None for a pattern (its unknown variables are free) and the pattern's free
    variables for a replacement (which may use nothing else)."""
    replacing = bound is not None
    bound = set(bound or ())
    free, defined, used = set(bound), set(), set()
    for node in lines:
        for name in _operand_vars(node, where):
            if name in defined or name in bound:
                used.add(name)
            elif replacing:
                raise DSLError(f"{where}, line {node.line}: {name} is not bound by the pattern")
            else:
                free.add(name)
        if node.op == "return":
            raise DSLError(f"{where}, line {node.line}: `return` is not allowed in rules")
        if node.out is not None:
            if node.out.name in defined or node.out.name in free:
                raise DSLError(f"{where}, line {node.line}: {node.out.name} is assigned twice")
            defined.add(node.out.name)
    last = lines[-1]
    if last.out is None and not replacing:
        raise DSLError(f"{where}, line {last.line}: the last pattern line needs `-> $result`")
    unused = [n.out.name for n in lines[:-1] if n.out is not None and n.out.name not in used]
    if unused:
        raise DSLError(f"{where}: {', '.join(unused)} is computed but never used")
    return (last.out.name if last.out is not None else None), free


def _operand_vars(node: Node, where: str) -> list[str]:
    def check(var):
        if not var.is_pattern:
            raise DSLError(f"{where}, line {node.line}: {var.name!r}: rule variables start with `$`")
    return operand_names(node, check)
