"""Draw the docs' two figures with matplotlib (no Grafana or stack needed).

- ``docs/img/push-path.png``: one request's hand-over, vLLM's stock pull against kvpush's
  push (schematic, not to scale).
- ``docs/img/grafana-layout.png``: the panel layout of the Grafana dashboard
  ``docker/grafana/dashboards/kvpush.json``, read from its JSON (no Grafana runs on the
  build machine, so this is the layout, not a screenshot).

Run: ``.venv/bin/python scripts/docs_figures.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyBboxPatch, Rectangle

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"

C_FWD, C_XFER, C_CTRL, C_TOK = "#9ecae1", "#fdae6b", "#d9d9d9", "#74c476"
ROWS = {"front": 2.0, "prefill": 1.0, "decode": 0.0}
LAYERS = 6


def _box(ax: Axes, x: float, y: float, w: float, label: str, color: str,
         fs: float = 7) -> None:
    h = 0.55
    ax.add_patch(FancyBboxPatch((x, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=color, ec="#555555", lw=0.6))
    ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=fs)


def _arrow(ax: Axes, x0: float, y0: float, x1: float, y1: float,
           color: str = "#444444") -> None:
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": 0.9,
                            "shrinkA": 2, "shrinkB": 2})


def _span(ax: Axes, x0: float, x1: float, text: str, centred: bool) -> None:
    ax.annotate("", xy=(x1, -0.5), xytext=(x0, -0.5),
                arrowprops={"arrowstyle": "<->", "color": "#b2182b", "lw": 0.9})
    if centred:
        ax.text((x0 + x1) / 2, -0.42, text, ha="center", va="bottom", fontsize=7.5,
                color="#b2182b")
    else:
        ax.text(x1 + 0.05, -0.5, text, ha="left", va="center", fontsize=7.5,
                color="#b2182b")


def _layers(ax: Axes, x: float) -> float:
    for i in range(LAYERS):
        _box(ax, x + i, ROWS["prefill"], 0.96, f"layer {i + 1}", C_FWD, fs=8)
    return x + LAYERS


def push_path() -> Path:
    """The stock pull hand-over above kvpush's push, on one time axis."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    for ax, front in zip(axes, ("proxy", "gateway"), strict=True):
        ax.set_yticks(list(ROWS.values()))
        ax.set_yticklabels([front, "prefill", "decode"], fontsize=9)
        ax.set_ylim(-0.6, 2.6)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)
        ax.set_xticks([])

    ax = axes[0]
    ax.set_title("vLLM's stock NixlConnector: decode READs after prefill has finished",
                 fontsize=10, loc="left")
    _arrow(ax, 0.3, ROWS["front"], 0.5, ROWS["prefill"])
    end = _layers(ax, 0.5)
    _box(ax, end, ROWS["prefill"], 0.7, "answer", C_CTRL)
    _arrow(ax, end + 0.7, ROWS["prefill"], end + 0.9, ROWS["front"])
    _box(ax, end + 0.9, ROWS["front"], 0.8, "block ids", C_CTRL)
    _arrow(ax, end + 1.7, ROWS["front"], end + 1.9, ROWS["decode"])
    d = end + 1.9
    _box(ax, d, ROWS["decode"], 0.8, "allocate", C_CTRL)
    _box(ax, d + 0.82, ROWS["decode"], 1.0, "handshake", C_CTRL)
    _box(ax, d + 1.84, ROWS["decode"], 1.6, "READ every layer", C_XFER)
    _box(ax, d + 3.46, ROWS["decode"], 0.5, "1st", C_TOK)
    _arrow(ax, d + 3.96, ROWS["decode"], d + 4.2, ROWS["front"], color="#238b45")
    ax.text(d + 4.25, ROWS["front"], "first token", fontsize=8, va="center", color="#238b45")
    _span(ax, end, d + 3.96, "on the critical path after the forward pass", centred=True)

    ax = axes[1]
    ax.set_title("kvpush: prefill WRITEs each layer into blocks decode reserved up front",
                 fontsize=10, loc="left")
    _arrow(ax, 0.3, ROWS["front"], 0.5, ROWS["prefill"])
    _arrow(ax, 0.3, ROWS["front"], 0.5, ROWS["decode"])
    _box(ax, 0.5, ROWS["decode"], 1.7, "reserve blocks,\npublish target", C_CTRL)
    end = _layers(ax, 0.5)
    ax.add_patch(FancyBboxPatch((2.3, -0.275), end - 2.35, 0.55, boxstyle="round,pad=0.02",
                                fc="#fff5eb", ec="#e6550d", lw=0.6, ls="--"))
    ax.text((2.3 + end) / 2, 0.0, "the reserved blocks fill, layer by layer", ha="center",
            va="center", fontsize=7, color="#a63603")
    for i in range(1, LAYERS):  # the target is in from layer 2 on
        x0 = 0.5 + (i + 1) - 0.05
        _arrow(ax, x0, ROWS["prefill"] - 0.28, x0 + 0.3, ROWS["decode"] + 0.28,
               color="#e6550d")
    ax.text(2.7, 0.5, "WRITE per layer", fontsize=7.5, color="#e6550d", va="center")
    _box(ax, end, ROWS["prefill"], 0.5, "1st", C_TOK)
    _arrow(ax, end + 0.5, ROWS["prefill"], end + 0.85, ROWS["front"], color="#238b45")
    ax.text(end + 0.9, ROWS["front"], "first token (from prefill's answer)", fontsize=8,
            va="center", color="#238b45")
    _box(ax, end + 0.35, ROWS["decode"], 0.9, "PushDone", C_XFER)
    _box(ax, end + 1.3, ROWS["decode"], 2.8, "decode streams the rest", C_TOK)
    _span(ax, end, end + 0.5, "after the forward pass: only prefill's answer", centred=False)

    axes[1].set_xlim(0, 14.2)
    fig.text(0.99, 0.01, "schematic, not to scale", ha="right", fontsize=7, color="#777777")
    fig.tight_layout()
    out = IMG / "push-path.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def grafana_layout() -> Path:
    """Every row and panel of the dashboard at its grid position (24 columns wide)."""
    dash = json.loads((ROOT / "docker/grafana/dashboards/kvpush.json").read_text())
    panels = dash["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig, ax = plt.subplots(figsize=(10, height * 0.2 + 0.6))
    for p in panels:
        g = p["gridPos"]
        if p.get("type") == "row":
            ax.add_patch(Rectangle((g["x"], g["y"]), g["w"], g["h"], fc="#3f4a5a", ec="white"))
            ax.text(g["x"] + 0.3, g["y"] + g["h"] / 2, p.get("title", ""), color="white",
                    fontsize=8.5, va="center", weight="bold")
            continue
        ax.add_patch(Rectangle((g["x"] + 0.1, g["y"] + 0.1), g["w"] - 0.2, g["h"] - 0.2,
                               fc="#eef3f8", ec="#7a8ca3", lw=0.8))
        ax.text(g["x"] + g["w"] / 2, g["y"] + g["h"] / 2 - 0.8,
                f"{p.get('title', '')} ({p.get('type', '')})", ha="center", va="center",
                fontsize=8, weight="bold")
        names = sorted({m for t in p.get("targets", [])
                        for m in re.findall(r"(?:kvpush|vllm|traces)[:_a-z0-9]+",
                                            t.get("expr", "") or "")})
        ax.text(g["x"] + g["w"] / 2, g["y"] + g["h"] / 2 + 0.6,
                "\n".join(names) or "Tempo search", ha="center", va="center", fontsize=6.5,
                family="monospace", color="#334")
    ax.set_xlim(0, 24)
    ax.set_ylim(height, 0)
    ax.axis("off")
    ax.set_title(f"Grafana dashboard \u201c{dash.get('title', '')}\u201d: panel layout "
                 "(drawn from its JSON, not a screenshot)", fontsize=9.5, loc="left")
    fig.tight_layout()
    out = IMG / "grafana-layout.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    for path in (push_path(), grafana_layout()):
        print(path.relative_to(ROOT))
