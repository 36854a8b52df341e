"""Write a :class:`ParityReport` to disk: ``report.json``, ``report.md`` and ``report.png``.

The PNG (loss curves and per-step differences) needs matplotlib, the optional extra
``pip install 'fsdp-bridge[plot]'``; without it the other files are still written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fsdp_bridge.compare.report import ParityReport

__all__ = ["plot_report", "write_report"]


def write_report(
    report: ParityReport, out_dir: str | Path, *, command: str | None = None, job: dict[str, Any] | None = None
) -> dict[str, Path | None]:
    """Write the report files into ``out_dir``; returns their paths (``png`` is None without matplotlib).

    Args:
        report: the comparison.
        out_dir: the directory to write into (made if missing).
        command: the command that made the report, recorded in both files.
        job: the job as data, recorded in ``report.json``.

    Returns:
        ``{"json": ..., "md": ..., "png": ... or None}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_dict()
    if command:
        data["command"] = command
    if job is not None:
        data["job"] = job
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    head = ["# fsdp-bridge compare report", ""]
    if command:
        head += ["Made by:", "", "```", command, "```", ""]
    else:
        head += [""]
    md = out / "report.md"
    png = out / "report.png"
    made_png = plot_report(report, png)
    body = report.markdown()
    if made_png:
        body += f"\n![loss and differences per step]({png.name})\n"
    md.write_text("\n".join(head) + "\n" + body)
    return {"json": out / "report.json", "md": md, "png": png if made_png else None}


def plot_report(report: ParityReport, path: str | Path) -> bool:
    """Loss per step for every run, and each pair's largest parameter and loss difference.

    Args:
        report: the comparison.
        path: the PNG file to write.

    Returns:
        True when written; False (and nothing written) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n_pairs = max(1, len(report.pairs))
    fig = plt.figure(figsize=(15, 4.6 + 0.1 * n_pairs))
    grid = fig.add_gridspec(2, 3, height_ratios=[4.2, 0.2 + 0.1 * n_pairs])
    ax_loss, ax_param, ax_dloss = (fig.add_subplot(grid[0, i]) for i in range(3))
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(report.runs):
        ax_loss.plot(
            [s.step for s in run.steps],
            [s.loss for s in run.steps],
            styles[i % len(styles)],
            marker="o",
            markersize=3,
            label=run.name,
        )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title("loss per run")
    ax_loss.legend(fontsize=7)
    floor = 1e-12  # exact agreement is drawn at this floor on the log axes
    lines = []
    for i, pair in enumerate(report.pairs):
        steps = [d.step for d in pair.steps]
        style = styles[i % len(styles)]
        params = [d.max_param_diff for d in pair.steps]
        (line,) = ax_dloss.plot(
            steps,
            [max(d.loss_diff, floor) for d in pair.steps],
            style,
            marker="x",
            markersize=4,
            label=f"{pair.a} vs {pair.b}" + ("" if pair.ok else " (diverged)"),
        )
        lines.append(line)
        if all(p is not None and math.isfinite(p) for p in params):
            ax_param.plot(
                steps,
                [max(float(p), floor) for p in params if p is not None],
                style,
                marker="o",
                markersize=3,
                color=line.get_color(),
            )
        if pair.first_divergent_step is not None:
            for ax in (ax_param, ax_dloss):
                ax.axvline(pair.first_divergent_step, color="red", alpha=0.3)
    for ax, title in ((ax_param, "largest parameter difference"), (ax_dloss, "loss difference")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{title} per pair (0 drawn at {floor:g})", fontsize=10)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_loss, ax_param, ax_dloss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_ax = fig.add_subplot(grid[1, 1:])
    legend_ax.axis("off")
    if lines:
        legend_ax.legend(handles=lines, loc="upper center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
