"""`kiln adopt`: the command line of the source rewriter.

``register(subparsers)`` is called by ``kiln/cli.py``.  Exit codes: 0 when every input was read
and analyzed, 1 when some input could not be (missing, unreadable, not Python, a syntax error;
the others are still processed), 2 on bad usage or a bad rule file (nothing is processed).
With ``--verify`` (``kiln.adopt.verify``): 0 when the rewritten model computes the same as the
original, 1 when it does not, 2 when the check cannot run (or only the timing failed: the summary
and --json are still written).
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path


DESCRIPTION = """\
Find hand-written GELU, SiLU, RMSNorm and attention in PyTorch model source and rewrite them to
call the fused PyTorch functions; rewrite SwiGLU, linear+GELU and RoPE to kiln.kernels (an
activation chosen by the config is checked at run time), and report dropout+add+LayerNorm,
separate q/k/v projections, lm_head+cross-entropy and attention the rewrite does not cover, each
with its reason (see docs/adopt-dsl.md).  Everything else in the file stays byte-identical; running it twice
changes nothing.  Without --diff/--write/--out it lists the matches.

examples:
  kiln adopt modeling_llama.py --diff
  kiln adopt src/models --rules rms_norm,silu --write --report adopt.json
  kiln adopt model.py --rules my_rules.kiln --out rewritten/
  kiln adopt model.py --show-dsl              # the extracted structure, one line per op
  kiln adopt --list-rules
  kiln adopt --verify transformers:llama --json llama.json   # rewritten model == original?
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("adopt", help="rewrite hand-written activations, norms and attention to fused kernels",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH", help="Python files or directories (searched for *.py)")
    p.add_argument("--diff", action="store_true", help="print a unified diff of the rewrites")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--write", action="store_true", help="rewrite the files in place (atomically)")
    out.add_argument("--out", metavar="DIR", help="write the files that change under DIR (same relative paths)")
    p.add_argument("--no-backup", action="store_true", help="with --write: do not keep FILE.orig")
    p.add_argument("--rules", metavar="RULES",
                   help="comma-separated built-in rule names and/or .kiln rule files (default: all built-in)")
    p.add_argument("--list-rules", action="store_true", help="list the built-in rules and exit")
    p.add_argument("--show-dsl", action="store_true", help="print the extracted DSL structure of each "
                   "method/function instead of rewriting")
    p.add_argument("--report", metavar="JSON", help="write the matches as JSON")
    p.add_argument("--verify", metavar="SPEC",
                   help="instead of PATHs: transformers:<model_type>; rewrite that model's modeling file "
                   "from the installed transformers (in a temporary copy), build a tiny random model from "
                   "both, and compare forward outputs and every parameter gradient in fp32 (equivalent "
                   "when max|diff| <= 1e-4 + 1e-4 * max|original| per tensor; train mode, dropout 0, "
                   "eager attention), then time eager training steps and peak memory before/after; "
                   "exit 1 when not equivalent")
    p.add_argument("--json", metavar="FILE", help="with --verify: write the result as JSON")
    p.add_argument("--no-timing", action="store_true",
                   help="with --verify: only check equivalence, skip the step time and memory measurement")
    p.add_argument("--timing-size", choices=("small", "bench"), default="small",
                   help="with --verify: model size for the timing (small: hidden 256, 2 layers, batch 4 x 128; "
                   "bench: kiln bench's CPU default, hidden 512, 4 layers, batch 8 x 256, vocab 32000)")
    p.set_defaults(func=handle)
    return p


def handle(args) -> int:
    # Imported here so that `kiln --help` and other commands do not load libcst and lark.
    from kiln.adopt import rules as rules_mod
    from kiln.adopt.dsl import DSLError

    if args.list_rules:
        for name, doc in rules_mod.builtin_docs():
            print(f"{name:22} {doc}")
        return 0
    from kiln.adopt.rewrite import AdoptError, parse_source, rewrite_source
    if args.verify is not None:
        return handle_verify(args)
    for flag, given in (("--json", args.json), ("--no-timing", args.no_timing)):
        if given:
            print(f"kiln adopt: {flag} only makes sense with --verify", file=sys.stderr)
            return 2
    if not args.paths:
        print("kiln adopt: no PATH given (see kiln adopt --help)", file=sys.stderr)
        return 2
    if args.no_backup and not args.write:
        print("kiln adopt: --no-backup only makes sense with --write", file=sys.stderr)
        return 2
    try:
        rules = load_rules(args.rules)
    except DSLError as exc:
        print(f"kiln adopt: {exc}", file=sys.stderr)
        return 2
    files, failed = collect(args.paths)
    start = time.perf_counter()
    report = []
    for path, root in files:
        try:
            text = read_python(path)
            if args.show_dsl:
                for fn in parse_source(text, str(path)).functions:
                    print(f"# {path}:{fn.line}")
                    print(fn.show())
                continue
            new_text, matches = rewrite_source(text, rules, filename=str(path))
        except (AdoptError, OSError, UnicodeDecodeError, ValueError) as exc:
            print(f"kiln adopt: {exc}", file=sys.stderr)
            failed += 1
            continue
        report += [m.to_json() for m in matches]
        for m in matches:
            status = f"not rewritten: {m.reason}" if not m.applied else \
                "rewritten" + (f"; needs {', '.join(m.requires)}" if m.requires else "")
            where = f"{m.cls}.{m.method}" if m.cls else m.method
            print(f"{path}:{m.first_line}-{m.last_line}: {m.rule} in {where} ({status})",
                  file=sys.stderr if args.diff else sys.stdout)
        if args.diff and new_text != text:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new_text.splitlines(True), *_diff_labels(path)))
        if args.write and new_text != text:
            target = path.resolve()      # through a symlink: rewrite the file, keep the link
            if not args.no_backup:
                write_atomic(Path(str(path) + ".orig"), text, like=target)
            write_atomic(target, new_text, like=target)
        elif args.out and new_text != text:      # only the files a rule changed
            target = Path(args.out) / (path.relative_to(root) if root is not None else path.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, new_text, like=path)
    if args.report:
        payload = {"matches": report, "files": len(files),
                   "seconds": round(time.perf_counter() - start, 3)}
        write_atomic(Path(args.report), json.dumps(payload, indent=2) + "\n")
    return 1 if failed else 0


