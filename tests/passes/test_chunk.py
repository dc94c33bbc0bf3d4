"""Row slices (kiln/passes/chunk.py): under a budget rematerialization alone cannot meet, the forward's
row-wise blocks run on slices of rows. Checked against eager training (the loss every step, the parameters
after), the budget against the memory model and the allocator, and which ops a block may hold."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.passes import remat
from kiln.passes import chunk as chunk_pass
from kiln.passes.chunk import chunk_rows, find_blocks
from kiln.runtime.memory import allocated
from tests.models import zoo
from tests.passes.test_memory import Deep, _sgd, _train


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _floor(model, *args, amp=None, optimizer=None, **kwargs) -> tuple[int, int]:
    """(the unconstrained predicted peak, the smallest peak rematerialization reaches without row slices),
    as the remat pass sees them: from the error of a budget nothing meets, slices switched off."""
    step = kiln.compile(copy.deepcopy(model), optimizer=optimizer or _sgd(), amp=amp, memory_budget=1e-6)
    saved = chunk_pass.CHUNKS
    chunk_pass.CHUNKS = ()
    try:
        with pytest.raises(remat.BudgetUnmet) as e:
            step(*args, **kwargs)
    finally:
        chunk_pass.CHUNKS = saved
    return e.value.plan.before, e.value.plan.floor


@pytest.mark.skipif(allocated() is None, reason="measuring needs glibc's mallinfo2")
def test_a_budget_below_what_recomputation_reaches_runs_in_row_slices_and_trains_like_eager():
    x = torch.randn(512, 64)
    model = Deep(h=2048)
    ref = copy.deepcopy(model)
    peak, floor = _floor(model, x)
    budget = (floor - 4096) / peak                 # just below recomputation's floor
    step = kiln.compile(model, optimizer=_sgd(), memory_budget=budget)
    _train(step, ref, x)
    rep = step.memory(measure=True)
    plan = step.last.memory
    assert plan.chunking is not None and plan.chunking.chunks > 1, str(rep)
    assert "slices of rows" in str(rep)
    assert rep.predicted_peak <= rep.budget < floor, str(rep)
    assert rep.measured_peak <= rep.budget * 1.02, str(rep)
    assert "split_with_sizes" in step.source()      # the slices are visible in the generated step


def test_without_a_budget_nothing_is_sliced():
    step = kiln.compile(Deep(), optimizer=_sgd())
    step(torch.randn(64, 64))
    assert "split_with_sizes" not in step.source()


class PositionScaled(nn.Module):
    """An MLP on (batch, sequence, d) whose hidden activations are scaled per position by a (sequence, h)
    tensor: broadcast over the batch, that multiply reads other rows of it than a slice of the flattened
    (batch * sequence) rows holds, so it must end the block. (With 4 x 24 rows in 4 slices a slice has 24
    rows: a sliced multiply would broadcast without an error, and be wrong.)"""

    def __init__(self, seq=24, d=32, h=512):
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, d)
        self.scale = nn.Parameter(torch.rand(seq, h) + 0.5)

    def forward(self, x):
        h = torch.relu(self.up(x) * self.scale)
        h = torch.relu(self.mid(torch.relu(self.mid(h))))
        return (self.down(h) + x).square().mean()


def _blocks(model, *args, loss_fn=None, **kwargs):
    """The row-wise blocks the chunk pass finds in `model`'s step."""
    from kiln.passes import pipeline
    found = {}

    def spy(ctx):
        found["blocks"] = find_blocks(ctx.graph)
        return 0
    i = [n for n, _ in pipeline.PIPELINE].index("chunk")
    saved = pipeline.PIPELINE[i]
    pipeline.PIPELINE[i] = ("chunk", spy)
    try:
        kiln.compile(model, optimizer=_sgd(), loss_fn=loss_fn)(*args, **kwargs)
    finally:
        pipeline.PIPELINE[i] = saved
    return found["blocks"]


def test_ops_that_read_other_rows_end_a_block():
    blocks = _blocks(PositionScaled(), torch.randn(4, 24, 32))
    ops = [n.op.name for b in blocks for n in b.nodes]
    assert "aten.mul.Tensor" not in ops and ops.count("aten.linear") == 4, ops


def test_blocks_hold_projections_mlp_and_norms_not_attention():
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.MODELS["llama"]()
    blocks = _blocks(model, *args, loss_fn=loss_fn, **kwargs)
    ops = {n.op.name for b in blocks for n in b.nodes}
    # the residual adds are inside the norms that read them (kiln.add_rms_norm), sliced by rows with them
    assert {"aten.linear", "kiln.swiglu", "kiln.rms_norm", "kiln.add_rms_norm"} <= ops, ops
    assert not any("attention" in o or o == "kiln.rope" or "embedding" in o or "dropout" in o for o in ops), ops
    assert {b.rows for b in blocks} == {zoo.BATCH * zoo.SEQ}


def _wide(name):
    """A zoo transformer with a wide MLP and more tokens (4 x 48), so its MLP activations, not its
    parameters, set the peak: what row slices are for."""
    torch.manual_seed(0)
    ids = torch.randint(0, zoo.VOCAB, (4, 48))
    if name == "llama":
        model = zoo._hf("LlamaForCausalLM", "LlamaConfig", vocab_size=zoo.VOCAB, hidden_size=32,
                        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return model, dict(input_ids=ids, labels=ids)
    if name == "gpt2":
        model = zoo._hf("GPT2LMHeadModel", "GPT2Config", vocab_size=zoo.VOCAB, n_embd=32, n_inner=512, n_layer=2,
                        n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
        return model, dict(input_ids=ids, labels=ids)
    model = zoo._hf("BertForMaskedLM", "BertConfig", vocab_size=zoo.VOCAB, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=512, max_position_embeddings=64, **zoo.DROP0)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    return model, dict(input_ids=ids, attention_mask=mask, labels=ids)


@pytest.mark.parametrize("amp", [None, "bf16"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_transformers_in_row_slices_train_like_eager(name, amp):
    """A budget just below what recomputation alone reaches: the step runs its projections and MLPs in row
    slices, holds the budget, and trains as eager does (fp32: 5 steps of SGD with momentum, rtol 1e-4, see
    `_sgd` for why not AdamW; bf16: the loss within bf16's rounding of eager autocast's)."""
    model, batch = _wide(name)
    ref = copy.deepcopy(model)
    peak, floor = _floor(model, amp=amp, **batch)
    step = kiln.compile(model, optimizer=_sgd(), amp=amp, verify=True, memory_budget=(floor - 1024) / peak)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5 if amp is None else 2):
        got = step(**batch)
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=amp is not None):
            want = ref(**batch).loss
        want.backward()
        opt.step()
        tol = dict(rtol=1e-4, atol=1e-5) if amp is None else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want.detach().float(), **tol)
    if amp is None:
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {n}: {m}")
    rep = step.memory()
    assert step.last.memory.chunking.chunks > 1 and rep.predicted_peak <= rep.budget < floor, str(rep)


def test_chunk_rows_with_one_slice_changes_nothing():
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.MODELS["gpt2"]()
    step = kiln.compile(model, optimizer=_sgd(), loss_fn=loss_fn)
    step(*args, **kwargs)
    before = [n.op.name for n in step.graph.nodes]
    report = chunk_rows(step.graph, 1)
    assert [n.op.name for n in step.graph.nodes] == before and str(report) == ""
