"""Real data: scikit-learn's digits. Kiln's loss curve follows eager PyTorch's, and the model learns."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

datasets = pytest.importorskip("sklearn.datasets")


def digits():
    d = datasets.load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def test_digits_loss_curve_matches_eager_and_converges():
    (xtr, ytr), (xte, yte) = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Dropout(0.0), nn.Linear(128, 10))
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=3e-3, weight_decay=0.01, max_grad_norm=1.0), loss_fn=ce)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    kiln_curve, eager_curve = [], []
    batch = 100
    for epoch in range(4):
        for i in range(0, len(xtr), batch):
            xb, yb = xtr[i:i + batch], ytr[i:i + batch]
            kiln_curve.append(step(xb, yb).item())
            opt.zero_grad()
            loss = ce(ref, xb, yb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            eager_curve.append(loss.item())
    torch.testing.assert_close(torch.tensor(kiln_curve), torch.tensor(eager_curve), rtol=2e-3, atol=1e-4)
    assert sum(kiln_curve[-5:]) / 5 < 0.25 * kiln_curve[0]
    model.eval()
    with torch.no_grad():
        accuracy = (model(xte).argmax(-1) == yte).float().mean().item()
    assert accuracy > 0.9, accuracy
