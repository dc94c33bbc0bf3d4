"""The adopt DSL: one line per layer call or tensor op, nested calls flattened into temporaries.

The same text form serves two purposes:

* *structures*: what `kiln adopt --show-dsl` prints for each method / function of a model file;
* *rules*: a pattern (lines with `$variables`) plus a replacement, in `kiln/adopt/rules/*.kiln`
  or a user's `--rules FILE.kiln`.

The grammar is documented with examples in docs/adopt-dsl.md.  Parsing is LALR (lark), so every
grammar error names the file, line and column of the first token that does not fit.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from lark import Lark, Transformer, v_args
from lark.exceptions import UnexpectedInput, VisitError

from kiln.errors import KilnError

GRAMMAR = r"""
start: (rule | structure)*

rule: "rule" NAME "{" rule_item* "}"
?rule_item: doc | vars | variant
doc: "doc" STRING
vars: "vars" var_decl ("," var_decl)*
var_decl: PVAR ":" NAME
variant: pattern replace
pattern: "pattern" "{" line+ "}"
replace: "replace" "{" line+ "}"

structure: "def" NAME "(" [NAME ("," NAME)*] ")" block
block: "{" (line | nested)* "}"
nested: NAME block

line: call [ARROW target]                   -> call_line
    | operand BINOP operand ARROW target    -> binop_line
    | operand ARROW target                  -> copy_line
    | "return" [operand]                   -> return_line

call: callee "(" [arg ("," arg)* [","]] ")"
callee: (NAME | OPAQUE) ["<" operand ">"]  -> named_callee
      | "." BARE                           -> method_callee
?arg: operand
    | NAME "=" operand                     -> kwarg
?target: PVAR | TEMP | NAME

?operand: atom
        | operand "." BARE                 -> attr
        | operand "[" INDEX "]"            -> item
?atom: PVAR -> pvar
     | TEMP -> temp
     | NAME -> name
     | NUMBER -> number
     | STRING -> string
     | OPAQUE -> opaque
     | "(" ")" -> tuple
     | "(" operand "," [operand ("," operand)* [","]] ")" -> tuple

