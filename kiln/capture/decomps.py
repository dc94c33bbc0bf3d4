"""Decompositions applied at capture (`ep.run_decompositions(table())`): composite ops Kiln has no
rule for, written out as ops it can differentiate.

Recurrent layers. `nn.LSTM`, `nn.GRU` and `nn.RNN` call one ATen op for the whole stack of layers
(`aten.lstm.input`, ...), whose backward PyTorch only has as a fused kernel. Here each becomes the
recurrence it computes, step by step: the input projection of every time step as one `linear`, then per
step `linear` of the hidden state, the gates (`sigmoid`, `tanh`, `relu`) and the state update, written in
the order ATen's CPU kernels compute them. The sequence is unrolled over its (static) length, so autodiff
differentiates ordinary ops. Dropout between layers is `torch.dropout`, as in ATen. Packed sequences
(`aten.lstm.data`, ...) have data-dependent shapes: refused with a message that says what to do.

Composites (`composites(graph, registered)`): an op Kiln has no rule for, which PyTorch itself defines as
a composite of other ops (einsum, square, ...), is written out as that composite, as eager autograd
does; only ops with neither a rule nor a composite reach the autograd fallback.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kiln.errors import UnsupportedError

aten = torch.ops.aten


def _lstm_cell(x_proj, state, w_hh, b_hh, w_hr):
    h, c = state
    gates = F.linear(h, w_hh, b_hh) + x_proj
    i, f, g, o = gates.chunk(4, -1)
    c = f.sigmoid() * c + i.sigmoid() * g.tanh()
    h = o.sigmoid() * c.tanh()
    return (h if w_hr is None else F.linear(h, w_hr), c)


def _gru_cell(x_proj, state, w_hh, b_hh, w_hr):
    (h,) = state
    xr, xz, xn = x_proj.chunk(3, -1)
    hr, hz, hn = F.linear(h, w_hh, b_hh).chunk(3, -1)
    reset, update = (hr + xr).sigmoid(), (hz + xz).sigmoid()
    new = (xn + hn * reset).tanh()
    return ((h - new) * update + new,)


def _simple_cell(nonlinearity):
    def cell(x_proj, state, w_hh, b_hh, w_hr):
        (h,) = state
        return (nonlinearity(F.linear(h, w_hh, b_hh) + x_proj),)
    return cell


def _direction(cell, x, state, weights, has_biases, reverse):
    """One layer in one direction over x (T, B, I) from `state` (tuple of (B, H)): the outputs (T, B, H)
    and the last state."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
    w_hr = weights[4 if has_biases else 2] if len(weights) == 3 + 2 * has_biases else None
    steps = F.linear(x, w_ih, b_ih).unbind(0)          # the input projection of all steps at once
    outputs = [None] * len(steps)
    for t in (reversed(range(len(steps))) if reverse else range(len(steps))):
        state = cell(steps[t], state, w_hh, b_hh, w_hr)
        outputs[t] = state[0]
    return torch.stack(outputs, 0), state


def _recurrent(cell, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """The stack of layers ATen's `lstm`/`gru`/`rnn_*` ops compute. `hx`: the initial states, each
    (layers * directions, B, H); `params`: per layer and direction w_ih, w_hh[, b_ih, b_hh][, w_hr]."""
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    x = input.transpose(0, 1) if batch_first else input          # (T, B, I)
    last: list[tuple] = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, state = _direction(cell, x, tuple(h[k] for h in hx), params[k * per:(k + 1) * per],
                                    has_biases, reverse=d == 1)
            outs.append(out)
            last.append(state)
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    out = x.transpose(0, 1) if batch_first else x
    return (out, *(torch.stack([s[i] for s in last], 0) for i in range(len(hx))))


def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return _recurrent(_lstm_cell, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                      batch_first)


def gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    out, h = _recurrent(_gru_cell, input, [hx], params, has_biases, num_layers, dropout, train, bidirectional,
                        batch_first)
    return out, h


def _rnn(nonlinearity):
    def rnn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        out, h = _recurrent(_simple_cell(nonlinearity), input, [hx], params, has_biases, num_layers, dropout,
                            train, bidirectional, batch_first)
        return out, h
    return rnn


PACKED_HINT = ("packed sequences (nn.utils.rnn.pack_padded_sequence / pack_sequence) have shapes set by the "
               "lengths' values, which Kiln cannot compile; pass the padded batch to the recurrent layer and mask "
               "the padded steps in the loss (e.g. labels = -100 there for cross_entropy)")


def _packed(name):
    def refuse(*args, **kwargs):
        raise UnsupportedError(f"{name} on a packed sequence: {PACKED_HINT}")
    return refuse


@contextlib.contextmanager
def refuse_packed_sequences():
    """During capture, making a `PackedSequence` (what every packing function returns) raises
    UnsupportedError with PACKED_HINT; export would fail later, inside the recurrent layer, on a size."""
    from torch.nn.utils.rnn import PackedSequence
    original = PackedSequence.__dict__["__new__"]

    def refuse(cls, *args, **kwargs):
        raise UnsupportedError(PACKED_HINT[0].upper() + PACKED_HINT[1:])
    PackedSequence.__new__ = refuse
    try:
        yield
    finally:
        PackedSequence.__new__ = original


def composites(registered) -> dict:
    """Table entries for every op that Kiln declares nothing for (`registered(op)` is False) but PyTorch
    defines as a composite of other ops (a CompositeImplicitAutograd kernel: einsum, square, ...). Eager
    autograd differentiates exactly that composite, so writing it out gives eager's own gradient, where the
    opaque autograd fallback would run the op's kernel in another layout. The table holds every such op,
    not only the graph's: a composite written with further composites (cross_entropy_loss -> log_softmax,
    nll_loss_nd -> nll_loss) is written out in the same single decomposition."""
    out = {}
    for op, fn in torch.export.default_decompositions().items():
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or registered(op):
            continue
        if not all(str(r.type) == "Tensor" or str(r.type).startswith("Tensor") for r in op._schema.returns):
            continue                     # sizes and other Python values (sym_size, size.int) are not ops to write out
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            out[op] = fn
    return out


def table(registered) -> dict:
    """The decompositions capture runs once: composites Kiln has no rule for, and recurrent layers written
    out (Kiln's own, below, taking precedence)."""
    return {
        **composites(registered),
        aten.lstm.input: lstm,
        aten.gru.input: gru,
        aten.rnn_tanh.input: _rnn(torch.tanh),
        aten.rnn_relu.input: _rnn(torch.relu),
        aten.lstm.data: _packed("nn.LSTM"),
        aten.gru.data: _packed("nn.GRU"),
        aten.rnn_tanh.data: _packed("nn.RNN"),
        aten.rnn_relu.data: _packed("nn.RNN"),
    }
