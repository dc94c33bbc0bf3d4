"""Source -> DSL structures: one `Function` per class method and module-level function.

Works on libcst, so every DSL node keeps a link to the expression it computes (`Node.cst`) and the
statement it sits in (`Node.stmt`), which is what synthesis edits.  Names are resolved by meaning
through the module's imports (`F.gelu`, `nn.functional.gelu` and `torch.nn.functional.gelu` are one
function; see `Resolver`); `self.fc(x)` is typed by the constructor call that `__init__` assigns to
`self.fc`; tensor methods (`x.tanh()`) and operators map to canonical ops (see canon.py).

Data flow is SSA-like: each assignment to a Python name makes a new version (`h`, `h:1`, `h:2`),
names assigned in branches or loops get a fresh version after them, and every read is counted, so
a value can be inlined into its reader only when that is its single use in the same block.  A
match therefore never joins two unrelated tensors that happen to share a Python name.
"""
from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from kiln.adopt import canon
from kiln.adopt.dsl import Attr, Const, Item, Node, Opaque, Ref, Tuple, Var, format_structure
from kiln.adopt.scope import Resolver, _assigned_names, _code, _inherited_init, _self_types, _walk

# ops whose result is a new tensor (never a view of an input): `x += y` on one of those, read
# nowhere else, is the same as `x = x + y`
_FRESH = {"@", "+", "-", "*", "/", "softmax", "torch.bmm", ".bmm", "torch.baddbmm", ".baddbmm", "torch.einsum"}

_BINOPS = {cst.Add: "+", cst.Subtract: "-", cst.Multiply: "*", cst.Divide: "/", cst.Power: "**",
           cst.MatrixMultiply: "@", cst.FloorDivide: "//", cst.Modulo: "%", cst.BitAnd: "operator.and_",
           cst.BitOr: "operator.or_", cst.BitXor: "operator.xor", cst.LeftShift: "operator.lshift",
           cst.RightShift: "operator.rshift"}


@dataclass(eq=False)
class Block:
    """A straight-line run of statements (a function body, an `if` branch, a loop body ...)."""
    keyword: str
    items: list = field(default_factory=list)     # Node | Block, in source order


@dataclass(eq=False)
class Stmt:
    """One small statement; `target` is the value a plain `name = expr` defines (deletable)."""
    cst: cst.CSTNode
    line_node: cst.SimpleStatementLine
    block: Block
    line: int
    target: str | None = None
    env: dict = field(default_factory=dict)   # Python name -> value version visible before it


@dataclass(eq=False)
class Phi:
    """A name assigned inside `if test:` (no else): after it, `value` is `inner` or `before`."""
    value: str
    before: str | None          # the version before the `if` (None: unassigned before it)
    inner: str                  # the version at the end of the `if` body
    if_cst: cst.If
    block: Block                # the block holding the `if`
    body: Block                 # the `if` body
    env: dict                   # Python name -> version visible before the `if`


@dataclass(eq=False)
class Function:
    cls: str | None
    name: str
    params: list[str]
    line: int
    body: Block
    cst: cst.FunctionDef
    nodes: list[Node]
    uses: Counter               # value name -> number of reads
    reader_block: dict          # value name -> block of its (last) reader
    defs: dict                  # value name -> Node that defines it
    def_stmt: dict              # value name -> Stmt where it is (re)assigned, phis included
    mutated: dict               # value changed in place (x.add_(...), x[i] = ...) -> lines of the changes
    local_names: set            # Python names local to the function
    name_version: dict          # id(cst.Name) -> value version that Name reads
    phis: dict = field(default_factory=dict)   # value after an `if` without else -> Phi
    init: dict = field(default_factory=dict)   # self attribute -> [expressions __init__ assigns to it]
    resolver: object = None
    merges: dict = field(default_factory=dict)  # value after if/else, with, try -> versions it may hold
    # `x += y` where x was a fresh result read nowhere else: computed as `x = x + y` (not in
    # `mutated`), but its old value was updated in place (sdpa's output must not be)
    updated: set = field(default_factory=set)
    # self attributes written in place (`self.cache_k[:b, s:e] = xk`) -> lines
    attr_stores: dict = field(default_factory=dict)
    # value after `if test: ... else: ...` -> (the `if`, version at the end of the body, at the end of the else)
    branches: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.cls}.{self.name}" if self.cls else self.name

    def inlinable(self, name: str) -> bool:
        """May `name`'s definition be folded into its reader (its single use, same block)?"""
        node = self.defs.get(name)
        if node is None or name in self.mutated:
            return False
        if name.startswith("%"):
            return True
        stmt = node.stmt
        return (self.uses[name] == 1 and stmt is not None and stmt.target == name
                and self.reader_block.get(name) is stmt.block)

    def show(self) -> str:
        return format_structure(self.title, self.params, self.body.items)


