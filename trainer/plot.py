"""``trainer plot RUN_DIR ...``: train/validation loss, tokens/s and lr against step, runs overlaid."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl``; a torn last line (a crash mid-write) is skipped.

    Raises:
        FileNotFoundError: the run has no metrics.jsonl.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _label(run_dir: Path) -> str:
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        import yaml

        name = (yaml.safe_load(cfg.read_text()) or {}).get("run", {}).get("name")
        if name and name != run_dir.name:
            return f"{name} ({run_dir.name})"
    return run_dir.name


def plot_runs(run_dirs: list[str], out: str | None = None) -> Path:
    """Write a 2x2 PNG of loss, validation loss, tokens/s and lr against step; returns its path.

    Raises:
        ValueError: matplotlib is missing, or no run has any metrics.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("trainer plot needs matplotlib: pip install -e '.[plot]'") from None
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    if not any(records for _, records in runs):
        raise ValueError(f"no metrics to plot in {', '.join(run_dirs)}")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0, 0], "loss", "train loss"),
        (axes[0, 1], "val_loss", "validation loss"),
        (axes[1, 0], "tokens_per_s", "tokens/s"),
        (axes[1, 1], "lr", "learning rate"),
    ]
    for run_dir, records in runs:
        label = _label(run_dir)
        for ax, key, _ in panels:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if key == "val_loss" else None, markersize=3, label=label)
    for ax, _, title in panels:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    axes[0, 0].set_ylabel("loss")
    fig.tight_layout()
    path = Path(out) if out else Path(run_dirs[0]) / "plot.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
