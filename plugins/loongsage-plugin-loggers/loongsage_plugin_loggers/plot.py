"""Plot metrics of a run's ``metrics.jsonl`` against the step (needs matplotlib: the ``plot`` extra).

    from loongsage_plugin_loggers.plot import plot_metrics
    plot_metrics("runs/quickstart/metrics.jsonl", ["rollout/reward_mean", "train/*"], "curves.png")

or ``python -m loongsage_plugin_loggers.plot runs/quickstart/metrics.jsonl rollout/reward_mean -o curves.png``.
matplotlib is used through its object-oriented API with the Agg canvas, so plotting changes no
global backend state and needs no display.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from pathlib import Path
from typing import Sequence

from .jsonl import read_metrics


def _expand(keys: Sequence[str], available: list[str]) -> list[str]:
    chosen: list[str] = []
    for key in keys:
        if any(c in key for c in "*?["):
            matches = sorted(fnmatch.filter(available, key))
        else:
            matches = [key] if key in available else []
        if not matches:
            raise ValueError(f"plot_metrics: no metric matches {key!r}; available: {', '.join(sorted(available))}")
        chosen += [m for m in matches if m not in chosen]
    return chosen


def plot_metrics(metrics_jsonl: str | os.PathLike[str], keys: Sequence[str] | str,
                 out_png: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Draw one panel per metric (value against step) and save a PNG; returns its path.

    Args:
        metrics_jsonl: a file written by the ``jsonl`` logger.
        keys: metric names, or shell-style patterns (``"train/*"``), to plot.
        out_png: where to write the image (parent directories are created).
        title: figure title (default: the file name).

    Raises:
        ValueError: the file has no records, or a key matches no metric (the message lists them).
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot_metrics needs matplotlib: pip install 'loongsage-plugin-loggers[plot]'") from None
    records = read_metrics(metrics_jsonl)
    if not records:
        raise ValueError(f"plot_metrics: no metrics in {metrics_jsonl}")
    available = sorted({k for r in records for k in r if k != "step"})
    chosen = _expand([keys] if isinstance(keys, str) else list(keys), available)
    fig = Figure(figsize=(7, 2.2 * len(chosen) + 0.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(chosen), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, chosen):
        points = [(r["step"], r[key]) for r in records
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and "step" in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(title if title is not None else Path(metrics_jsonl).name)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out), dpi=100)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot metrics of a metrics.jsonl file against the step.")
    parser.add_argument("metrics_jsonl")
    parser.add_argument("keys", nargs="+", help="metric names or patterns such as 'train/*'")
    parser.add_argument("-o", "--out", default="metrics.png")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    try:
        out = plot_metrics(args.metrics_jsonl, args.keys, args.out, title=args.title)
    except (ValueError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
