"""Bar chart of a benchmark report: step time and peak memory per mode (PNG).

Uses matplotlib's Agg backend so it works on machines without a display.
Modes that failed or were unavailable keep their slot with a label, so the
chart shows what was attempted, not only what worked.
"""
from __future__ import annotations

from pathlib import Path


def save(report: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    results = report.get("results", [])
    names = [r["mode"] for r in results]
    ok = [r["status"] == "ok" for r in results]
    median = [r["step_median_s"] if good else 0.0 for r, good in zip(results, ok)]
    # Whiskers from the fastest to the slowest measured step.
    low = [r["step_median_s"] - r["step_min_s"] if good else 0.0 for r, good in zip(results, ok)]
    high = [r["step_max_s"] - r["step_median_s"] if good else 0.0 for r, good in zip(results, ok)]
    memory = [(r.get("peak_rss_bytes") or 0) / 2 ** 20 if good else 0.0 for r, good in zip(results, ok)]
    colors = ["#c0392b" if n.startswith("kiln") else "#2e86c1" if n.startswith("compile") else "#7f8c8d"
              for n in names]

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 0.55 * len(names) + 1.8))
    y = list(range(len(names)))
    ax_t.barh(y, median, xerr=[low, high], color=colors, capsize=3)
    ax_t.set_title("Step time, median (min-max)")
    ax_t.set_xlabel("seconds per training step (lower is better)")
    ax_m.barh(y, memory, color=colors)
    ax_m.set_title("Peak RSS during measured steps")
    ax_m.set_xlabel("MiB (lower is better)")
    for ax, values, ends in ((ax_t, median, [m + h for m, h in zip(median, high)]), (ax_m, memory, memory)):
        ax.set_yticks(y, names)
        ax.invert_yaxis()  # first mode on top, as in the table
        top = max(ends, default=0) or 1.0
        for i, (value, end, r) in enumerate(zip(values, ends, results)):
            text = ((f"{value:,.0f}" if value >= 100 else f"{value:.3g}") if r["status"] == "ok"
                    else "not available" if r["status"] == "unavailable" else "failed")
            # Right of the whisker, so the number never sits on top of it.
            ax.text(end + top * 0.02, i, text, va="center", fontsize=8)
        ax.set_xlim(0, top * 1.3)
    cfg = report.get("config", {})
    from kiln.bench.render import describe_size

    fig.suptitle(f"kiln bench: {cfg.get('model')} ({describe_size(cfg)}) on "
                 f"{report.get('machine', {}).get('cpu', '?')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
