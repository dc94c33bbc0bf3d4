"""torch.export keeps each kernel as one torch.ops.kiln node; torch.compile traces through the fake
implementations and still computes what eager PyTorch computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kiln.kernels as K
from tests.kernels import refs


class Block(nn.Module):
    """Calls every kernel once, the way a Llama/BERT-style block would."""

    def __init__(self, hidden=16, inter=24, vocab=40, heads=2, p=0.0):
        super().__init__()
        self.heads, self.p = heads, p
        self.norm = nn.Parameter(torch.rand(hidden) + 0.5)
        self.norm2 = nn.Parameter(torch.rand(hidden) + 0.5)
        self.qk = nn.Linear(hidden, 2 * hidden, bias=False)
        self.gate = nn.Parameter(torch.randn(inter, hidden) * 0.2)
        self.up = nn.Parameter(torch.randn(inter, hidden) * 0.2)
        self.down = nn.Linear(inter, hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Parameter(torch.randn(vocab, hidden) * 0.2)

    def forward(self, x, cos, sin, labels):
        b, s, _ = x.shape
        h = K.rms_norm(x, self.norm, 1e-6)
        q, k = self.qk(h).view(b, s, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = K.rope(q, k, cos, sin, unsqueeze_dim=1)
        h, res = K.rms_norm((q * k).transpose(1, 2).reshape(b, s, -1), self.norm2, 1e-6, residual=x)
        h = self.down(K.swiglu_linear(h, self.gate, self.up))
        h = K.swiglu(h, K.linear_gelu(h, self.fc.weight, self.fc.bias, "tanh"))
        h, _ = K.dropout_add_layer_norm(h, res, self.ln.weight, self.ln.bias, self.p, 1e-5, self.training)
        return K.linear_cross_entropy(h, self.head, labels)


FORWARD_OPS = ["rms_norm", "rope", "add_rms_norm", "swiglu_linear", "linear_gelu", "swiglu",
               "dropout_add_layer_norm", "linear_cross_entropy"]


def block_inputs(batch=2, seq=5, hidden=16, vocab=40):
    torch.manual_seed(0)
    x = torch.randn(batch, seq, hidden)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), 1.0 / 100 ** (torch.arange(0, 4) / 4))
    emb = torch.cat([freqs, freqs], -1).expand(batch, seq, 8)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, 0] = -100
    return x, emb.cos(), emb.sin(), labels


def _kiln_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target._schema.name.split("::")[1] for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "kiln"]


@pytest.mark.parametrize("decompose", [False, True], ids=["export", "export+run_decompositions"])
def test_export_keeps_each_kernel_as_one_node(decompose):
    model = Block()
    ep = torch.export.export(model, block_inputs(), strict=False)
    if decompose:
        ep = ep.run_decompositions()            # the full ATen decomposition table: kiln ops are opaque to it
    assert _kiln_targets(ep.graph_module) == FORWARD_OPS
    torch.testing.assert_close(ep.module()(*block_inputs()), model(*block_inputs()))


def test_export_dynamic_tokens():
    """Fake implementations are written over symbolic shapes: a dynamic sequence length exports."""
    model = Block()
    seq = torch.export.Dim("seq", min=2, max=64)
    ep = torch.export.export(model, block_inputs(), dynamic_shapes=({1: seq}, {1: seq}, {1: seq}, {1: seq}),
                             strict=False)
    assert _kiln_targets(ep.graph_module) == FORWARD_OPS
    torch.testing.assert_close(ep.module()(*block_inputs(seq=9)), model(*block_inputs(seq=9)))


def test_torch_compile_aot_eager_matches_eager():
    """AOTAutograd traces forward and backward through the fake kernels; values and gradients match
    the unfused reference module."""
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(*block_inputs())
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = _unfused_block(model, *block_inputs())
    want.backward()
    torch.testing.assert_close(loss, want, **refs.FP32)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **refs.FP32, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    model = Block()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(*block_inputs()), _unfused_block(model, *block_inputs()), **refs.FP32)


def _unfused_block(m: Block, x, cos, sin, labels):
    """Block.forward with every kernel replaced by its plain PyTorch reference (no dropout)."""
    assert m.p == 0 or not m.training
    import torch.nn.functional as F
    b, s, _ = x.shape
    h = refs.rms_norm(x, m.norm, 1e-6)
    q, k = m.qk(h).view(b, s, 2, m.heads, -1).permute(2, 0, 3, 1, 4)
    q, k = refs.rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    h, res = refs.rms_norm((q * k).transpose(1, 2).reshape(b, s, -1), m.norm2, 1e-6, residual=x)
    h = m.down(refs.swiglu_linear(h, m.gate, m.up))
    h = refs.swiglu(h, refs.linear_gelu(h, m.fc.weight, m.fc.bias, "tanh"))
    h = F.layer_norm(h + res, (h.shape[-1],), m.ln.weight, m.ln.bias, 1e-5)
    return refs.linear_cross_entropy(h, m.head, labels)
