"""The analytic FLOP counts, against numbers worked out by hand and against torch's counter."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kiln.bench import cnn, flops, zoo


def test_linear_by_hand():
    # nn.Linear(512 -> 1408) on 8*256 = 2048 tokens: each of the 2048*1408 outputs
    # is a 512-long dot product = 512 multiplies + 512 adds = 1024 FLOPs.
    assert flops.linear(2048, 512, 1408) == 2048 * 1408 * 1024 == 2_952_790_016
    assert flops.linear(3, 5, 7) == 210  # 3*7 outputs x 5 multiply-adds x 2


def test_attention_by_hand():
    # batch 2, 4 heads, 32 queries, 32 keys, head dim 16:
    # Q@K^T: 32*32 scores x 16 MACs = 16384 MACs; P@V: 32*16 outputs x 32 MACs = 16384 MACs.
    # (16384 + 16384) MACs x 2 FLOPs x 8 heads-in-batch = 524288.
    assert flops.attention(2, 4, 32, 32, 16) == 524_288
    # Cross-attention with different lengths: 10 queries, 6 keys, dim 4, one head:
    # 10*6*4 + 10*4*6 = 480 MACs = 960 FLOPs.
    assert flops.attention(1, 1, 10, 6, 4) == 960


def test_conv_and_train_step_by_hand():
    # 3x3 conv, 3 -> 8 channels, 4x4 output, batch 1: 16 pixels x 8 channels x 27 MACs x 2.
    assert flops.conv2d(1, 3, 8, 3, 4, 4) == 6912
    assert flops.train_step(1000) == 3000


def test_llama_block_by_hand():
    # One tiny Llama layer: tokens 64 (2x32), hidden 64, 4 heads, MLP 192 (gated: 3 matrices).
    proj = 4 * 2 * 64 * 64 * 64        # Q, K, V, O: 64 tokens x 64 x 64, x2 FLOPs
    attn = 524_288                      # from test_attention_by_hand
    mlp = 3 * 2 * 64 * 64 * 192
    assert flops.transformer_layer(64, 2, 32, 64, 4, 192, mlp_matrices=3) == proj + attn + mlp == 7_340_032
    head = 2 * 64 * 64 * 256            # LM head to vocab 256
    entry = zoo.get("llama", "tiny")
    assert entry.flops_per_step == 3 * (2 * 7_340_032 + head) == 50_331_648


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5", "vit", "resnet"])
def test_forward_matches_torch_counter(name):
    """The zoo's analytic forward count equals what torch counts running the model.

    The math SDPA backend is forced so the attention products show up as plain
    matmuls torch's counter sees (its fused CPU kernel is not counted).
    """
    entry = zoo.get(name, "tiny")
    model, batch = entry.build_model(), entry.build_batch(0)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter, torch.no_grad():
        model(**batch)
    assert entry.flops_per_step == 3 * counter.get_total_flops()


def test_resnet_plan():
    # 4 blocks ending at width 512: one per stage, widths doubling, stride 2 from stage 2.
    assert cnn.stage_plan(4, 512) == [(64, 1), (128, 2), (256, 2), (512, 2)]
    assert cnn.stage_plan(6, 64) == [(8, 1), (8, 1), (16, 2), (16, 1), (32, 2), (64, 2)]
