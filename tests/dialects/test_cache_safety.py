"""The compile cache can never corrupt or hijack a run, and background workers never outlive their owner.

- A cache made under one vector ISA (AVX-512) and reused under another (`ATEN_CPU_CAPABILITY=avx2`), in
  processes sharing one KILN_CACHE_DIR and one TORCHINDUCTOR_CACHE_DIR, trains exactly like eager
  torch.optim.AdamW, static and dynamic programs alike (each machine has its own folder; each kernel records
  the ISA it was generated for; Inductor's own FX-graph cache, keyed without the ISA, is never consulted).
- Cached code is executed only if the cache's index records its sha256: a planted or tampered file never
  runs (it would write a marker).
- The cache is used only if private (0700, ours, written by no one else); writes that fail leave no
  temporary file.
- A background worker dies with its training process (kill -9, SIGTERM), is stopped when its step is
  garbage collected, leaves no file behind, and an interrupted start never leaves tuning pending.
"""
from __future__ import annotations

import copy
import errno
import gc
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kiln
from kiln.dialects import background, inductor, measure, tuning
from tests.passes.test_regions import _graph_with_layer_norm_chain

ROOT = Path(kiln.__file__).resolve().parents[1]

# the model of the subprocess tests (and of the in-process ones): layer norms whose regions Inductor compiles
NET = '''
import torch
class Net(torch.nn.Module):
    def __init__(self, widths=(32,)):
        super().__init__()
        layers, d = [], 16
        for w in widths:
            layers += [torch.nn.Linear(d, w), torch.nn.LayerNorm(w), torch.nn.GELU()]
            d = w
        self.body, self.head = torch.nn.Sequential(*layers), torch.nn.Linear(d, 4)
    def forward(self, x):
        return self.head(self.body(x))
def loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)
def data():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randint(0, 4, (8,))
'''
_ns: dict = {}
exec(NET, _ns)
Net, _loss, _data = _ns["Net"], _ns["loss"], _ns["data"]


def _env(cache: Path, **extra) -> dict:
    drop = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "KILN_DIALECTS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(KILN_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "torchinductor"),
               PYTHONPATH=str(ROOT), KILN_KEEP="all", **extra)
    return env


def _eager_adamw(model, args, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        _loss(model, *args).backward()
        opt.step()
    return model


def _assert_trained_like_eager(model, ref, args, steps):
    _eager_adamw(ref, args, steps)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if p.name.startswith(".jobs.") or p.suffix in (".log", ".tmp"))


# ---- one cache, two vector ISAs ------------------------------------------------------------------------
TRAIN = NET + '''
import copy, sys
import kiln
torch.set_num_threads(2)
model = Net()
ref = copy.deepcopy(model)
x, y = data()
# three steps of one size (a static program), then sizes that make the batch dimension dynamic: with
# Inductor's FX-graph cache shared between ISAs, the dynamic kernel made under AVX2 corrupted the heap of
# the AVX-512 run ("double free or corruption")
batches = [(x, y)] * 3 + [(torch.cat([x] * 4)[:n], torch.cat([y] * 4)[:n]) for n in (11, 13, 29)]
step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=loss, dialects=["inductor", "aten"],
                    tuning="ahead")
for batch in batches:
    step(*batch)
kernels = sum(r.compiled is not None for r in step.last.regions)
assert len(step.cache_info().programs) == 2, step.cache_info()
opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
for batch in batches:
    opt.zero_grad()
    loss(ref, *batch).backward()
    opt.step()
worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
print(torch.backends.cpu.get_cpu_capability(), kernels, worst, flush=True)
assert kernels, "no region was compiled"
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
'''


