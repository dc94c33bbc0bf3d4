"""`kiln adopt --verify` against an older transformers release (4.35.2), next to the installed one.

    python benchmarks/adopt_verify_release.py --types bert,vit,roberta --json v435.json
    python benchmarks/adopt_verify_release.py --from-report corpus435.json     # every model type with an sdpa rewrite
    python benchmarks/adopt_verify_release.py --types bert,gpt2 --timing-size bench
    python benchmarks/adopt_verify_release.py --types bert --timing-size bench --rules sdpa   # one rule's cost

transformers 4.35.2 writes attention the way the 4.x releases did (the explicit path, with
`output_attentions` and head masks), which is what `kiln adopt` rewrites with its split; 5.x moved
to `eager_attention_forward`.  The release and the versions of its dependencies it needs are
installed once with `pip install --no-deps --target` into `$KILN_CORPUS_DIR/site-<version>`
(default ~/.cache/kiln/corpus), outside the repository and outside the shared environment: torch,
numpy and the rest come from the running interpreter, the pinned packages below shadow only
transformers and its hub client.  Each model type then runs `python -m kiln adopt --verify
transformers:<type>` with that directory first on PYTHONPATH; the results are collected in one table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what transformers 4.35.2 checks at import (tokenizers < 0.15, huggingface-hub < 1.0) and the hub
# client's own imports; everything else is taken from the running environment
PINNED = {"4.35.2": ["transformers==4.35.2", "tokenizers==0.14.1", "huggingface_hub==0.17.3", "requests==2.34.2",
                     "urllib3==2.8.0", "idna==3.20", "charset_normalizer==3.5.3", "certifi==2026.10.19.post1"]}


def site(version: str) -> Path:
    base = Path(os.environ.get("KILN_CORPUS_DIR") or Path.home() / ".cache" / "kiln" / "corpus")
    target = base / f"site-{version}"
    if not (target / ".complete").exists():
        target.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                               *PINNED[version]], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"adopt_verify_release: pip install failed: {done.stderr.strip()[-400:]}")
        (target / ".complete").write_text(version + "\n")
    return target


def types_from_report(path: Path) -> list[str]:
    """The modeling files that got an sdpa rewrite in a `kiln adopt --report` JSON of a corpus, by the
    name `--verify` takes for them (`modeling_data2vec_audio.py` -> data2vec_audio, the model type
    data2vec-audio)."""
    files = {Path(m["file"]) for m in json.loads(path.read_text())["matches"] if m["rule"] == "sdpa" and m["applied"]}
    return sorted({f.stem[len("modeling_"):] for f in files if f.name.startswith("modeling_")})


def verify(model_type: str, where: Path, timing_size: str | None, rules: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(where), str(ROOT)]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "kiln", "adopt", "--verify", f"transformers:{model_type}", "--json", str(out)]
        cmd += ["--timing-size", timing_size] if timing_size else ["--no-timing"]
        cmd += ["--rules", rules] if rules else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.exists():
            return json.loads(out.read_text())
        return {"model_type": model_type, "equivalent": None,
                "reason": (done.stderr.strip().splitlines() or ["no output"])[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="4.35.2", choices=sorted(PINNED))
    ap.add_argument("--types", help="comma-separated model types")
    ap.add_argument("--from-report", type=Path, help="a `kiln adopt --report` JSON: every type with an sdpa rewrite")
    ap.add_argument("--timing-size", choices=("small", "bench"), help="also time training steps (default: no timing)")
    ap.add_argument("--rules", help="comma-separated rules to apply (default: all built-in), as for kiln adopt")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    types = args.types.split(",") if args.types else types_from_report(args.from_report) if args.from_report else None
    if not types:
        ap.error("give --types or --from-report")
    where = site(args.version)
    results = []
    print("| model_type | class | sdpa rewrites run | rules applied | equivalent | max output diff | max grad diff "
          "| step ms before -> after |")
    print("|---|---|---|---|---|---:|---:|---|")
    for t in types:
        r = verify(t, where, args.timing_size, args.rules)
        results.append(r)
        sdpa = r.get("rule_counts", {}).get("sdpa", 0)
        not_run = [n for n in (r.get("rewrites_not_run") or [])]
        ran = f"{sdpa} ({len(not_run)} not run)" if not_run else str(sdpa)
        rules = ", ".join(f"{k} x{v}" for k, v in r.get("rule_counts", {}).items()) or "-"
        eq = {True: "yes", False: "NO", None: "n/a: " + str(r.get("reason"))[:80]}[r.get("equivalent")]
        diff = lambda k: "-" if r.get(k) is None else f"{r[k]:.1e}"  # noqa: E731
        step = (f"{r['step_time_before']:.0f} -> {r['step_time_after']:.0f} "
                f"({r['step_time_after'] / r['step_time_before']:.2f}x)") if r.get("step_time_before") else "-"
        print(f"| {r.get('model_type') or t} | {r.get('class', '-')} | {ran} | {rules} | {eq} | {diff('max_output_diff')} | "
              f"{diff('max_grad_diff')} | {step} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r.get("equivalent") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
