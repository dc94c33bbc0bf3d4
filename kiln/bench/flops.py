"""Analytic FLOP counts for the benchmark zoo.

Convention (the usual "model FLOPs" used for MFU figures):

* A matrix product of an (M x K) by a (K x N) matrix costs ``2*M*N*K`` FLOPs
  (one multiply and one add per term).
* Only matrix products are counted: Linear layers, the two attention products
  (``Q @ K^T`` and ``P @ V``), convolutions (as implicit matmuls) and the output
  head.  Element-wise work (norms, activations, softmax, residual adds, the
  optimizer update) and embedding lookups are not counted: they are memory-bound
  and small next to the matmuls.
* Attention is counted over the full ``q_len x kv_len`` score matrix even for
  causal models, because that is what the SDPA math kernels compute on CPU
  (and what ``torch.utils.flop_counter`` reports), so the figure stays comparable.
* One training step = forward + backward = ``3 x forward``: the backward of a
  matmul needs two matmuls of the same size (gradient w.r.t. input and w.r.t.
  weight).

The functions are deliberately tiny so the tests can check them against numbers
worked out by hand.
"""
from __future__ import annotations

# Forward + backward costs three forwards (see module docstring).
TRAIN_MULTIPLIER = 3


def matmul(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) product: 2*m*n*k."""
    return 2 * m * n * k


def linear(tokens: int, in_features: int, out_features: int) -> int:
    """FLOPs of ``nn.Linear(in_features, out_features)`` applied to ``tokens`` rows."""
    return matmul(tokens, out_features, in_features)


def attention(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """FLOPs of the two attention products for ``batch*heads`` independent heads.

    ``scores = Q @ K^T`` is (q_len x head_dim) @ (head_dim x kv_len) and
    ``out = P @ V`` is (q_len x kv_len) @ (kv_len x head_dim); both cost
    ``2*q_len*kv_len*head_dim``.
    """
    return batch * heads * 2 * matmul(q_len, kv_len, head_dim)


def conv2d(batch: int, in_ch: int, out_ch: int, kernel: int, out_h: int, out_w: int) -> int:
    """FLOPs of a (non-grouped) square-kernel Conv2d seen as an implicit matmul.

    Every output pixel of every output channel is a dot product of length
    ``in_ch*kernel*kernel``.
    """
    return matmul(batch * out_h * out_w, out_ch, in_ch * kernel * kernel)


def train_step(forward_flops: int) -> int:
    """FLOPs of one training step (forward + backward) given the forward count."""
    return TRAIN_MULTIPLIER * forward_flops


def transformer_layer(tokens: int, batch: int, seq: int, hidden: int, heads: int,
                      intermediate: int, mlp_matrices: int = 2, kv_hidden: int | None = None) -> int:
    """Forward FLOPs of one self-attention block plus its MLP.

    ``mlp_matrices`` is 2 for a plain MLP (up, down) and 3 for a gated one
    (gate, up, down: Llama's SwiGLU).  ``kv_hidden`` is the width of the K/V
    projections (smaller than ``hidden`` with grouped-query attention).
    """
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    proj = (linear(tokens, hidden, hidden)            # Q
            + 2 * linear(tokens, hidden, kv_hidden)   # K, V
            + linear(tokens, hidden, hidden))         # output projection
    attn = attention(batch, heads, seq, seq, hidden // heads)
    mlp = mlp_matrices * linear(tokens, hidden, intermediate)
    return proj + attn + mlp
