"""The model zoo: sizes, overrides, determinism, and that every entry trains."""
import math

import pytest
import torch

from kiln.bench import zoo


def test_default_sizes():
    p = zoo.resolve("llama")
    assert p == dict(layers=4, hidden=512, heads=8, vocab=8192, batch=8, seq=256, intermediate=1408)
    assert zoo.resolve("llama-32k")["vocab"] == 32000
    assert zoo.resolve("gpt2-50k", "tiny")["vocab"] == 50257
    assert zoo.resolve("gpt2")["intermediate"] == 2048
    assert zoo.resolve("llama", hidden=1024)["intermediate"] == 2752  # 8/3*1024 rounded up to 64
    entry = zoo.get("llama", batch=4, seq=128)
    assert entry.items_per_batch == 512 and entry.unit == "tokens"
    assert zoo.get("vit").unit == "samples"


@pytest.mark.parametrize("bad, message", [
    (dict(name="nope"), "unknown model"), (dict(name="llama", batch=0), "--batch must be positive"),
    (dict(name="llama", heads=5), "divisible"), (dict(name="llama", size="huge"), "unknown size"),
    (dict(name="vit", seq=100), "multiple of its patch"),
])
def test_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        zoo.resolve(**bad)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_model_trains(name):
    entry = zoo.get(name, "tiny")
    model = entry.build_model()
    batch = entry.build_batch(0)
    assert all(torch.equal(a, b) for a, b in zip(batch.values(), entry.build_batch(0).values()))
    assert any(not torch.equal(a, b) for a, b in zip(batch.values(), entry.build_batch(1).values()))
    loss = model(**batch).loss
    loss.backward()
    assert math.isfinite(loss.item())
    # Random init over V classes/tokens: the loss starts near ln(V).
    assert abs(loss.item() - math.log(entry.params["vocab"])) < 1.5
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_models_are_seeded():
    a, b = zoo.get("gpt2", "tiny").build_model(), zoo.get("gpt2", "tiny").build_model()
    c = zoo.get("gpt2", "tiny", seed=1).build_model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
