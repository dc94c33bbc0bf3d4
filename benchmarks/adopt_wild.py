"""`kiln adopt` on code it has never seen: single-file models from PyPI, labelled by reading.

    python benchmarks/adopt_wild.py                      # fetch (once), score, verify every rewrite
    python benchmarks/adopt_wild.py --json wild.json --no-verify

The packages and files are listed, with their licences and the labels, in
tests/data/adopt-wild/labels.json.  Each package is fetched once with `pip download <name>==<version>
--no-deps` into `$KILN_WILD_DIR` (default ~/.cache/kiln/wild) and its .py files unpacked there: read
as data, never installed, nothing of them is kept in this repository.

Reported: per rule, precision and recall of the locations found (rewritten or reported with a reason)
against the labels; how many labelled locations were rewritten; the hand-written attentions rewritten
by sdpa; and for every file that changed, the fp32 equivalence checks of the labels (the original and
the rewritten module built with the same weights, in train mode: outputs and every gradient, per
tensor max|diff| <= 1e-5 + 1e-5 * max|original|).  Packages' missing third-party imports (fairscale,
tqdm) are replaced by small stand-ins defined here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LABELS = ROOT / "tests" / "data" / "adopt-wild" / "labels.json"
TOL = 1e-5


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_WILD_DIR") or Path.home() / ".cache" / "kiln" / "wild")


def fetch(name: str, version: str) -> Path:
    """The unpacked .py files of name==version (downloaded once)."""
    target = cache_dir() / f"{name}-{version}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
                               "-d", tmp, "-q"], capture_output=True, text=True)
        files = [p for p in Path(tmp).iterdir() if p.suffix in (".whl", ".gz")]
        if done.returncode != 0 or not files:
            raise SystemExit(f"adopt_wild: cannot download {name}=={version}: "
                             f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        out = Path(tmp) / "unpacked"
        if files[0].suffix == ".whl":
            with zipfile.ZipFile(files[0]) as z:
                z.extractall(out, [n for n in z.namelist() if n.endswith(".py")])
        else:                              # an sdist: <name>-<version>/<package>/...
            with tarfile.open(files[0]) as t:
                members = [m for m in t.getmembers() if m.name.endswith(".py") and m.isfile()]
                t.extractall(out, members, filter="data")
            inner = [p for p in out.iterdir() if p.is_dir()]
            if len(inner) == 1:
                out = inner[0]
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    (target / ".complete").write_text(f"{name}=={version}\n")
    return target


# -- scoring -------------------------------------------------------------------------------------

def score(packages: list, results: dict) -> dict:
    """Per rule: labelled, found, true positives, rewritten; the misses and extras by name."""
    rows: dict = {}
    misses, extras = [], []
    attentions = Counter()

    def row(rule):
        return rows.setdefault(rule, Counter())
    for pkg in packages:
        for f in pkg["files"]:
            matches = results[(pkg["name"], f["path"])]["matches"]
            found = {(m["rule"], m["class"], m["method"]) for m in matches}
            applied = {(m["rule"], m["class"], m["method"]) for m in matches if m["applied"]}
            truth = {(loc["rule"], loc["class"], loc["method"]): loc for loc in f["locations"]}
            for key, loc in truth.items():
                r = row(key[0])
                r["labelled"] += 1
                r["expect_rewritten"] += loc["expect"] == "rewritten"
                if key in found:
                    r["true_positives"] += 1
                    r["rewritten"] += key in applied
                else:
                    misses.append(f"{pkg['name']} {f['path']} {key}")
                if key[0] == "sdpa":
                    here = [m for m in matches if (m["rule"], m["class"], m["method"]) == key]
                    attentions["labelled"] += loc.get("attentions", 1)
                    attentions["found"] += len(here)
                    attentions["rewritten"] += sum(m["applied"] for m in here)
            for key in found - set(truth):
                row(key[0])["false_positives"] += 1
                extras.append(f"{pkg['name']} {f['path']} {key}")
    tp = sum(r["true_positives"] for r in rows.values())
    fp = sum(r["false_positives"] for r in rows.values())
    labelled = sum(r["labelled"] for r in rows.values())
    return {"rules": {k: dict(v) for k, v in sorted(rows.items())}, "misses": misses, "extras": extras,
            "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / labelled if labelled else None,
            "rewritten": sum(r["rewritten"] for r in rows.values()),
            "expect_rewritten": sum(r["expect_rewritten"] for r in rows.values()),
            "attentions": dict(attentions)}


# -- equivalence checks --------------------------------------------------------------------------

def install_stubs(names) -> None:
    """Stand-ins for third-party modules the packages import but this environment lacks."""
    import torch

    if "tqdm" in names and "tqdm" not in sys.modules:
        tqdm = types.ModuleType("tqdm")
        tqdm.tqdm = lambda it=None, *a, **k: it
        sys.modules["tqdm"] = tqdm
    if "torchvision" in names and "torchvision" not in sys.modules:
        # open_clip's utils import a torchvision layer the checked classes do not use
        frozen = type("FrozenBatchNorm2d", (torch.nn.Module,), {})
        for name, attrs in (("torchvision", {}), ("torchvision.ops", {}),
                            ("torchvision.ops.misc", {"FrozenBatchNorm2d": frozen})):
            module = types.ModuleType(name)
            module.__path__ = []
            module.__dict__.update(attrs)
            sys.modules[name] = module
    if "litgpt_scripts" in names and "litgpt.scripts.convert_hf_checkpoint" not in sys.modules:
        # litgpt.model imports one checkpoint helper from a script that needs lightning
        for name, attrs in (("litgpt.scripts", {}),
                            ("litgpt.scripts.convert_hf_checkpoint", {"qkv_reassemble": lambda *a, **k: None})):
            module = types.ModuleType(name)
            module.__path__ = []
            module.__dict__.update(attrs)
            sys.modules[name] = module
    if "fairscale" in names and "fairscale" not in sys.modules:
        class ColumnParallelLinear(torch.nn.Linear):      # one process: a plain Linear
            def __init__(self, in_features, out_features, bias=True, gather_output=True, init_method=None, **_):
                super().__init__(in_features, out_features, bias=bias)

        class RowParallelLinear(torch.nn.Linear):
            def __init__(self, in_features, out_features, bias=True, input_is_parallel=False, init_method=None, **_):
                super().__init__(in_features, out_features, bias=bias)

        class VocabParallelEmbedding(torch.nn.Embedding):
            def __init__(self, num, dim, init_method=None, **_):
                super().__init__(num, dim)
        layers = types.SimpleNamespace(ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear,
                                       VocabParallelEmbedding=VocabParallelEmbedding)
        init = types.SimpleNamespace(get_model_parallel_world_size=lambda: 1, get_model_parallel_rank=lambda: 0)
        for name, attrs in (("fairscale", {}), ("fairscale.nn", {}), ("fairscale.nn.model_parallel", {}),
                            ("fairscale.nn.model_parallel.layers", vars(layers)),
                            ("fairscale.nn.model_parallel.initialize", vars(init))):
            module = types.ModuleType(name)
            module.__path__ = []
            module.__dict__.update(attrs)
            sys.modules[name] = module
        sys.modules["fairscale.nn.model_parallel"].initialize = sys.modules["fairscale.nn.model_parallel.initialize"]


def load(root: Path, rel: str, text: str, suffix: str):
    """`rel` (a file of the unpacked package) as a module, its packages registered without running
    their __init__ (so relative imports work and nothing else of the package is imported)."""
    parts = rel[:-3].split("/")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[:i]))]
            sys.modules[name] = package
    name = ".".join(parts) + suffix
    path = Path(tempfile.mkdtemp(prefix="kiln-wild-")) / Path(rel).name
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_check(check: dict, original, rewritten) -> dict:
    """Build both (same weights), run forward and backward on the same inputs; max diffs."""
    import torch

    from kiln.adopt.verify import _tensors

    def make(m):
        torch.manual_seed(0)
        env = {"m": m, "torch": torch, "types": types}
        if "call" in check:
            return eval(check["call"], env)
        model = eval(check["build"], env).train()
        if check.get("setup"):
            exec(check["setup"], {**env, "model": model})
        return model
    ref, new = make(original), make(rewritten)
    if isinstance(ref, torch.nn.Module):
        with torch.no_grad():                 # non-trivial weights: no ones/zeros initializations
            for p in ref.parameters():
                p.add_(0.1 * torch.randn_like(p))
        new.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    inputs = eval(check["inputs"], {"m": original, "torch": torch, "types": types})
    out = {}
    runs = {}
    for label, fn in (("original", ref), ("rewritten", new)):
        args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in inputs]
        try:
            torch.manual_seed(2)
            result = fn(*args)
            outputs = [t for t in _tensors(result) if t.is_floating_point()]
            sum(t.float().sum() for t in outputs if t.requires_grad).backward()
            outputs = [t.detach() for t in outputs]
        except Exception as exc:
            out[f"{label}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
        if isinstance(fn, torch.nn.Module):
            grads += [p.grad for p in fn.parameters() if p.grad is not None]
        runs[label] = (outputs, grads)
    if len(runs) != 2:
        out["equal"] = None
        return out
    (oa, ga), (ob, gb) = runs["original"], runs["rewritten"]
    worst_out = max((float((b - a).abs().max() / (1 + a.abs().max())) for a, b in zip(oa, ob)), default=0.0)
    worst_grad = max((float((b - a).abs().max() / (1 + a.abs().max())) for a, b in zip(ga, gb)), default=0.0)
    out.update({"outputs": len(oa), "grads": len(ga), "max_output_diff": worst_out, "max_grad_diff": worst_grad,
                "equal": len(oa) == len(ob) and len(ga) == len(gb) and max(worst_out, worst_grad) <= TOL})
    return out


# -- main ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=Path, default=LABELS)
    ap.add_argument("--json", type=Path, help="write the full result as JSON")
    ap.add_argument("--no-verify", action="store_true", help="score only; skip the fp32 equivalence checks")
    args = ap.parse_args(argv)
    from kiln.adopt import rewrite_source

    packages = json.loads(args.labels.read_text())["packages"]
    results, checks = {}, []
    for pkg in packages:
        root = fetch(pkg["name"], pkg["version"])
        for f in pkg["files"]:
            path = root / f["path"]
            text = path.read_text(encoding="utf-8")
            new, matches = rewrite_source(text, None, filename=str(path))
            results[(pkg["name"], f["path"])] = {"matches": [m.to_json() for m in matches], "changed": new != text,
                                                 "text": text, "new": new}
        if args.no_verify:
            continue
        install_stubs(pkg.get("stubs", ()))
        sys.path.insert(0, str(root))
        for i, check in enumerate(pkg.get("checks", ())):
            res = results[(pkg["name"], check["file"])]
            what = {"package": pkg["name"], "file": check["file"], "what": check.get("build") or check.get("call")}
            try:
                original = load(root, check["file"], res["text"], f"_kiln_original{i}")
                rewritten = load(root, check["file"], res["new"], f"_kiln_adopted{i}")
            except Exception as exc:        # a missing dependency: say so, keep going
                checks.append({**what, "equal": None, "original_error": f"does not import ({exc})"})
                continue
            checks.append({**what, **run_check(check, original, rewritten)})
    summary = score(packages, results)
    print_report(packages, results, summary, checks)
    if args.json:
        payload = {"summary": summary, "checks": checks,
                   "matches": {f"{k[0]}:{k[1]}": v["matches"] for k, v in results.items()}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def print_report(packages, results, s, checks) -> None:
    print(f"\n## {len(packages)} packages, {len(results)} files; precision {s['precision']:.2f}, "
          f"recall {s['recall']:.2f} (found = rewritten or reported); rewritten {s['rewritten']} of "
          f"{s['expect_rewritten']} labelled rewritable\n")
    print("| rule | labelled | found | false positives | rewritten | labelled rewritable |")
    print("|---|---:|---:|---:|---:|---:|")
    for rule, r in s["rules"].items():
        print(f"| {rule} | {r.get('labelled', 0)} | {r.get('true_positives', 0)} | {r.get('false_positives', 0)} | "
              f"{r.get('rewritten', 0)} | {r.get('expect_rewritten', 0)} |")
    a = s["attentions"]
    print(f"\nsdpa: {a.get('rewritten', 0)} of {a.get('labelled', 0)} hand-written attentions rewritten "
          f"({a.get('found', 0)} found)")
    for line in s["misses"]:
        print(f"- missed: {line}")
    for line in s["extras"]:
        print(f"- not labelled: {line}")
    print("\n| package | file | rule | class.method | outcome |")
    print("|---|---|---|---|---|")
    for (name, path), res in results.items():
        for m in res["matches"]:
            where = f"{m['class']}.{m['method']}" if m["class"] else m["method"]
            print(f"| {name} | {path} | {m['rule']} | {where} | "
                  f"{'rewritten' if m['applied'] else 'reported: ' + m['reason']} |")
    if checks:
        print("\n| package | checked | outputs, grads | max output diff | max grad diff | equal |")
        print("|---|---|---|---:|---:|---|")
        for c in checks:
            if c.get("equal") is None:
                print(f"| {c['package']} | `{c['what']}` | - | - | - | not comparable: "
                      f"original {c.get('original_error', 'ran')}; rewritten {c.get('rewritten_error', 'ran')} |")
            else:
                print(f"| {c['package']} | `{c['what']}` | {c['outputs']}, {c['grads']} | {c['max_output_diff']:.1e} | "
                      f"{c['max_grad_diff']:.1e} | {'yes' if c['equal'] else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
