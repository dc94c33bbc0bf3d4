"""Turn a benchmark report (the JSON dict) into table rows, a rich table or Markdown.

The terminal table and the Markdown in docs/benchmarks.md come from the same
``rows()`` so they can never disagree.
"""
from __future__ import annotations

from typing import Any

# Short headers so the table fits a terminal; docs/benchmarks.md explains each.
COLUMNS = [
    ("mode", "Mode"), ("status", "Status"), ("ttfs", "1st step"), ("tuned", "Tuned"), ("step", "Step median (min-max)"),
    ("speedup", "Speed"), ("rate", "{unit}/s"), ("flops", "GFLOP/s (% peak)"),
    ("memory", "Peak RSS MiB"), ("loss", "Loss step 1 -> {loss_step}"), ("steps", "n"),
]


def seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def step_range(median: float, low: float, high: float) -> str:
    """'57 (50-64) ms': one unit, picked by the median, for all three numbers."""
    scale, unit = (1000, "ms") if median < 1 else (1, "s")
    digits = 0 if unit == "ms" or median >= 100 else 2
    return f"{median * scale:.{digits}f} ({low * scale:.{digits}f}-{high * scale:.{digits}f}) {unit}"


def percent(fraction: float) -> str:
    pct = 100 * fraction
    return "<0.1%" if pct < 0.1 else f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%"


def rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def flop_rate(x: float | None) -> str:
    """A FLOP/s figure with a unit, for prose (the table uses bare GFLOP/s)."""
    if x is None:
        return "-"
    return f"{x / 1e12:.2f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def headers(report: dict) -> list[str]:
    cfg = report.get("config", {})
    # Older reports have no common loss step: they compare against each mode's last loss.
    step = cfg.get("loss_step", "last")
    return [title.format(unit=cfg.get("unit", "items"), loss_step=step) for _, title in COLUMNS]


def tuned(r: dict) -> str:
    """When online tuning had chosen every kernel (from the start, like the 1st step), and in brackets
    what the unmeasured steps after the first took beyond the median step; '-' for modes that do not
    tune during training, 'no' when the --settle limit came first."""
    if "tuned_s" not in r:
        return "-"
    when = seconds(r["tuned_s"]) if r["tuned_s"] is not None else "no"
    excess = r.get("tuning_excess_s")
    return when if excess is None else f"{when} (+{seconds(max(excess, 0.0))})"


def status_text(r: dict) -> str:
    return {"ok": "ok", "unavailable": "n/a"}.get(r["status"], "failed")


def rows(report: dict) -> list[list[str]]:
    """One row of formatted cells per mode, in COLUMNS order."""
    baseline = report.get("config", {}).get("baseline")
    out = []
    for r in report.get("results", []):
        cells: dict[str, Any] = {key: "-" for key, _ in COLUMNS}
        cells["mode"] = r["mode"] + (" (base)" if r["mode"] == baseline else "")
        cells["status"] = status_text(r)
        if r["status"] == "ok":
            frac = r.get("peak_fraction")
            mem_ratio = r.get("memory_vs_baseline")
            cells.update(
                ttfs=seconds(r["ttfs_s"]),
                tuned=tuned(r),
                step=step_range(r["step_median_s"], r["step_min_s"], r["step_max_s"]),
                speedup=ratio(r.get("speedup_vs_baseline")), rate=rate(r["items_per_s"]),
                flops=f"{r['achieved_flops_per_s'] / 1e9:.3g}"
                      + ("" if frac is None else f" ({percent(frac)} {r['dtype']})"),
                memory="-" if r.get("peak_rss_bytes") is None else f"{r['peak_rss_bytes'] / 2 ** 20:,.0f}"
                       + ("" if mem_ratio is None else f" ({mem_ratio:.2f}x)"),
                loss=f"{r['loss_first']:.4f} -> {r.get('loss_at_loss_step', r['loss_last']):.4f}",
                steps=f"{r['measured_steps']}" + ("*" if r.get("budget_truncated") else ""))
        out.append([str(cells[key]) for key, _ in COLUMNS])
    return out


