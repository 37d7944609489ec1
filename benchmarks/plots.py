"""``python -m benchmarks.plots [DIR [SPARSE_TAG ...]]``: the README's figures for the inference
families, redrawn from the JSON rows that ``benchmarks.cached_decode``, ``benchmarks.hybrid``,
``benchmarks.sparse`` and ``benchmarks.sparse_quality`` wrote into DIR (default
benchmarks/results). Each SPARSE_TAG (a ``benchmarks.sparse --tag``, e.g. h200_sparse_s39_full)
is drawn as the sparse figure too, into DIR/SPARSE_TAG.png. No GPU needed."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from .sparse_quality import plot as plot_quality


def _rows(folder: Path, stem: str) -> list[dict]:
    path = folder / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else []


def _speedup_bars(ax, cases: list[str], series: dict[str, list[float]], title: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("best SDPA time / ours (> 1: ours faster)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def cached_decode(rows: list[dict], plt, path: Path) -> None:
    ms = {(r["case"], r["mode"], r["contender"]): r["ms"] for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = defaultdict(list)
    for mode in sorted({r["mode"] for r in rows}):
        for case in cases:
            sdpa = [v for (c, m, name), v in ms.items() if c == case and m == mode and name.startswith("sdpa")]
            series[f"block_decode_attn ({mode})"].append(min(sdpa) / ms[(case, mode, "dlm_ops")])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _speedup_bars(ax, cases, series, "Block decoding against SDPA over [cache; block], H200 bf16, "
                                     "H=32/8, D=128")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def hybrid(rows: list[dict], plt, path: Path) -> None:
    decode = [r for r in rows if r["kind"] == "decode"]
    ms = {(r["case"], r["contender"]): r["ms"] for r in decode}
    cases = list(dict.fromkeys(r["case"].removeprefix("decode ") for r in decode))
    ratios = []
    for case in cases:
        sdpa = [v for (c, name), v in ms.items() if c == f"decode {case}" and name.startswith("sdpa")]
        ratios.append(min(sdpa) / ms[(f"decode {case}", "hybrid step")])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _speedup_bars(ax, cases, {"hybrid decode step (attn + update / 8 steps)": ratios},
                  "Block-hybrid decode step against full softmax over [prefix; block], H200 bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sparse(rows: list[dict], plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for contender, style in (("dlm_ops", "o-"), ("dlm_ops triton", "d:"), ("flex", "x--"),
                             ("dlm_ops column", "s-."), ("dlm_ops column triton", "v:"),
                             ("cudnn equal work", "^--")):
        for s in sorted({r["seqlen"] for r in rows}):
            pts = sorted((r["true_density"], r["ratio"]) for r in rows
                         if r["contender"] == contender and r["seqlen"] == s)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{contender} S={s // 1024}K")
    ax.plot([0, 0.55], [0, 0.55 * 1.15], color="gray", linestyle=":", label="goal: 1.15 x density")
    ax.set_xlabel("density (fraction of key blocks / key columns selected)")
    ax.set_ylabel("time / dense cuDNN time")
    ax.set_title("Block- and column-sparse attention forward, H200 bf16, H=32/8, D=128", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    folder = Path(args[0] if args else "benchmarks/results")
    tags = list(args[1:])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]')")
        return 1
    drawn = []
    for stem, draw in (("h200_cached_decode", cached_decode), ("h200_hybrid", hybrid),
                       ("h200_sparse", sparse), ("h200_sparse_quick", sparse),
                       *((tag, sparse) for tag in tags)):
        rows = _rows(folder, stem)
        if not rows and stem in tags:
            print(f"no rows in {folder / stem}.json")
            return 1
        if rows:
            draw(rows, plt, folder / f"{stem}.png")
            drawn.append(f"{stem}.png")
    quality = [r for r in _rows(folder, "sparse_quality_cuda") if r.get("kind") != "cost"]
    if quality:
        plot_quality(quality, folder / "sparse_quality_cuda.png")
        drawn.append("sparse_quality_cuda.png")
    print("drew " + (", ".join(drawn) if drawn else "nothing (no results found)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
