"""Evaluate `kiln adopt`'s rules on real model source: transformers releases and the labelled set.

    python benchmarks/adopt_corpus.py                       # transformers 4.35.2 and the installed 5.24.0
    python benchmarks/adopt_corpus.py --versions 5.24.0 --json corpus.json
    python benchmarks/adopt_corpus.py --labels tests/data/adopt-labels   # precision / recall only

For every PyTorch `modeling_*.py` of each release (4.35.2 is fetched once with `pip download` and
read as data, never imported), every built-in rule runs as `kiln adopt` would; the report gives
per rule the matches, how many were rewritten and the refusals grouped by reason, the run time per
file, and the files that could not be parsed (reported, not fatal). With --labels it scores the
matches against the labelled development set (docs/adopt-labels.md): precision and recall per rule,
with the missed and extra locations listed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.adopt import corpus  # noqa: E402

LABELS = Path(__file__).resolve().parent.parent / "tests" / "data" / "adopt-labels"


def run_corpus(version: str, quiet: bool) -> dict:
    root = corpus.corpus_root(version)
    files = corpus.modeling_files(root)
    print(f"transformers {version}: {len(files)} modeling files under {root}", file=sys.stderr)
    start = time.perf_counter()

    def progress(i, n, res):
        if not quiet and (i % 25 == 0 or i == n or res.error):
            note = f"  ERROR {res.path}: {res.error}" if res.error else ""
            print(f"  [{i}/{n}] {time.perf_counter() - start:.0f} s{note}", file=sys.stderr)

    results = corpus.evaluate(root, files, progress=progress)
    return {"version": version, **corpus.summarize(results),
            "per_file": [{"file": r.path, "seconds": round(r.seconds, 3), "matches": r.matches, "error": r.error}
                         for r in results]}


def run_labels(folder: Path) -> dict:
    labelled = corpus.load_labels(folder)
    found = {}
    for entry in labelled:
        root = corpus.corpus_root(entry["corpus"])
        res = corpus.evaluate(root, [root / entry["path"]])[0]
        if res.error:
            raise corpus.CorpusError(f"{entry['corpus']}/{entry['path']}: {res.error}")
        found[(entry["corpus"], entry["path"])] = corpus.location_set(res.matches)
    return corpus.score(labelled, found)


def print_corpus(report: dict) -> None:
    print(f"\n## transformers {report['version']}: {report['files']} files, "
          f"{report['seconds_total']:.0f} s (median {report['seconds_per_file_median']:.2f} s/file, "
          f"max {report['seconds_per_file_max']:.2f} s: {report['slowest_file']}), "
          f"{len(report['errors'])} not parsed\n")
    print("| rule | matches | rewritten | reported | top refusal reasons |")
    print("|---|---:|---:|---:|---|")
    for rule, row in report["rules"].items():
        reasons = "; ".join(f"{n}x {r}" for r, n in list(row["reasons"].items())[:2])
        print(f"| {rule} | {row['matches']} | {row['applied']} | {row['refused']} | {reasons} |")
    for err in report["errors"]:
        print(f"- not parsed: {err['file']}: {err['error']}")


def print_scores(s: dict) -> None:
    print(f"\n## labelled set: {s['files']} files, {s['labelled']} locations; "
          f"precision {s['precision']:.3f}, recall {s['recall']:.3f}\n")
    print("| rule | labelled | found | precision | recall |")
    print("|---|---:|---:|---:|---:|")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for rule, row in s["rules"].items():
        print(f"| {rule} | {row['labelled']} | {row['found']} | {fmt(row['precision'])} | {fmt(row['recall'])} |")
    for rule, row in s["rules"].items():
        for x in row["missed"]:
            print(f"- missed {rule}: {x[0]} {x[1]} {x[2] or ''}.{x[3]}")
        for x in row["false_positives"]:
            print(f"- extra {rule}: {x[0]} {x[1]} {x[2] or ''}.{x[3]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", default=None, help="transformers releases, comma-separated (default: "
                   "4.35.2,5.24.0, or none with --labels)")
    p.add_argument("--labels", nargs="?", const=str(LABELS), default=None, metavar="DIR",
                   help=f"score against a labelled set (default folder: {LABELS})")
    p.add_argument("--json", metavar="FILE", help="write everything as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    out = {}
    try:
        if args.labels:
            out["labels"] = run_labels(Path(args.labels))
            print_scores(out["labels"])
        versions = args.versions if args.versions is not None else "" if args.labels else "4.35.2,5.24.0"
        out["corpora"] = [run_corpus(v.strip(), args.quiet) for v in versions.split(",") if v.strip()]
    except corpus.CorpusError as exc:
        print(f"adopt_corpus: {exc}", file=sys.stderr)
        return 2
    for report in out["corpora"]:
        print_corpus(report)
    if args.json:
        from kiln.adopt.cli import write_atomic
        write_atomic(Path(args.json), json.dumps(out, indent=1) + "\n")
    crashes = [e for r in out["corpora"] for e in r["errors"] if e["error"].startswith("CRASH")]
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