@pytest.mark.inductor
@pytest.mark.parametrize("first,second", [(None, "avx2"), ("avx2", None)], ids=["native-then-avx2", "avx2-then-native"])
def test_a_cache_made_under_one_vector_isa_trains_exactly_under_the_other(tmp_path, first, second):
    """On an AVX-512 machine the two runs use different kernels (16 lanes, 8 lanes); on an AVX2-only
    machine both are AVX2 and the test still holds."""
    cache, seen = tmp_path / "cache", set()
    for isa in (first, second):
        env = _env(cache, **({"ATEN_CPU_CAPABILITY": isa, "ONEDNN_MAX_CPU_ISA": isa.upper()} if isa else {}))
        run = subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, f"ISA {isa or 'native'}: {run.stdout[-2000:]}{run.stderr[-3000:]}"
        seen.add(run.stdout.split()[0].lower())
    # one folder per machine fingerprint, named after the ISA it ran under
    assert {p.name.split("-")[0] for p in (cache / "inductor").glob("torch-*/*")} == seen


@pytest.mark.inductor
def test_a_kernel_recorded_for_another_isa_or_configuration_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")
    region = _fused_chain()
    index = json.loads((inductor.cache_dir() / measure.INDEX).read_text())
    index[f"{region.key}.py"]["facts"]["isa"] = "avx512 from another machine"
    (inductor.cache_dir() / measure.INDEX).write_text(json.dumps(index))
    compiled = []
    real = inductor._compile_source
    monkeypatch.setattr(inductor, "_compile_source", lambda r: compiled.append(r.key) or real(r))
    again = _fused_chain()
    assert compiled == [region.key] and again.compiled is not None


# ---- cached code is executed only if Kiln wrote it ----------------------------------------------------
def _fused_chain():
    """The layer-norm chain of test_regions with its region fused (None if it was not): checked against
    its ATen ops."""
    from kiln.passes.dispatch import dispatch
    from kiln.passes.regions import Region
    from kiln.runtime.codegen import generate
    from tests.passes.graphs import fuse_regions
    g, tensors = _graph_with_layer_norm_chain()
    ref = copy.deepcopy(g)
    dispatch(ref, ("aten",))
    want = generate(ref, return_all=True)[1](*tensors)
    fuse_regions(g, ("inductor", "aten"))
    for got, exp in zip(generate(g, return_all=True)[1](*tensors), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    regions = [n.target for n in g.nodes if isinstance(n.target, Region)]
    assert len(regions) <= 1
    return regions[0] if regions else None


def _payload(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('executed')\ndef call(args):\n    raise RuntimeError('planted')\n"


@pytest.mark.inductor
def test_planted_or_tampered_cache_code_is_never_executed(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KILN_KEEP", "all")
    marker = tmp_path / "executed"
    # the key of the region, from a first cache
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "first"))
    key = _fused_chain().key
    source = (inductor.cache_dir() / f"{key}.py").read_text()

    # planted: a .py under the region's key in a cache Kiln has never written to
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "planted"))
    inductor.cache_dir().mkdir(parents=True, exist_ok=True)
    (inductor.cache_dir() / f"{key}.py").write_text(_payload(marker))
    region = _fused_chain()
    assert not marker.exists(), "planted code was executed"
    assert region is not None and region.compiled is not None and region.failed is None
    assert any("ignoring" in r.getMessage() and f"{key}.py" in r.getMessage() for r in caplog.records)
    assert (inductor.cache_dir() / f"{key}.py").read_text() == source          # compiled again, stored anew

    # tampered: code added to the file Kiln wrote (its index entry stays)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "first"))
    path = inductor.cache_dir() / f"{key}.py"
    path.write_text(source + "\n" + _payload(marker))
    region = _fused_chain()
    assert not marker.exists(), "tampered code was executed"
    assert region is not None and region.compiled is not None and region.failed is None
    # what is cached now is Kiln's own again, and loads without compiling
    monkeypatch.setattr(inductor, "_compile_source", lambda r: pytest.fail("compiled despite a valid cache"))
    assert path.read_text() == source and _fused_chain().compiled is not None