ARROW.2: "->"
BINOP: "**" | "*" | "//" | "/" | "+" | "-" | "@" | "%"
NAME: /[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[0-9]+)?/
BARE: /[A-Za-z_][A-Za-z0-9_]*/
PVAR: /\$[A-Za-z_][A-Za-z0-9_]*/
TEMP: /%[0-9]+/
NUMBER: /-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?/
STRING: /"([^"\\\n]|\\.)*"/ | /'([^'\\\n]|\\.)*'/
OPAQUE: /`[^`\n]*`/
INDEX: /(?<=\[)([^\[\]\n]|\[[^\[\]\n]*\])+(?=\])/

COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""


class DSLError(KilnError):
    """A rule or structure text that does not parse or does not make sense; names file:line:col."""


# ----------------------------------------------------------------------------------------------
# Operands: what a node reads.  Frozen so they can be compared and hashed; `cst` links an operand
# built by the analysis back to the source expression it came from (not part of equality).

@dataclass(frozen=True)
class Var:
    """A value: a parameter or variable version (`x`, `x:1`), a temporary (`%3`) or, in rules, `$x`."""
    name: str

    @property
    def is_pattern(self) -> bool:
        return self.name.startswith("$")

    @property
    def is_temp(self) -> bool:
        return self.name.startswith("%")

    @property
    def python_name(self) -> str:
        """The Python variable this value lives in (`x:1` -> `x`)."""
        return self.name.split(":")[0]


@dataclass(frozen=True)
class Const:
    """A literal number, string, bool or None."""
    value: object


@dataclass(frozen=True)
class Ref:
    """A module-level name resolved to its qualified name (`torch.float32`, `math.pi`)."""
    name: str


@dataclass(frozen=True)
class Attr:
    """`base.name` on a value (`self.weight`, `x.dtype`)."""
    base: object
    name: str


@dataclass(frozen=True)
class Item:
    """`base[index]`; the index is kept as source text (`reads`: the values it reads)."""
    base: object
    index: str
    reads: tuple = ()


@dataclass(frozen=True)
class Tuple:
    items: tuple


@dataclass(frozen=True)
class Opaque:
    """An expression the DSL does not model (comparison, lambda, f-string ...), kept as source.

    `reads` lists the value names it reads, so two opaque operands with the same text over
    different variable versions are not equal."""
    code: str
    reads: tuple = ()


@dataclass(eq=False)
class Node:
    """One DSL line: `op(args, kw=...) -> out`.

    `op` is canonical: tensor ops by short name (`tanh`, `mean`, `to`), Python operators by
    symbol (`*`, `**`, `@`, `neg`), module calls by the module's qualified class name with the
    attribute in `module` (`torch.nn.Linear<self.fc>`), other functions by qualified name,
    unknown methods as `.name` with the receiver first.  `=` copies a value and `return` returns.
    """
    op: str
    args: tuple = ()
    kwargs: tuple = ()            # ((name, operand), ...) in source order
    out: Var | None = None
    module: object = None         # the called object for module calls and `call`
    line: int = 0                 # 1-based line in the source (rules: in the rule file)
    cst: object = None            # the libcst expression this node computes (analysis only)
    stmt: object = None           # the analysis Stmt this node belongs to

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)


@dataclass
class Variant:
    pattern: list[Node]
    replace: list[Node]
    line: int


@dataclass
class Rule:
    """A named rewrite: alternatives (pattern -> replacement), tried in order."""
    name: str
    doc: str = ""
    var_types: dict = field(default_factory=dict)   # $name -> "tensor" | "number" | "any"
    variants: list[Variant] = field(default_factory=list)
    source: str = "<string>"
    line: int = 0


@dataclass
class Structure:
    """A parsed `def Owner.method(params) { ... }` block; nested blocks are (keyword, [items])."""
    name: str
    params: list[str]
    items: list


VAR_TYPES = ("tensor", "number", "any")


# ----------------------------------------------------------------------------------------------
# Text -> objects

class _KwArg(tuple):
    """(name, operand) for a keyword argument while building a call."""


@v_args(inline=True)
class _Build(Transformer):
    def pvar(self, tok):
        return Var(str(tok))

    def temp(self, tok):
        return Var(str(tok))

    def name(self, tok):
        text = str(tok)
        if text in ("True", "False", "None"):
            return Const({"True": True, "False": False, "None": None}[text])
        if ":" in text or "." not in text:
            return Var(text)
        return Ref(text)

    def number(self, tok):
        return Const(ast.literal_eval(str(tok)))

    def string(self, tok):
        return Const(ast.literal_eval(str(tok)))

    def opaque(self, tok):
        return Opaque(str(tok)[1:-1])

    def tuple(self, *items):
        return Tuple(tuple(i for i in items if i is not None))

    def attr(self, base, tok):
        return Attr(base, str(tok))

    def item(self, base, tok):
        return Item(base, str(tok).strip())

    def kwarg(self, key, value):
        return _KwArg((str(key), value))

    def named_callee(self, tok, module=None):
        name = str(tok)[1:-1] if tok.type == "OPAQUE" else str(tok)    # `...relative.name`
        return (name, module, tok.line)

    def method_callee(self, tok):
        return ("." + str(tok), None, tok.line)

    def call(self, callee, *args):
        op, module, line = callee
        pos = tuple(a for a in args if a is not None and not isinstance(a, _KwArg))
        kws = tuple(tuple(a) for a in args if isinstance(a, _KwArg))
        return Node(op, pos, kws, module=module, line=line)

    def call_line(self, node, arrow=None, target=None):
        node.out = _target(target)
        return node

    def binop_line(self, left, op, right, arrow, target):
        return Node(str(op), (left, right), out=_target(target), line=op.line)

    def copy_line(self, value, arrow, target):
        return Node("=", (value,), out=_target(target), line=_line(target))

    def return_line(self, value=None):
        return Node("return", () if value is None else (value,))

    def var_decl(self, tok, kind):
        if str(kind) not in VAR_TYPES:
            raise DSLError(f"{kind.line}:{kind.column}: unknown variable type {str(kind)!r} "
                           f"(expected one of: {', '.join(VAR_TYPES)})")
        return (str(tok), str(kind))

    def vars(self, *decls):
        return ("vars", dict(decls))

    def doc(self, tok):
        return ("doc", ast.literal_eval(str(tok)))

    def pattern(self, *lines):
        return list(lines)

    def replace(self, *lines):
        return list(lines)

    def nested(self, tok, block):
        return (str(tok), block)

    def block(self, *items):
        return list(items)

    def structure(self, name, *rest):
        params = [str(p) for p in rest[:-1] if p is not None]
        return Structure(str(name), params, rest[-1])

    def rule(self, name, *items):
        rule = Rule(str(name), line=name.line)
        for kind, value in items:
            if kind == "doc":
                rule.doc = value
            elif kind == "vars":
                rule.var_types.update(value)
            else:
                rule.variants.append(value)
        return rule

    def start(self, *items):
        return list(items)

    @v_args(meta=True)
    def variant(self, meta, children):
        pattern, replace = children
        return ("variant", Variant(pattern, replace, meta.line))


def _target(tok):
    return None if tok is None else Var(str(tok))


def _line(tok) -> int:
    return getattr(tok, "line", 0) or 0


# cache=True: the LALR tables are stored once (in the temp dir, keyed by the grammar) and loaded after,
# which keeps `kiln adopt --list-rules` and every start short
_PARSER = Lark(GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True, cache=True)


def _parse(text: str, filename: str) -> list:
    try:
        tree = _PARSER.parse(text)
    except UnexpectedInput as exc:
        raise DSLError(_describe(exc, text, filename)) from None
    try:
        return _Build().transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, DSLError):
            raise DSLError(f"{filename}:{exc.orig_exc}") from None
        raise


def _describe(exc: UnexpectedInput, text: str, filename: str) -> str:
    line, col = exc.line, exc.column
    lines = text.splitlines()
    token = getattr(exc, "token", None)
    if token is not None and token.type == "$END":
        what = "unexpected end of file"
        line, col = len(lines), len(lines[-1]) + 1 if lines else 1
    elif token is not None:
        what = f"unexpected {str(token)!r}"
    else:
        what = f"unexpected character {getattr(exc, 'char', '?')!r}"
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    expected = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or [])
    hint = f" (expected one of: {', '.join(expected[:10])})" if expected else ""
    return f"{filename}:{line}:{col}: {what}{hint}\n    {src}\n    {' ' * max(col - 1, 0)}^"


def parse(text: str, filename: str = "<string>") -> list:
    """Parse DSL text into a list of `Rule` and `Structure` objects (no validation of meaning)."""
    return _parse(text, filename)


# ----------------------------------------------------------------------------------------------
# Objects -> text

def operand_names(node: "Node", on_var=None) -> list[str]:
    """Names of the variables a node reads, in order (inside attributes, subscripts, tuples and `$x`
    references in opaque code); `on_var(var)` is called on each Var operand (rules validate them)."""
    names: list[str] = []

    def visit(op):
        if isinstance(op, Var):
            if on_var is not None:
                on_var(op)
            names.append(op.name)
        elif isinstance(op, (Attr, Item)):
            visit(op.base)
        elif isinstance(op, Tuple):
            for i in op.items:
                visit(i)
        elif isinstance(op, Opaque):
            names.extend(re.findall(r"\$[A-Za-z_][A-Za-z0-9_]*", op.code))

    for op in list(node.args) + [v for _, v in node.kwargs] + ([node.module] if node.module else []):
        visit(op)
    return names


def format_operand(op) -> str:
    if isinstance(op, Var):
        return op.name
    if isinstance(op, Const):
        return repr(op.value) if not isinstance(op.value, str) else '"' + op.value.replace('"', '\\"') + '"'
    if isinstance(op, Ref):
        return f"`{op.name}`" if op.name.startswith(".") else op.name    # relative import
    if isinstance(op, Attr):
        return f"{format_operand(op.base)}.{op.name}"
    if isinstance(op, Item):
        return f"{format_operand(op.base)}[{' '.join(op.index.split()) or ':'}]"
    if isinstance(op, Tuple):
        inner = ", ".join(format_operand(i) for i in op.items)
        return f"({inner},)" if len(op.items) == 1 else f"({inner})"
    if isinstance(op, Opaque):
        return "`" + " ".join(op.code.replace("`", "'").split()) + "`"
    raise TypeError(f"not a DSL operand: {op!r}")


