"""Corpora of real model source for evaluating `kiln adopt`: transformers releases, read as data.

`corpus_root("5.24.0")` is the installed transformers when that is the version; any other version
is fetched once with `pip download transformers==V --no-deps` and unpacked (never imported) under
`$KILN_CORPUS_DIR` (default `~/.cache/kiln/corpus`). `modeling_files(root)` lists the PyTorch
modeling files (`models/**/modeling_*.py`, deprecated models included, without the TensorFlow/Flax ones).

`evaluate(files, rules)` runs the rules over each file and collects matches, refusals and run time
per file; `score(labels, matches)` compares matches with a labelled set (docs/adopt-labels.md) and
gives precision and recall per rule. `benchmarks/adopt_corpus.py` is the command line around both.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError

RULE_ORDER = ["sdpa", "gelu_tanh", "gelu_erf", "silu", "rms_norm", "fused_qkv", "dropout_add_layernorm",
              "linear_gelu", "swiglu", "rope", "linear_cross_entropy", "cross_entropy"]


class CorpusError(KilnError):
    """A corpus that cannot be found or fetched."""


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CORPUS_DIR") or Path.home() / ".cache" / "kiln" / "corpus")


def corpus_root(version: str) -> Path:
    """The `transformers` package directory of that release (installed, or downloaded and unpacked)."""
    try:
        import transformers
        if transformers.__version__ == version:
            return Path(transformers.__file__).parent
    except ImportError:
        pass
    target = cache_dir() / f"transformers-{version}"
    root = target / "transformers"
    if (target / ".complete").exists():
        return root
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-deps",
               "--only-binary", ":all:", "-d", tmp, "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("transformers-*.whl"))
        if done.returncode != 0 or not wheels:
            raise CorpusError(f"cannot download transformers=={version} with pip: "
                              f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no wheel'}")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as z:   # data only: the .py files of the package
            z.extractall(unpacked, [n for n in z.namelist() if n.startswith("transformers/") and n.endswith(".py")])
        if target.exists():
            shutil.rmtree(target)
        os.replace(unpacked, target)
    (target / ".complete").write_text(version + "\n")
    return root


def modeling_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("models/**/modeling_*.py")
                  if not p.name.startswith(("modeling_tf_", "modeling_flax_")))


@dataclass
class FileResult:
    path: str                      # relative to the corpus root
    seconds: float
    matches: list = field(default_factory=list)     # Match.to_json() dicts
    error: str | None = None       # the file could not be parsed / rewritten (reported, not fatal)


def evaluate(root: Path, files: list[Path], rules=None, progress=None) -> list[FileResult]:
    from kiln.adopt.rewrite import AdoptError, rewrite_source

    out = []
    for i, path in enumerate(files):
        rel = str(path.relative_to(root))
        start = time.perf_counter()
        try:
            _, matches = rewrite_source(path.read_text(encoding="utf-8"), rules, filename=str(path))
            result = FileResult(rel, 0.0, [m.to_json() for m in matches])
        except (AdoptError, OSError, UnicodeDecodeError, ValueError) as exc:
            result = FileResult(rel, 0.0, error=str(exc))
        except Exception as exc:  # a crash in a rule is a bug: report it with the file, keep going
            result = FileResult(rel, 0.0, error=f"CRASH {type(exc).__name__}: {exc}")
        result.seconds = time.perf_counter() - start
        out.append(result)
        if progress is not None:
            progress(i + 1, len(files), result)
    return out


def summarize(results: list[FileResult]) -> dict:
    """Per rule: matches, applied, refused (with reasons counted); per file: seconds; errors."""
    per_rule: dict = {r: {"matches": 0, "applied": 0, "refused": 0, "reasons": Counter()} for r in RULE_ORDER}
    for res in results:
        for m in res.matches:
            row = per_rule.setdefault(m["rule"], {"matches": 0, "applied": 0, "refused": 0, "reasons": Counter()})
            row["matches"] += 1
            if m["applied"]:
                row["applied"] += 1
            else:
                row["refused"] += 1
                row["reasons"][_reason_class(m["reason"])] += 1
    times = sorted(r.seconds for r in results)
    return {
        "files": len(results),
        "errors": [{"file": r.path, "error": r.error} for r in results if r.error],
        "seconds_total": round(sum(times), 2),
        "seconds_per_file_median": round(times[len(times) // 2], 3) if times else 0.0,
        "seconds_per_file_max": round(times[-1], 3) if times else 0.0,
        "slowest_file": max(results, key=lambda r: r.seconds).path if results else None,
        "rules": {r: {**row, "reasons": dict(row["reasons"].most_common())} for r, row in per_rule.items()},
    }


def _reason_class(reason: str | None) -> str:
    """Group refusals by their text without the file-specific details (line numbers, names)."""
    if not reason:
        return "(none)"
    text = re.sub(r"line \d+", "line N", reason)
    text = re.sub(r"`[^`]*`", "`...`", text)
    return text[:160]


# -- labelled development set --------------------------------------------------------------------

def load_labels(folder: Path) -> list[dict]:
    """Every labelled file of tests/data/adopt-labels/*.json: {"corpus", "path", "locations"}."""
    files = []
    for part in sorted(Path(folder).glob("*.json")):
        try:
            files += json.loads(part.read_text())["files"]
        except (ValueError, KeyError) as exc:
            raise CorpusError(f"{part}: not a label file ({exc})") from None
    return files


def location_set(locations) -> set:
    return {(loc["rule"], loc.get("class"), loc["method"]) for loc in locations}


def score(labelled: list[dict], found: dict) -> dict:
    """Precision/recall per rule. `found[(corpus, path)]` is the set of (rule, class, method) matched.

    A location counts as found whether or not it was rewritten (detection is what is scored;
    applied counts are reported by `summarize`)."""
    tp, fp, fn = Counter(), Counter(), Counter()
    misses, extras = defaultdict(list), defaultdict(list)
    for entry in labelled:
        key = (entry["corpus"], entry["path"])
        truth, got = location_set(entry["locations"]), found.get(key, set())
        for loc in got & truth:
            tp[loc[0]] += 1
        for loc in got - truth:
            fp[loc[0]] += 1
            extras[loc[0]].append((*key, loc[1], loc[2]))
        for loc in truth - got:
            fn[loc[0]] += 1
            misses[loc[0]].append((*key, loc[1], loc[2]))
    rules = {}
    for r in RULE_ORDER:
        rules[r] = {"labelled": tp[r] + fn[r], "found": tp[r] + fp[r], "true_positives": tp[r],
                    "precision": tp[r] / (tp[r] + fp[r]) if tp[r] + fp[r] else None,
                    "recall": tp[r] / (tp[r] + fn[r]) if tp[r] + fn[r] else None,
                    "false_positives": extras[r], "missed": misses[r]}
    t, p, n = sum(tp.values()), sum(fp.values()), sum(fn.values())
    return {"rules": rules, "precision": t / (t + p) if t + p else None, "recall": t / (t + n) if t + n else None,
            "labelled": t + n, "found": t + p, "files": len(labelled)}