@dataclass
class ModuleAnalysis:
    module: cst.Module
    functions: list[Function]
    positions: object            # PositionProvider mapping
    source: str


def analyze(source: str) -> ModuleAnalysis:
    """Parse `source` (raises libcst.ParserSyntaxError) and extract every method and function."""
    module = cst.parse_module(source)
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    resolver = Resolver(module)
    functions = []
    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
    helpers = {(False, s.name.value): s for s in module.body if isinstance(s, cst.FunctionDef)}
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            functions.append(_FunctionAnalyzer(stmt, None, {}, resolver, positions).run())
        elif isinstance(stmt, cst.ClassDef):
            methods = [s for s in stmt.body.body if isinstance(s, cst.FunctionDef)]
            init = _inherited_init(stmt, classes)
            own = {**helpers, **{(True, m.name.value): m for m in methods}}
            types, exprs = _self_types(init, resolver, own) if init is not None else ({}, {})
            for m in methods:
                fn = _FunctionAnalyzer(m, stmt.name.value, types, resolver, positions, exprs).run()
                functions.append(fn)
    return ModuleAnalysis(module, functions, positions, source)


class _FunctionAnalyzer:
    def __init__(self, fn: cst.FunctionDef, cls: str | None, self_types: dict, resolver, positions,
                 init_exprs: dict | None = None):
        self.fn, self.cls, self.self_types = fn, cls, self_types
        self.init_exprs = init_exprs or {}
        self.phis: dict = {}
        self.merges: dict = {}
        self.resolver, self.positions = resolver, positions
        self.env: dict[str, str] = {}
        self.versions: Counter = Counter()
        self.temps = 0
        self.nodes: list[Node] = []
        self.uses: Counter = Counter()
        self.reader_block: dict = {}
        self.defs: dict = {}
        self.def_stmt: dict = {}
        self.mutated: dict = {}
        self.updated: set = set()
        self.attr_stores: dict = {}
        self.branches: dict = {}
        self.block: Block | None = None
        self.stmt: Stmt | None = None
        params = fn.params
        all_params = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
        all_params += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
        self.params = [p.name.value for p in all_params]
        static = any(isinstance(d.decorator, cst.Name) and d.decorator.value == "staticmethod"
                     for d in fn.decorators)
        self.self_name = self.params[0] if cls and self.params and not static else None
        self.local_names = set(self.params) | _assigned_names([fn.body])
        self.name_version: dict[int, str] = {}   # id(cst.Name) -> the value version it reads
        for p in self.params:
            self.env[p] = p

    def run(self) -> Function:
        body = self.fn.body
        block = self.run_block(body, "body")
        self._propagate_mutation()
        return Function(self.cls, self.fn.name.value, self.params, self.line(self.fn), block, self.fn,
                        self.nodes, self.uses, self.reader_block, self.defs, self.def_stmt, self.mutated,
                        self.local_names, self.name_version, self.phis, self.init_exprs, self.resolver,
                        self.merges, self.updated, self.attr_stores, self.branches)

    def _propagate_mutation(self) -> None:
        """`x += y` on the value after an `if` changes the very tensor each branch made (and the one
        a plain `a = b` copied): mark those versions mutated too."""
        stack = list(self.mutated)
        while stack:
            value = stack.pop()
            sources = set(self.merges.get(value, ()))
            phi = self.phis.get(value)
            if phi is not None:
                sources |= {v for v in (phi.before, phi.inner) if v}
            node = self.defs.get(value)
            if node is not None and node.op == "=" and node.args and isinstance(node.args[0], Var):
                sources.add(node.args[0].name)
            for v in sources - set(self.mutated):
                self.mutated[v] = set(self.mutated[value])
                stack.append(v)

    def line(self, node) -> int:
        return self.positions[node].start.line

    # -- values ---------------------------------------------------------------------------------
    def new_version(self, name: str) -> str:
        self.versions[name] += 1
        value = f"{name}:{self.versions[name]}"
        self.env[name] = value
        self.def_stmt[value] = self.stmt
        return value

    def read(self, name: str, node=None) -> str:
        value = self.env.get(name) or self.new_version(name)   # read before any assignment we saw
        if node is not None:
            self.name_version[id(node)] = value
        self.uses[value] += 1
        self.reader_block[value] = self.block
        return value

    def emit(self, op, args, kwargs=(), module=None, expr=None) -> Var:
        self.temps += 1
        out = Var(f"%{self.temps}")
        node = Node(op, tuple(args), tuple(kwargs), out, module, self.line(expr) if expr else 0, expr, self.stmt)
        self.nodes.append(node)
        self.defs[out.name] = node
        self.block.items.append(node)
        return out

    # -- statements -----------------------------------------------------------------------------
    def run_block(self, suite, keyword: str) -> Block:
        outer, self.block = self.block, Block(keyword)
        stmts = suite.body if isinstance(suite, cst.IndentedBlock) else [suite]
        for st in stmts:
            if isinstance(st, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                for small in st.body:
                    self.stmt = Stmt(small, st, self.block, self.line(small), env=dict(self.env))
                    self.small(small)
            else:
                self.stmt = None
                self.compound(st)
        block, self.block = self.block, outer
        if outer is not None:
            outer.items.append(block)
        return block

    def small(self, st):
        if isinstance(st, (cst.Assign, cst.AnnAssign)) and st.value is not None:
            targets = [t.target for t in st.targets] if isinstance(st, cst.Assign) else [st.target]
            value = self.expr(st.value)
            if len(targets) == 1 and isinstance(targets[0], cst.Name) and targets[0].value in self.local_names:
                self.define(targets[0].value, value, st.value)
            else:
                stored = self.defs.pop(self.emit("store", [Opaque(_code(targets), ()), value]).name)
                stored.out, stored.line = None, self.stmt.line     # a store defines no value
                for t in targets:
                    self.store_target(t)
        elif isinstance(st, cst.AugAssign):
            value = self.expr(st.value)
            target = self.expr(st.target)
            if isinstance(st.target, cst.Name) and isinstance(target, Var):
                # `x += y` updates a tensor in place; when x is a fresh product or sum that nothing
                # else has read (no alias can see the change) it computes what `x = x + y` does
                made = self.defs.get(target.name)
                fresh = made is not None and made.op in _FRESH and self.uses[target.name] == 1
                if fresh:
                    self.updated.add(target.name)
                else:
                    self.mark_mutated(target)
                out = self.emit(_aug_op(st.operator), [target, value])
                self.defs[out.name].line = self.stmt.line
                self.rename(out, self.new_version(st.target.value))
                if fresh:               # a plain definition of the new value (a match may fold it)
                    self.stmt.target = self.env[st.target.value]
                else:
                    self.mark_mutated(Var(self.env[st.target.value]))
            else:
                self.opaque_reads(st.target)
        elif isinstance(st, cst.Return):
            args = [] if st.value is None else [self.expr(st.value)]
            node = Node("return", tuple(args), line=self.stmt.line, stmt=self.stmt)
            self.block.items.append(node)
        elif isinstance(st, cst.Expr):
            self.expr(st.value)
        else:                                           # pass, del, raise, assert, import, global ...
            self.opaque_reads(st)
            for name in _assigned_names([st]):
                self.new_version(name)

    def define(self, name: str, value, expr):
        if isinstance(value, Var) and value.is_temp and self.defs[value.name].stmt is self.stmt:
            self.rename(value, None, name)
        else:
            out = self.emit("=", [value], expr=expr)
            self.rename(out, None, name)

    def rename(self, temp: Var, value: str | None, name: str | None = None):
        """Give the node computing `temp` the variable version as its output (`-> h:1`)."""
        node = self.defs.pop(temp.name)
        value = value or self.new_version(name)
        node.out = Var(value)
        self.defs[value] = node
        self.def_stmt[value] = self.stmt
        if name is not None:
            self.stmt.target = value

    def store_target(self, target):
        if isinstance(target, cst.Name):
            self.new_version(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self.store_target(el.value)
        elif isinstance(target, cst.StarredElement):
            self.store_target(target.value)
        elif isinstance(target, cst.Subscript):  # x[i] = ... changes x in place
            self.mark_mutated(self.expr(target.value))
            self.opaque_reads(target.slice)
        else:                                   # self.x = ...: reads, no new value
            self.opaque_reads(target)

    def mark_mutated(self, operand):
        line = self.stmt.line if self.stmt is not None else 0
        attr = None
        while isinstance(operand, (Attr, Item)):
            attr = operand.name if isinstance(operand, Attr) else attr
            operand = operand.base
        if isinstance(operand, Var) and attr is not None and operand.name == self.self_name:
            # `self.cache[:, a:b] = x`: a buffer of the module changes, not the module
            self.attr_stores.setdefault(attr, set()).add(line)
        elif isinstance(operand, Var):
            self.mutated.setdefault(operand.name, set()).add(line)

    def compound(self, st):
        assigned = _assigned_names([st])
        ends = []                               # the environments control can leave the statement with
        if isinstance(st, (cst.For, cst.While)):
            # Loop-carried values: reads in the body may see any iteration's value.
            header = st.iter if isinstance(st, cst.For) else st.test
            self.opaque_reads(header)
            for name in assigned:
                self.new_version(name)
            self.run_block(st.body, "for" if isinstance(st, cst.For) else "while")
            if st.orelse is not None:
                self.run_block(st.orelse.body, "else")
        elif isinstance(st, cst.If):
            self.opaque_reads(st.test)
            before = dict(self.env)
            outer = self.block
            body = self.run_block(st.body, "if")
            if st.orelse is None:
                inner = dict(self.env)
                for name in assigned:
                    value = self.new_version(name)
                    self.phis[value] = Phi(value, before.get(name), inner.get(name, value), st, outer, body, before)
                return
            ends.append(dict(self.env))
            self.env = dict(before)
            if isinstance(st.orelse, cst.If):
                self.compound(st.orelse)
            else:
                self.run_block(st.orelse.body, "else")
            ends.append(dict(self.env))
        elif isinstance(st, cst.With):
            for item in st.items:
                self.opaque_reads(item.item)
            self.run_block(st.body, "with")
            ends.append(dict(self.env))
        elif isinstance(st, cst.Try):
            self.run_block(st.body, "try")
            for handler in st.handlers:
                self.run_block(handler.body, "except")
            for part in (st.orelse, st.finalbody):
                if part is not None:
                    self.run_block(part.body, "else" if part is st.orelse else "finally")
        else:                                   # nested def/class, match, async forms: opaque
            self.opaque_reads(st)
        for name in assigned:                   # after a branch/loop a name may hold either value
            value = self.new_version(name)
            if ends:
                self.merges[value] = {e[name] for e in ends if e.get(name)}
            if isinstance(st, cst.If) and len(ends) == 2:
                self.branches[value] = (st, ends[0].get(name), ends[1].get(name))

    # -- expressions ----------------------------------------------------------------------------
    def expr(self, e):
        if isinstance(e, cst.Name):
            if e.value in ("True", "False", "None"):
                return Const({"True": True, "False": False, "None": None}[e.value])
            if e.value in self.local_names:
                return Var(self.read(e.value, e))
            return Ref(self.resolver.qualname(e) or e.value)
        if isinstance(e, (cst.Integer, cst.Float)):
            return Const(ast.literal_eval(e.value))
        if isinstance(e, cst.SimpleString):
            try:
                return Const(ast.literal_eval(e.value))
            except (ValueError, SyntaxError):
                return self.opaque(e)
        if isinstance(e, cst.Attribute):
            if _root_name(e) in self.local_names or not isinstance(_root(e), cst.Name):
                return Attr(self.expr(e.value), e.attr.value)
            return Ref(self.resolver.qualname(e) or _code(e))
        if isinstance(e, cst.Call):
            return self.call(e)
        if isinstance(e, cst.BinaryOperation) and type(e.operator) in _BINOPS:
            left, right = self.expr(e.left), self.expr(e.right)
            return self.emit(_BINOPS[type(e.operator)], [left, right], expr=e)
        if isinstance(e, cst.UnaryOperation):
            if isinstance(e.operator, cst.Plus):
                return self.expr(e.expression)
            value = self.expr(e.expression)
            if isinstance(e.operator, cst.Minus):
                if isinstance(value, Const) and isinstance(value.value, (int, float)) and not e.lpar:
                    return Const(-value.value)
                return self.emit("neg", [value], expr=e)
            op = "operator.invert" if isinstance(e.operator, cst.BitInvert) else "operator.not_"
            return self.emit(op, [value], expr=e)
        if isinstance(e, (cst.Tuple, cst.List)) and not any(
                isinstance(el, cst.StarredElement) for el in e.elements):
            return Tuple(tuple(self.expr(el.value) for el in e.elements))
        if isinstance(e, cst.Subscript):
            base = self.expr(e.value)
            reads = self.opaque_reads(e.slice)
            return Item(base, "".join(_code(s) for s in e.slice), tuple(sorted(reads)))
        return self.opaque(e)

    def call(self, e: cst.Call):
        func = e.func
        starred = any(a.star for a in e.args)
        module, qualname, receiver = None, None, None
        if isinstance(func, cst.Attribute):
            root = _root(func)
            is_global = isinstance(root, cst.Name) and root.value not in self.local_names
            if is_global:
                qualname = self.resolver.qualname(func) or _code(func)
            elif (self.self_name and isinstance(func.value, cst.Name)
                    and func.value.value == self.self_name):
                module = Attr(Var(self.read(self.self_name, func.value)), func.attr.value)
                qualname = self.self_types.get(func.attr.value, "call")
                ctors = self.init_exprs.get(func.attr.value, [])
                dim = _softmax_dim(ctors[0]) if qualname == "torch.nn.Softmax" and len(ctors) == 1 else None
                if dim is not None and len(e.args) == 1 and e.args[0].keyword is None:
                    # self.softmax = nn.Softmax(dim=-1) in __init__: self.softmax(x) is softmax(x, dim=-1)
                    return self.emit("softmax", [self.expr(e.args[0].value)], [("dim", Const(dim))], expr=e)
            else:
                receiver = self.expr(func.value)
                qualname = "Tensor." + func.attr.value
                if func.attr.value.endswith("_") and not func.attr.value.startswith("__"):
                    self.mark_mutated(receiver)            # x.mul_(...) changes x in place
        elif isinstance(func, cst.Name) and func.value not in self.local_names:
            qualname = self.resolver.qualname(func) or func.value
        elif isinstance(func, cst.Call) and self.resolver.qualname(func.func) == "torch.nn.Softmax" \
                and _softmax_dim(func) is not None and len(e.args) == 1 and e.args[0].keyword is None:
            # nn.Softmax(dim=-1)(x), the module made where it is called: softmax(x, dim=-1)
            return self.emit("softmax", [self.expr(e.args[0].value)], [("dim", Const(_softmax_dim(func)))], expr=e)
        else:
            module, qualname = self.expr(func), "call"
        args = [receiver] if receiver is not None else []
        # `*shape` / `**kw` stay opaque operands (their text); such a call is never a canonical op
        args += [Opaque(a.star + _code(a.value), tuple(sorted(self.opaque_reads(a.value)))) if a.star
                 else self.expr(a.value) for a in e.args if a.keyword is None]
        kwargs = [(a.keyword.value, self.expr(a.value)) for a in e.args if a.keyword is not None]
        result = None if module is not None or starred else canon.canonical_call(qualname, args, kwargs, Ref)
        if result is not None:
            op, args, kwargs = result
        elif receiver is not None:
            op = "." + func.attr.value
        else:
            op = qualname
        return self.emit(op, args, kwargs, module=module, expr=e)

    def opaque(self, e) -> Opaque:
        reads = self.opaque_reads(e)
        return Opaque(_code(e), tuple(sorted(reads)))

    def opaque_reads(self, e) -> set:
        """Count every local name inside `e` as read (conservative: lambdas, comprehensions ...)."""
        reads = set()
        for n in _walk(e):
            if isinstance(n, cst.Name) and n.value in self.local_names:
                reads.add(self.read(n.value, n))
        return reads


def _softmax_dim(ctor) -> int | None:
    """The literal `dim` of an `nn.Softmax(dim=-1)` / `nn.Softmax(-1)` constructor call, else None."""
    if not isinstance(ctor, cst.Call) or len(ctor.args) != 1:
        return None
    arg = ctor.args[0]
    if arg.keyword is not None and arg.keyword.value != "dim":
        return None
    try:
        value = ast.literal_eval(_code(arg.value))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _aug_op(operator) -> str:
    name = type(operator).__name__.replace("Assign", "")
    for cls, sym in _BINOPS.items():
        if cls.__name__ == name:
            return sym
    return "operator." + name.lower()


def _root(e):
    while isinstance(e, cst.Attribute):
        e = e.value
    return e


def _root_name(e) -> str | None:
    root = _root(e)
    return root.value if isinstance(root, cst.Name) else None
