import torch
import torch.nn.functional as F

from kiln.passes.canonicalize import canonicalize, lower_dialects
from tests.passes.graphs import aten, count, graph_with_inputs, run


def test_cross_entropy_becomes_log_softmax_and_nll():
    x, t = torch.randn(6, 5), torch.tensor([0, 1, 4, -100, 2, 2])
    g, b, (xv, tv) = graph_with_inputs(x, t)
    g.outputs = [b(aten.cross_entropy_loss.default, xv, tv, None, 1, -100, 0.0)]
    canonicalize(g)
    assert count(g, aten._log_softmax.default) == 1 and count(g, aten.nll_loss_forward.default) == 1
    torch.testing.assert_close(run(g, x, t), F.cross_entropy(x, t))


def test_cross_entropy_label_smoothing_and_3d():
    x, t = torch.randn(2, 5, 3), torch.tensor([[0, 1, 4], [-100, 2, 2]])
    g, b, (xv, tv) = graph_with_inputs(x, t)
    g.outputs = [b(aten.cross_entropy_loss.default, xv, tv, None, 1, -100, 0.1)]
    canonicalize(g)
    assert count(g, aten.cross_entropy_loss.default) == 0
    torch.testing.assert_close(run(g, x, t), F.cross_entropy(x, t, label_smoothing=0.1))


def test_layer_norm_and_conv():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    g, b, (xv, wv) = graph_with_inputs(x, w)
    c = b(aten.conv2d.default, xv, wv, None, [2, 2], [1, 1])
    g.outputs = [b(aten.layer_norm.default, c, [4, 4])]
    canonicalize(g)
    assert count(g, aten.convolution.default) == 1 and count(g, aten.native_layer_norm.default) == 1
    torch.testing.assert_close(run(g, x, w), F.layer_norm(F.conv2d(x, w, stride=2, padding=1), [4, 4]))


def _attention_graph(q, k, v, mask, **kw):
    g, b, vals = graph_with_inputs(q, k, v, *([mask] if mask is not None else []))
    m = vals[3] if mask is not None else None
    g.outputs = [b(aten.scaled_dot_product_attention.default, vals[0], vals[1], vals[2], m, **kw)]
    return g


def test_attention_lowered_by_preferred_dialect():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.rand(2, 1, 6, 6) > 0.2
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    flash = _attention_graph(q, k, v, mask, enable_gqa=True)
    lower_dialects(flash, ("sdpa", "aten"))
    assert count(flash, aten._scaled_dot_product_flash_attention_for_cpu.default) == 1
    torch.testing.assert_close(run(flash, q, k, v, mask), want)
    math = _attention_graph(q, k, v, mask, enable_gqa=True)
    lower_dialects(math, ("aten",))
    assert count(math, aten._scaled_dot_product_flash_attention_for_cpu.default) == 0
    assert count(math, aten._softmax.default) == 1
    torch.testing.assert_close(run(math, q, k, v, mask), want)


def test_attention_with_dropout_falls_back_to_math():
    q = torch.randn(1, 2, 4, 8)
    g = _attention_graph(q, q, q, None, dropout_p=0.5)
    lower_dialects(g, ("sdpa", "aten"))     # the CPU flash kernel has no dropout: sdpa declines
    assert count(g, aten.native_dropout.default) == 1
