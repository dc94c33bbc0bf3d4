"""sdpa in a helper method that returns its probabilities on every call: a parameter says when they are needed.

GPT-2's `_attn(self, query, key, value, attention_mask=None, head_mask=None)` ends with
`return attn_output, attn_weights`, and its caller in the same class reads `attn_weights` only
under `if output_attentions:`.  The helper gets a new keyword parameter `need_weights=True` (the
default keeps what it did for every other caller: subclasses, other classes, code outside the file),
its explicit attention stays under `if ... or need_weights:` (attention_split.py's split), and each
call in the class whose probabilities are read only under plain tests passes those tests:
`self._attn(..., need_weights=output_attentions)`.  A call that cannot be shown to be such keeps
the default, so nothing changes for it.  Refused: a helper with `*args` / `**kwargs` / keyword-only
parameters or decorators, one a subclass in the same file overrides (the new keyword would reach an
override that does not take it), and one no call of the class can pass the keyword to.
"""
from __future__ import annotations

import libcst as cst

from kiln.adopt.structural import Context, _cst_walk, code_of

NAMES = ("need_weights", "need_attn_weights")


def probs_parameter(ctx: Context, inside: set, later_reads):
    """(name, the `return` node, {id: (node, new node)}) when the probabilities leave only through the
    function's last `return` and some call in the class can say when it needs them; a reason when
    it is that return that keeps the rewrite out but no call can; None when the return is not the
    function's last statement returning a tuple with the probabilities as one element.
    `later_reads(fn, after, inside, output, env, skip)` is attention_split._later_reads."""
    fn = ctx.fn
    last = fn.cst.body.body[-1] if isinstance(fn.cst.body, cst.IndentedBlock) and fn.cst.body.body else None
    ret = last.body[0] if isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1 else None
    if not isinstance(ret, cst.Return) or not isinstance(ret.value, cst.Tuple):
        return None
    elements = ret.value.elements
    reading = [i for i, el in enumerate(elements) if any(fn.name_version.get(id(n)) in inside for n in _cst_walk(el)
                                                         if isinstance(n, cst.Name))]
    if len(reading) != 1 or any(isinstance(el, cst.StarredElement) for el in elements) \
            or not isinstance(elements[reading[0]].value, cst.Name):
        return None
    index, line = reading[0], ctx.analysis.positions[ret].start.line
    why = f"the attention probabilities are returned on every call (line {line})"
    if fn.cls is None or not fn.params or fn.name.startswith("__"):
        return why
    params = fn.cst.params
    if fn.cst.decorators or params.star_arg is not cst.MaybeSentinel.DEFAULT or params.star_kwarg is not None \
            or params.kwonly_params or params.posonly_params:
        return why + (", and the method's parameters (decorators, `*args`, `**kwargs`, keyword-only or "
                      "positional-only ones) leave no plain place for one that says when they are needed")
    name = next((n for n in NAMES if n not in fn.local_names and n not in fn.params), None)
    if name is None:
        return why
    override = _overridden(ctx.analysis.module, fn.cls, fn.name)
    if override is not None:
        return why + (f", and {override} in this file overrides `{fn.name}`: a parameter saying when they are "
                      f"needed would reach that override")
    edits, size = {}, len(elements)
    for g in ctx.analysis.functions:
        if g.cls != fn.cls or not g.params:
            continue
        for call, target, stmt in _calls(g, fn.name, size):
            version = next((v for v, s in g.def_stmt.items() if s is not None and s.cst is stmt.cst
                            and v.split(":")[0] == target[index].value), None)
            if version is None or len({t.value for t in target}) != size:
                continue
            end = ctx.analysis.positions[stmt.line_node].end.line
            later = later_reads(g, end, {version}, "", stmt.env, frozenset())
            if isinstance(later, str):
                continue                      # read where no test covers it: this call keeps the default
            tests = later[0]
            test = " or ".join(t if len(tests) == 1 or " or " not in t else f"({t})" for t in tests) or "False"
            edits[id(call)] = (call, _with_keyword(call, name, test))
    if not edits:
        return why + f", and no call of `self.{fn.name}(...)` in {fn.cls} reads them only under a test"
    params_list = list(params.params)
    new_param = cst.Param(cst.Name(name), default=cst.Name("True"),
                          equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                whitespace_after=cst.SimpleWhitespace("")))
    if params_list and params_list[-1].comma is cst.MaybeSentinel.DEFAULT:
        params_list[-1] = params_list[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    edits[id(params)] = (params, params.with_changes(params=[*params_list, new_param]))
    return name, ret, edits


def _calls(g, method: str, size: int):
    """(call, target names, Stmt) for each `a, b = self.<method>(...)` of `g` whose call passes no
    `*args` / `**kwargs` (its other uses of the method keep the default)."""
    me = g.params[0]
    stmts = {id(n.stmt.cst): n.stmt for n in g.nodes if n.stmt is not None}
    for node in _cst_walk(g.cst.body):
        if not (isinstance(node, cst.Assign) and id(node) in stmts and len(node.targets) == 1
                and isinstance(node.value, cst.Call)):
            continue
        call, target = node.value, node.targets[0].target
        func = call.func
        if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == me
                and func.attr.value == method and isinstance(target, (cst.Tuple, cst.List))
                and len(target.elements) == size
                and all(isinstance(el.value, cst.Name) and not isinstance(el, cst.StarredElement)
                        for el in target.elements)
                and not any(a.star or (a.keyword is not None and a.keyword.value in NAMES) for a in call.args)):
            continue
        yield call, [el.value for el in target.elements], stmts[id(node)]


def _with_keyword(call: cst.Call, name: str, test: str) -> cst.Call:
    args = list(call.args)
    if args and args[-1].comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    arg = cst.Arg(cst.parse_expression(test), keyword=cst.Name(name),
                  equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                        whitespace_after=cst.SimpleWhitespace("")))
    return call.with_changes(args=[*args, arg])


def _overridden(module: cst.Module, cls: str, method: str) -> str | None:
    """The first class of the module deriving from `cls` (directly or through others of the module)
    that defines `method`, or None."""
    classes = [n for n in _cst_walk(module) if isinstance(n, cst.ClassDef)]
    below, grew = {cls}, True
    while grew:
        grew = False
        for c in classes:
            if c.name.value not in below and any(code_of(b.value).split(".")[-1] in below for b in c.bases):
                below.add(c.name.value)
                grew = True
    for c in classes:
        if c.name.value in below - {cls} and any(isinstance(s, cst.FunctionDef) and s.name.value == method
                                                 for s in c.body.body):
            return c.name.value
    return None