def test_only_what_the_index_records_is_loaded(tmp_path):
    facts = {"isa": "test"}
    assert measure.store_artifact(tmp_path, "a.py", "x = 1\n", facts)
    assert measure.load_artifact(tmp_path, "a.py", facts) == "x = 1\n"
    assert measure.load_artifact(tmp_path, "a.py", {"isa": "other"}) is None
    (tmp_path / "a.py").write_text("x = 2\n")
    assert measure.load_artifact(tmp_path, "a.py", facts) is None
    (tmp_path / "b.py").write_text("x = 1\n")                 # same content, never recorded under this name
    assert measure.load_artifact(tmp_path, "b.py") is None


# ---- a private cache folder --------------------------------------------------------------------------
def test_the_cache_folder_is_created_private(tmp_path, monkeypatch):
    root = tmp_path / "kiln"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    folder = measure.cache_dir("kernels")
    measure.timed_once(folder, "k", lambda: {"a_ms": 1.0})
    assert folder.is_relative_to(root)
    parts = folder.relative_to(root).parts
    for level in [root] + [root.joinpath(*parts[:i + 1]) for i in range(len(parts))]:
        assert stat.S_IMODE(level.stat().st_mode) == 0o700, level
    assert stat.S_IMODE((folder / "k.timing.json").stat().st_mode) == 0o600
    assert folder.parent.name == f"torch-{torch.__version__}" and folder.name == measure.machine()


def test_the_machine_folder_changes_with_kilns_kernel_sources(tmp_path, monkeypatch):
    """Timings made against other versions of Kiln's kernels (a native loop or the Python around it edited) are
    not this version's: the folder's name changes with them, and with nothing else of theirs."""
    import shutil

    from kiln.kernels import native_build
    before = measure.machine()
    for path in [*native_build.SOURCES, *native_build.HERE.glob("*.py")]:
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(native_build, "HERE", tmp_path)
    monkeypatch.setattr(native_build, "SOURCES", tuple(tmp_path / p.name for p in native_build.SOURCES))
    try:
        for edited, changes in ((None, False), ("rope.py", True), ("native_amx.c", True)):
            if edited:
                (tmp_path / edited).write_text((tmp_path / edited).read_text() + "\n")
            measure._kernel_sources.cache_clear()
            assert (measure.machine() != before) == changes, edited
    finally:
        measure._kernel_sources.cache_clear()


@pytest.mark.parametrize("mode", [0o777, 0o770, "foreign"], ids=["world-writable", "group-writable", "foreign-owner"])
def test_a_cache_others_can_write_is_not_used(tmp_path, monkeypatch, caplog, mode):
    root = tmp_path / "shared"
    root.mkdir()
    if mode == "foreign":
        if not hasattr(os, "getuid") or os.getuid() != 0:
            pytest.skip("giving the folder to another user needs root")
        os.chown(root, 12345, -1)
    else:
        root.chmod(mode)
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    getattr(measure, "_refused", set()).discard(str(root))
    caplog.set_level(logging.WARNING, logger="kiln")
    folders = [measure.cache_dir("kernels"), measure.cache_dir("inductor")]
    assert not any(f.is_relative_to(root) for f in folders)
    warned = [r for r in caplog.records if "not using the compile cache" in r.getMessage()]
    assert len(warned) == 1 and str(root) in warned[0].getMessage()
    # the run goes on without it: measured kernels are measured (and cached privately), training is right
    model, args = Net(), _data()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["onednn", "aten"],
                        tuning="ahead")
    for _ in range(2):
        step(*args)
    _assert_trained_like_eager(model, ref, args, 2)
    assert list(root.iterdir()) == []


# ---- failing writes leave no temporary file ----------------------------------------------------------
def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_no_temporary_file_leaks_when_writes_fail(tmp_path, monkeypatch, failing):
    real_fdopen = os.fdopen
    if failing == "write":
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FullFile(real_fdopen(fd, *a, **k)))
    else:
        monkeypatch.setattr(os, "replace", _full_disk)
    assert not measure.write_atomic(tmp_path, "a.json", "{}")
    assert list(tmp_path.iterdir()) == []
    assert not measure.store_artifact(tmp_path, "a.py", "x = 1\n", {})
    assert list(tmp_path.iterdir()) == []