def format_node(node: Node) -> str:
    out = f" -> {node.out.name}" if node.out is not None else ""
    args = [format_operand(a) for a in node.args]
    if node.op == "return":
        return "return" + (f" {args[0]}" if args else "")
    if node.op == "=":
        return f"{args[0]}{out}"
    if node.op in BINARY_OPS and len(args) == 2 and not node.kwargs:
        return f"{args[0]} {node.op} {args[1]}{out}"
    args += [f"{k}={format_operand(v)}" for k, v in node.kwargs]
    op = node.op
    if op.startswith(".") and (op.startswith("..") or "." in op[1:]):   # relative import, not a method
        op = f"`{op}`"
    callee = op + (f"<{format_operand(node.module)}>" if node.module is not None else "")
    return f"{callee}({', '.join(args)}){out}"


def format_structure(name: str, params: list[str], items: list, indent: str = "  ") -> str:
    """`def name(params) { ... }` with one node per line; nested blocks are (keyword, items)."""
    lines = [f"def {name}({', '.join(params)}) {{"]

    def emit(entries, depth):
        for entry in entries:
            if isinstance(entry, Node):
                lines.append(indent * depth + format_node(entry))
            else:
                keyword, inner = (entry.keyword, entry.items) if hasattr(entry, "keyword") else entry
                lines.append(indent * depth + keyword + " {")
                emit(inner, depth + 1)
                lines.append(indent * depth + "}")

    emit(items, 1)
    lines.append("}")
    return "\n".join(lines)


BINARY_OPS = ("**", "*", "/", "+", "-", "@", "//", "%")
