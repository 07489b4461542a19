"""Scaling table and plot from one or more ``bench_ddp.py`` JSON files (merged by variant and world size).

python scripts/plot_scaling.py scripts/results/bench_ddp/gpt2-small.json -o scaling.png
python scripts/plot_scaling.py a.json b.json -o scaling.png --variants ours-ddp,eager-ddp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def merge(paths: list[str]) -> dict:
    doc: dict = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        if not doc:
            doc = {**d, "results": {}}
        doc["gpus"] = max(doc["gpus"], d["gpus"])
        for variant, per_world in d["results"].items():
            doc["results"].setdefault(variant, {}).update(per_world)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--out", required=True, help="PNG path")
    p.add_argument("--variants", help="comma-separated: only these, in this order (default: all)")
    p.add_argument("--note", help="a footnote under the plot (e.g. how the points were measured)")
    a = p.parse_args()
    doc = merge(a.files)
    if a.variants:
        doc["results"] = {v: doc["results"][v] for v in a.variants.split(",") if v in doc["results"]}
    from scripts.bench_ddp import table

    print(table(doc))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, per_world in doc["results"].items():
        worlds = sorted(int(w) for w, r in per_world.items() if "tokens_per_s_per_gpu" in r)
        if not worlds:
            continue
        tps = [per_world[str(w)]["tokens_per_s_per_gpu"] / 1e3 for w in worlds]
        style = "-o" if variant.startswith("ours") else "--s"
        ax1.plot(worlds, tps, style, label=variant)
        if worlds[0] == 1:
            ax2.plot(worlds, [t / tps[0] * 100 for t in tps], style, label=variant)
    ax1.set(xlabel="GPUs", ylabel="tokens/s per GPU (K)", title=f"{doc['preset']}, B={doc['batch_per_gpu']}/GPU")
    ax2.set(xlabel="GPUs", ylabel="scaling efficiency vs 1 GPU (%)", title=doc["gpu"])
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({int(w) for r in doc["results"].values() for w in r}))
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    if a.note:
        fig.text(0.01, 0.01, a.note, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05 if a.note else 0, 1, 1))
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