def test_an_artifact_whose_index_cannot_be_written_is_removed(tmp_path, monkeypatch):
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: _full_disk() if Path(b).name == measure.INDEX else real(a, b))
    assert not measure.store_artifact(tmp_path, "a.py", "x = 1\n", {})
    assert list(tmp_path.iterdir()) == []


def test_a_training_on_a_full_disk_leaks_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "replace", _full_disk)
    model, args = Net(), _data()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["onednn", "aten"],
                        tuning="ahead")
    for _ in range(2):
        step(*args)
    _assert_trained_like_eager(model, ref, args, 2)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# ---- background workers ------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


WIDE = (32, 48, 64, 80)          # four blocks of distinct widths: a worker with several seconds of compiling

TRAIN_ONLINE = NET + f'''
import sys, time
import kiln
model = Net({WIDE})
step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=loss, dialects=["inductor", "aten"],
                    tuning="online")
step(*data())                       # starts the worker
(worker,) = [w for w in step.tuner.workers if w.proc is not None]
print(worker.proc.pid, flush=True)
sys.stdin.readline()                # killed here, or told to exit normally
'''


@pytest.mark.inductor
@pytest.mark.parametrize("how", ["kill -9", "SIGTERM", "exit"])
def test_a_worker_dies_with_its_training_process(tmp_path, how):
    cache, err = tmp_path / "cache", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", TRAIN_ONLINE], env=_env(cache), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit(), err.read_text()[-3000:]
        worker = int(line)
        assert _alive(worker)
        if how == "exit":
            child.stdin.write("\n")
            child.stdin.flush()
        else:
            child.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
        child.wait(timeout=60)
        assert _gone_within(worker, 5.0), f"the worker {worker} outlived its training process ({how})"
    finally:
        child.kill()
        child.wait()
    assert _leftovers(cache) == []


def _online_step(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setenv("KILN_KEEP", "all")                # no region is dropped as too cheap: a worker starts
    model, args = Net(), _data()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["inductor", "aten"])
    return step, model, ref, args


@pytest.mark.inductor
def test_a_worker_is_stopped_when_its_step_is_garbage_collected(monkeypatch, tmp_path):
    step, *_, args = _online_step(monkeypatch, tmp_path)
    step(*args)
    (worker,) = [w for w in step.tuner.workers if w.proc is not None]
    pid = worker.proc.pid
    assert _alive(pid)
    del step, worker
    gc.collect()
    assert _gone_within(pid, 5.0), "the worker of a collected step still runs"
    assert _leftovers(tmp_path) == [] and not tuning.busy()


def _in_worker_start() -> bool:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not background.Worker.start.__code__:
        frame = frame.f_back
    return frame is not None


@pytest.mark.inductor
@pytest.mark.parametrize("where", ["pickle.dump", "Popen", "_take_core"])
def test_an_interrupted_start_never_leaves_tuning_pending(monkeypatch, tmp_path, caplog, where):
    step, model, ref, args = _online_step(monkeypatch, tmp_path)
    spawned = []
    owner, name = {"pickle.dump": (background.pickle, "dump"), "Popen": (background.subprocess, "Popen"),
                   "_take_core": (background, "_take_core")}[where]
    real = getattr(owner, name)

    def interrupted(*a, **k):             # the first call in Worker.start is interrupted
        if not _in_worker_start():
            return real(*a, **k)
        monkeypatch.setattr(owner, name, real)
        if where == "_take_core":
            spawned.extend(w.proc.pid for w in step.tuner.workers if w.proc is not None)
        raise KeyboardInterrupt
    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(*args)                       # the step ran; starting its worker was interrupted
    assert any("cannot start the background compilation" in r.getMessage() for r in caplog.records)
    for _ in range(2):
        step(*args)
    assert step.pending_tuning() == []    # settled: the regions run their ATen ops
    assert all(r.failed is not None and r.compiled is None for r in step.last.regions)
    _assert_trained_like_eager(model, ref, args, 3)
    assert all(_gone_within(pid, 5.0) for pid in spawned)
    assert _leftovers(tmp_path) == [] and not tuning.busy()