def notes(report: dict) -> list[str]:
    """Why modes failed or were unavailable, and other caveats, one line each."""
    lines = []
    for r in report.get("results", []):
        if r["status"] == "unavailable":
            lines.append(f"{r['mode']}: not available: {r.get('reason')}")
        elif r["status"] != "ok":
            lines.append(f"{r['mode']}: failed: {r.get('error')}")
    if any(r.get("budget_truncated") for r in report.get("results", [])):
        budget = report.get("config", {}).get("budget_s")
        lines.append(f"*: fewer measured steps than asked: the next step would have overrun "
                     f"the {budget:g} s time budget (--budget)")
    for r in report.get("results", []):
        if r.get("still_tuning"):
            lines.append(f"{r['mode']}: still tuning after the {report.get('config', {}).get('settle_s', 0):g} s "
                         f"--settle limit ({len(r['still_tuning'])} kernel choices pending): its measured steps "
                         "include kernel trials and may overlap a background compiler")
    base = report.get("config", {}).get("baseline")
    if base and not any(r["mode"] == base and r["status"] == "ok" for r in report.get("results", [])):
        lines.append(f"baseline {base} did not run, so there are no ratios")
    # A busy machine makes every timing noisy; say so where the numbers are.  At
    # the start nothing of ours runs yet; during a mode its own threads count too.
    m, cpus = report.get("machine", {}), report.get("machine", {}).get("usable_cpus") or 0
    during = [r["load_average_1m"] for r in report.get("results", []) if r.get("load_average_1m") is not None]
    before = m.get("load_average_1m")
    if cpus and ((before or 0) > 0.5 * cpus or max(during, default=0) > cpus + 0.5):
        lines.append(f"the machine was busy (1-minute load average {before or 0:.1f} at the start, up to "
                     f"{max(during, default=0):.1f} during the modes, on {cpus} CPUs): timings are noisy")
    over = [r["mode"] for r in report.get("results", []) if (r.get("peak_fraction") or 0) > 1]
    if over:
        lines.append(f"{', '.join(over)}: above 100% of the measured peak, so that peak is an underestimate "
                     "(a busy machine while it was measured, or kernels faster than torch.mm's)")
    if "error" in report.get("peak_matmul", {}):
        lines.append(f"peak matmul rate not measured: {report['peak_matmul']['error']}")
    return lines


def rich_table(report: dict):
    """A rich Table of the results (import of rich kept local: report.py needs none)."""
    from rich import box
    from rich.table import Table

    cfg = report.get("config", {})
    table = Table(title=f"kiln bench: {cfg.get('model')} ({describe_size(cfg)})", title_justify="left",
                  box=box.SIMPLE_HEAD, caption=f"Speed and memory ratios against {cfg.get('baseline')}; "
                  "n = measured steps", caption_justify="left")
    for i, title in enumerate(headers(report)):
        # Fold rather than truncate: a clipped number is worse than a wrapped one.
        table.add_column(title, justify="left" if i < 2 else "right", overflow="fold", no_wrap=i == 0)
    style = {"ok": "", "n/a": "dim", "failed": "red"}
    for row in rows(report):
        table.add_row(*row, style=style.get(row[1], ""))
    return table


def describe_size(cfg: dict) -> str:
    p = cfg.get("resolved", {})
    parts = [f"{k} {p[k]}" for k in ("layers", "hidden", "heads", "intermediate", "vocab", "batch", "seq")
             if k in p]
    if cfg.get("params"):
        parts.insert(0, f"{cfg['params'] / 1e6:.1f}M params")
    return ", ".join(parts)


def markdown_table(report: dict) -> str:
    head = headers(report)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for row in rows(report):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)
