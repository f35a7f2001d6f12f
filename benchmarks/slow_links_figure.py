"""The README's "Slow links" picture: held-out loss against training time behind a slow link, for
the methods a user chooses between (no training here; it reads a time_to_loss.py result).

    python benchmarks/slow_links_figure.py        # benchmarks/results/slow_links-20mbit.json -> docs/slow_links.png

The result it reads was made by (about 20 minutes, as root for the rate-limited loopback)::

    sudo $(which python) benchmarks/time_to_loss.py --links comm~compute --rates 20mbit \\
        --methods ddp-zero1 acco-aww local-hdefault local-h4 local-h30-olr0.5-mom0.3 \\
        --budget 60 --seeds 1337 7 42 --no-report --out benchmarks/results/slow_links-20mbit.json

Each method's seeds are drawn as thin lines, their median at each evaluation as a thick one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import common

SOURCE = common.RESULTS_DIR / "slow_links-20mbit.json"
FIGURE = common.REPO_ROOT / "docs" / "slow_links.png"
# What each name meant when the run was made (a name without settings means the library's
# defaults of that day).
LABELS = {
    "local-hdefault": "acco local, the defaults (H and each round's landing chosen from the link)",
    "local-h4": "acco local, H = 4, blocking (the defaults of 2026-11-28)",
    "local-h30-olr0.5-mom0.3": "acco local, H = 30, blocking, outer Nesterov 0.5 / 0.3 (the defaults of 2026-11-27)",
    "local-h16": "acco local, H = 16, estimate rule, auto landing",
    "local-h8-dauto-estimate": "acco local, H = 8, estimate rule, auto landing",
    "local-h8-d0": "acco local, H = 8, blocking (the default)",
    "local-h16-d0": "acco local, H = 16, blocking (the default)",
    "local-h16-d8-discard-olr0.7-mom0.9": "acco local, H = 16, the old default (discard, delay 8, outer 0.7 / 0.9)",
}


def curves(data: dict[str, Any]) -> dict[str, list[list[tuple[float, float]]]]:
    """Per method, each run's (training seconds, held-out loss) points."""
    out: dict[str, list[list[tuple[float, float]]]] = {}
    for run in data["runs"]:
        for name, result in run["methods"].items():
            if "points" in result:
                out.setdefault(name, []).append([(p["elapsed_s"], p["loss"]) for p in result["points"]])
    return out


def draw(data: dict[str, Any], path: Path) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    rate = common.rate_text(next(iter(data["rates"].values()))).replace("mbit", " Mbit/s")
    for number, (name, runs) in enumerate(curves(data).items()):
        common.plot_seeds(ax, runs, f"C{number}", LABELS.get(name, common.label(name).replace("`", "")))
    cfg = data["config"]
    ax.set(xlabel="training seconds (evaluations excluded)", ylabel="held-out loss",
           title=f"{cfg['ranks']} ranks behind {rate}, {cfg['budget_s']:g} s each; median of seeds "
                 f"{', '.join(map(str, cfg['seeds']))} (final in the legend)")
    ax.set_ylim(top=min(5.0, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    return common.save_figure(fig, path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--out", type=Path, default=FIGURE)
    args = parser.parse_args()
    print(f"wrote {args.out.parent / draw(json.loads(args.source.read_text()), args.out)}")


if __name__ == "__main__":
    main()
