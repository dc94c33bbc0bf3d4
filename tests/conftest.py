import logging
import os
import warnings

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _own_compile_cache(tmp_path_factory):
    """Kiln's caches (compiled regions, kernel timings) start empty for every test session."""
    if "KILN_CACHE_DIR" not in os.environ:
        os.environ["KILN_CACHE_DIR"] = str(tmp_path_factory.mktemp("kiln-cache"))
    # kernels measured before the first step: a test's numerics must not depend on when a measurement
    # finished (tests of online tuning set it themselves)
    if not os.environ.get("KILN_TUNING"):
        os.environ["KILN_TUNING"] = "ahead"
    yield


@pytest.fixture(autouse=True)
def _regions_only_where_asked(request, monkeypatch):
    """The inductor dialect compiles C++ for every new fused region (about a second each): tests that
    are about it are marked `inductor`; the others compile without it (KILN_DIALECTS=-inductor)."""
    if request.node.get_closest_marker("inductor") is None:
        monkeypatch.setenv("KILN_DIALECTS", "-inductor")
    else:
        monkeypatch.delenv("KILN_DIALECTS", raising=False)
    yield


@pytest.fixture
def kiln_log(caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    return caplog
