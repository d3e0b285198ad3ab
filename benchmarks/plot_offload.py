"""Plot offload_bench results: decode tok/s against the expert cache size, one line per pcie_frac, the
all-resident arm as a reference line. Needs matplotlib (not a project requirement: `pip install matplotlib`).

    python -m benchmarks.plot_offload out/offload.json [more.json ...] --out offload.png

Each JSON is one offload_bench run; runs after the first are drawn dashed with their file name in the legend.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.runner import parse_list


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="offload_bench --json outputs")
    parser.add_argument("--out", default="offload.png")
    parser.add_argument("--title", default="")
    parser.add_argument("--labels", default="", help="comma-separated legend tags, one per JSON (default: file names)")
    args = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        sys.exit(1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, path in enumerate(args.json):
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            sys.exit(1)
        style = "-" if i == 0 else "--"
        labels = parse_list(args.labels, str, "labels", unique=False, empty_ok=True)
        tag = f" ({labels[i]})" if i < len(labels) else ("" if i == 0 else f" ({Path(path).stem})")
        lines: dict[str, list] = {}
        for arm in run["arms"]:
            if arm.get("slot_frac") is None:  # the all-resident baseline
                ax.axhline(arm["decode_tok_s"], color="gray", linestyle=style, linewidth=1)
                ax.text(0.01, arm["decode_tok_s"], f" all resident{tag}", transform=ax.get_yaxis_transform(),
                        fontsize=8, color="gray", va="bottom")
                continue
            lines.setdefault(str(arm["pcie_frac"]), []).append((arm["slot_frac"], arm["decode_tok_s"]))
        for frac, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                    label=f"pcie_frac={frac}{tag}")
    ax.set_xlabel("expert cache slots / experts per layer")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(args.title or "offload: decode speed against the expert cache size")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
