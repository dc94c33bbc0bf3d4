"""kiln/bench/split.py: each profiler event's self time goes to one category; the categories add up to the
time torch.profiler itself gives the profiled steps."""
from __future__ import annotations

import pytest
import torch

from kiln.bench.split import CATEGORIES, STEP_EVENT, category, profile_modes, profile_split, render, split_events


@pytest.mark.parametrize("name,ancestors,want", [
    ("aten::mm", [STEP_EVENT], "matmul"),
    ("aten::mm", ["kiln::linear_cross_entropy_grads", STEP_EVENT], "matmul"),        # a kernel's products
    ("aten::addmm_", ["kiln::linear_cross_entropy_grads", STEP_EVENT], "matmul"),    # accumulated in place
    ("aten::exp_", ["kiln::linear_cross_entropy_grads", STEP_EVENT], "fused"),       # the rest of the kernel
    ("aten::copy_", ["aten::_to_copy", "kiln::rms_norm", STEP_EVENT], "fused"),      # a cast inside a kernel
    ("aten::copy_", ["aten::_to_copy", STEP_EVENT], "casts"),
    ("aten::_to_copy", [STEP_EVENT], "casts"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [STEP_EVENT], "attention"),
    ("aten::empty", ["aten::_scaled_dot_product_flash_attention_for_cpu_backward", STEP_EVENT], "attention"),
    ("aten::_foreach_mul_", ["Optimizer.step#AdamW.step", STEP_EVENT], "optimizer"),
    ("aten::_fused_adamw_", [STEP_EVENT], "optimizer"),
    ("CompiledFunction", ["Torch-Compiled Region: 0/0", STEP_EVENT], "fused"),
    ("kiln.region:region0_add_mul", [STEP_EVENT], "fused"),
    ("aten::add", [STEP_EVENT], "other"),
    (STEP_EVENT, [], "untraced"),
    # a mode's name in its step's event is not a category (`kiln-bf16-noattention` holds "attention")
    ("aten::add", [f"{STEP_EVENT}:kiln-bf16-noattention"], "other"),
    (f"{STEP_EVENT}:kiln-bf16-noattention", [], "untraced"),
    # Kiln's dialect kernels and its commit, as a profiled step names them
    ("aten::bmm", ["kiln.kernel:aten._scaled_dot_product_flash_attention_for_cpu_backward.default "
                   "(attention:math_backward)", STEP_EVENT], "attention"),       # attention's own products
    ("kiln.kernel:attention:aten._scaled_dot_product_flash_attention_for_cpu (attention:math_forward)", [STEP_EVENT],
     "attention"),                                                                 # its native loops
    ("aten::mm", ["kiln::linear_cross_entropy_grads", "kiln.kernel:loss:kiln.linear_cross_entropy_grads "
                  "(kiln:linear_cross_entropy_grads)", STEP_EVENT], "matmul"),
    ("kiln.kernel:norm:kiln.rms_norm (kiln:rms_norm)", [STEP_EVENT], "fused"),
    # a product on fp32 copies: the copies and the rounding are the product's (upcast dialect)
    ("aten::copy_", ["aten::_to_copy", "kiln.kernel:matmul:aten.linear (upcast:fp32)", STEP_EVENT], "matmul"),
    ("kiln.kernel:matmul:aten.mm (upcast:fp32)", [STEP_EVENT], "matmul"),
    ("aten::copy_", ["aten::_to_copy", "kiln.kernel:matmul:kiln.swiglu_linear (kiln:swiglu_linear)", STEP_EVENT],
     "fused"),                                                                     # another kernel's casts
    ("kiln.kernel:optimizer:commit", [STEP_EVENT], "optimizer"),
    ("kiln.kernel:optimizer:kiln.adamw_update_multi (aten:fused)", [STEP_EVENT], "optimizer"),
])
def test_each_event_has_one_category(name, ancestors, want):
    assert category(name, ancestors) == want


def test_an_eager_step_splits_into_categories_that_add_up_to_the_profilers_total():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))

    def step():
        opt.zero_grad()
        q = model(x).reshape(16, 2, 1, 4).transpose(1, 2)
        attn = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        loss = torch.nn.functional.cross_entropy(attn.reshape(16, 8).double().float(), y)
        loss.backward()
        opt.step()
    step()
    got = profile_split(step, steps=2)
    assert set(got["per_step_s"]) == set(CATEGORIES)
    for name in ("matmul", "attention", "casts", "optimizer", "other", "untraced"):
        assert got["per_step_s"][name] > 0, (name, got)
    assert got["per_step_s"]["fused"] == 0
    assert got["traced_s"] <= got["wall_s"] * 1.5