def handle_verify(args) -> int:
    """`--verify transformers:<model_type>`: 0 equivalent, 1 not, 2 when it cannot be checked."""
    from kiln.adopt.dsl import DSLError
    from kiln.adopt.verify import VerifyError, summary, verify

    if args.paths:
        print(f"kiln adopt: --verify replaces PATH arguments (got {' '.join(args.paths)})", file=sys.stderr)
        return 2
    for flag, given in (("--diff", args.diff), ("--write", args.write), ("--out", args.out),
                        ("--no-backup", args.no_backup), ("--show-dsl", args.show_dsl), ("--report", args.report)):
        if given:
            print(f"kiln adopt: {flag} cannot be combined with --verify", file=sys.stderr)
            return 2
    try:
        rules = load_rules(args.rules)
        result = verify(args.verify, rules, timing=not args.no_timing, timing_size=args.timing_size,
                        log=lambda text: print(f"kiln adopt: {text} ...", file=sys.stderr, flush=True))
    except (DSLError, VerifyError) as exc:
        print(f"kiln adopt: {exc}", file=sys.stderr)
        return 2
    print(summary(result))
    if args.json:
        write_atomic(Path(args.json), json.dumps(_finite(result), indent=2) + "\n")
    if result.get("timing_error"):
        print(f"kiln adopt: {result['timing_error']}", file=sys.stderr)
        return 2 if result["equivalent"] else 1
    return 0 if result["equivalent"] else 1


def _finite(value):
    """JSON has no Infinity/NaN (a shape mismatch is an infinite diff): those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _diff_labels(path: Path) -> tuple[str, str]:
    if path.is_absolute():
        return str(path), str(path)
    return f"a/{path}", f"b/{path}"


def load_rules(spec: str | None):
    """`rms_norm,silu` (built-in names) and/or paths to .kiln files; None for all built-in rules."""
    from kiln.adopt import rules as rules_mod

    if not spec:
        return None
    rules = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.endswith(".kiln") or os.sep in item or Path(item).is_file():
            rules += rules_mod.load_file(item)
        else:
            rules += rules_mod.load_builtin([item])
    return rules


def collect(paths: list[str]) -> tuple[list[tuple[Path, Path | None]], int]:
    """(file, directory it was found under or None) for each input; counts missing paths."""
    files, failed = [], 0
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += [(p, path) for p in sorted(path.rglob("*.py")) if p.is_file()]
        elif path.is_file():
            files.append((path, None))
        else:
            print(f"kiln adopt: {raw}: no such file or directory", file=sys.stderr)
            failed += 1
    return files, failed


def read_python(path: Path) -> str:
    if path.suffix != ".py":
        raise ValueError(f"{path}: not a Python file (expected a .py file)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text, so not a Python source file") from None
    except OSError as exc:
        raise OSError(f"{path}: cannot read: {exc.strerror or exc}") from None


def write_atomic(path: Path, text: str, like: Path | None = None) -> None:
    """Write to a temporary file in the same directory, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if like is not None and like.exists():
            os.chmod(tmp, os.stat(like).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