def test_the_table_sums_everything_but_matmul_and_attention():
    per = dict.fromkeys(CATEGORIES, 0.0) | {"matmul": 0.5, "attention": 0.1, "fused": 0.06, "optimizer": 0.01,
                                            "untraced": 0.004}
    table = render({"kiln": {"per_step_s": per, "traced_s": 0.674, "wall_s": 0.7}})
    row = next(line for line in table.splitlines() if line.startswith("everything else"))
    assert row.split()[-1] == "74.0"


def test_the_split_counts_exactly_the_profiled_steps():
    from torch.profiler import profile, record_function
    a = torch.randn(64, 64)
    with profile() as prof:
        torch.mm(a, a)                                  # outside the step: not counted
        with record_function(STEP_EVENT):
            torch.mm(a, a).add_(1).to(torch.float64)
    total = split_events(prof.events())
    step = next(e for e in prof.events() if e.name == STEP_EVENT)
    assert sum(total.values()) == pytest.approx(step.cpu_time_total / 1e6, rel=1e-6)
    assert total["matmul"] == pytest.approx(
        sum(e.self_cpu_time_total for e in prof.events() if e.name == "aten::mm" and e.cpu_parent is not None) / 1e6)


def test_the_first_profiled_steps_can_be_left_out():
    from torch.profiler import profile, record_function
    a = torch.randn(64, 64)
    with profile() as prof:
        with record_function(STEP_EVENT):
            torch.mm(a, a)
        with record_function(STEP_EVENT):
            a.add(1)
    assert split_events(prof.events(), skip=1)["matmul"] == 0
    assert split_events(prof.events(), skip=1)["other"] > 0
    assert split_events(prof.events())["matmul"] > 0



def test_modes_are_profiled_interleaved_and_each_split_counts_only_its_own_steps():
    a, order = torch.randn(96, 96), []

    def matmuls():
        order.append("mm")
        torch.mm(a, a)

    def adds():
        order.append("add")
        a.add(1).add(2)
    got = profile_modes({"mm": matmuls, "add": adds}, rounds=3, warmup=1)
    assert order == ["mm", "add", "add", "mm", "mm", "add", "add", "mm"]    # the order rotates every round
    mm_split = got["mm"]["per_step_s"]
    assert mm_split["matmul"] > 10 * mm_split["other"]           # (mm's own allocation is "other")
    assert got["add"]["per_step_s"]["matmul"] == 0 and got["add"]["per_step_s"]["other"] > 0
    assert all(r["steps"] == 3 and r["wall_s"] > 0 for r in got.values())
    assert category(f"{STEP_EVENT}:mm", []) == "untraced"
    with pytest.raises(ValueError, match="at least one step"):
        profile_modes({"mm": matmuls}, rounds=0)

def test_a_kiln_steps_kernels_and_update_are_counted_in_their_categories_not_untraced():
    """Kiln's attention kernel, its kernels' native loops and the commit running the staged AdamW update are
    profiler events of their own (kiln.kernel:...): without them these would be untraced time."""
    import transformers

    import kiln
    from torch.profiler import profile, record_function
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=64, max_position_embeddings=16)
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, 64, (2, 12))
    step = kiln.compile(transformers.LlamaForCausalLM(cfg), optimizer=kiln.optim.AdamW(lr=1e-3))
    step(input_ids=ids, labels=ids)
    with profile() as prof:
        with record_function(STEP_EVENT):
            step(input_ids=ids, labels=ids)
    names = {e.name for e in prof.events()}
    assert "kiln.kernel:optimizer:commit" in names
    kernels = {n for n in names if n.startswith("kiln.kernel:")}
    assert any("attention" in n for n in kernels), kernels
    assert any(n.startswith("kiln.kernel:loss:") for n in kernels), kernels     # a Python kernel around native loops
    got = split_events(prof.events())
    assert got["attention"] > 0 and got["optimizer"] > 0
    step(input_ids=ids, labels=ids)                       # not profiled: the same kernels, no events
