"""Benchmark report: JSON, a markdown table with ratios against the stock connectors, PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYSTEM_LABELS = {
    "colocated": "(a) one colocated engine",
    "nixl-pull": "(b) stock NixlConnector, pull",
    "nixl-pull-repin": "(b') stock pull, re-pinned",
    "nixl-push": "(c) stock NixlPushConnector, concurrent",
    "nixl-push-repin": "(c') stock push, re-pinned",
    "kvpush": "(d) kvpush push",
    "kvpush-verify-0.01": "(d) kvpush, 1 % of pushes verified",
    "kvpush-verify-1": "(d) kvpush, every push verified",
    "kvpush-1p2d": "(d) kvpush 1P2D",
    "kvpush-phases": "(d) kvpush, every request traced",
    "kvpush-no-lead": "(d) kvpush, first token from decode only",
    "kvpush-no-early": "(d) kvpush, prefill sent after the assignment",
    "colocated-all": "(a2) one colocated engine on all cores",
    "colocated-dp2": "(a3) two colocated engines behind the gateway",
    "kvpush-tp2-1": "(d) kvpush, prefill TP2 -> decode TP1",
    "nixl-pull-tp2-1": "(b) stock pull, prefill TP2 -> decode TP1",
}
# Ratios are taken against each of these that ran on the same point.
BASELINES = ("colocated", "colocated-all", "colocated-dp2",
             "nixl-pull", "nixl-pull-repin", "nixl-push", "nixl-push-repin", "nixl-pull-tp2-1")


@dataclass
class BenchPoint:
    """One system measured at one (model, lengths, rate) point."""

    system: str
    model: str
    input_len: int
    output_len: int
    rate: float
    summary: dict[str, Any]
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    kv_bytes: int | None = None
    exposed_transfer_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # mean seconds per TTFT phase
    extra: dict[str, Any] = field(default_factory=dict)  # transfer stats, correctness, notes

    def key(self) -> tuple[str, int, int, float]:
        """The workload this point belongs to, shared by the systems compared on it."""
        return (self.model, self.input_len, self.output_len, self.rate)


def _fmt_ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    # Ratio as "baseline / ours": above 1 means kvpush is faster.
    if not ours or not theirs:
        return "—"
    return f"{theirs / ours:.2f}x"


def _verified(p: BenchPoint) -> str:
    figs = p.extra.get("kvpush") or {}
    if not figs.get("verified"):
        return "—"
    return f"{figs['verified']} ({figs.get('verify_failures', 0)})"


def _load(p: BenchPoint) -> str:
    """1-minute load average when the point started; marked when the machine was busy."""
    load = p.extra.get("loadavg_1m_before")
    if load is None:
        return "—"
    return f"{load:.2f}" + ("" if p.extra.get("quiet", True) else " LOADED")


def markdown_table(points: list[BenchPoint]) -> str:
    """One row per point, then a ratio table of each non-baseline system against (b) and (c)
    (and their re-pinned variants)."""
    head = (
        "| model | ISL/OSL | rate | system | ok/total | TTFT mean | TTFT p50 | TTFT p99 "
        "| TPOT mean | ITL p99 | tok/s | goodput req/s | exposed xfer | KV bytes "
        "| KV verified (failed) | load before |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for p in sorted(points, key=lambda p: (*p.key(), p.system)):
        s = p.summary
        rows.append(
            f"| {p.model} | {p.input_len}/{p.output_len} | {p.rate:g} "
            f"| {SYSTEM_LABELS.get(p.system, p.system)} | {s['completed']}/{s['requests']} "
            f"| {_fmt_ms(s['ttft_mean'])} | {_fmt_ms(s['ttft_p50'])} | {_fmt_ms(s['ttft_p99'])} "
            f"| {_fmt_ms(s['tpot_mean'])} | {_fmt_ms(s['itl_p99'])} "
            f"| {s['output_tok_per_s']:.1f} | {s['goodput_req_per_s']:.2f} "
            f"| {_fmt_ms(p.exposed_transfer_s)} | {p.kv_bytes if p.kv_bytes is not None else '—'} "
            f"| {_verified(p)} | {_load(p)} |"
        )
    out = "Times in ms.\n\n" + head + "\n".join(rows) + "\n"
    out += "\n### Ratios (baseline ÷ system; above 1 means the system is faster)\n\n"
    out += (
        "| model | ISL/OSL | rate | system | vs | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    by_key: dict[tuple, dict[str, BenchPoint]] = {}
    for p in points:
        by_key.setdefault(p.key(), {})[p.system] = p
    for key in sorted(by_key):
        systems = by_key[key]
        for name, p in sorted(systems.items()):
            if name in BASELINES:
                continue  # baselines against each other are in the main table already
            for base in BASELINES:
                if base not in systems:
                    continue
                b = systems[base].summary
                s = p.summary
                out += (
                    f"| {key[0]} | {key[1]}/{key[2]} | {key[3]:g} | {name} | {base} "
                    f"| {_ratio(s['ttft_mean'], b['ttft_mean'])} "
                    f"| {_ratio(s['ttft_p50'], b['ttft_p50'])} "
                    f"| {_ratio(s['ttft_p99'], b['ttft_p99'])} "
                    f"| {_ratio(s['tpot_mean'], b['tpot_mean'])} |\n"
                )
    return out


class ResultsError(Exception):
    """A finished run's ``results.json`` is missing, unreadable, or another benchmark's."""


def read_results(out_dir: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """The JSON document of ``out_dir/results.json``, with ``required`` top-level keys.

    ``--render`` takes a directory from the command line, so a wrong one is a user's slip to
    name, not a traceback.
    """
    path = Path(out_dir) / "results.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file (is {out_dir} a finished run's --out?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: not readable as JSON ({exc})") from None
    missing = [k for k in required if not isinstance(data, dict) or k not in data]
    if missing:
        raise ResultsError(f"{path}: no {', '.join(missing)} (another benchmark's results?)")
    return data


def load_points(out_dir: Path) -> tuple[list[BenchPoint], dict[str, Any]]:
    """Points and the whole JSON document of the ``results.json`` that :func:`write_report`
    wrote into ``out_dir``; :class:`ResultsError` where it cannot be one."""
    data = read_results(out_dir, ("meta", "points"))
    try:
        return [BenchPoint(**p) for p in data["points"]], data
    except TypeError as exc:
        raise ResultsError(f"{Path(out_dir) / 'results.json'}: a point does not fit ({exc})") \
            from None


def write_report(
    points: list[BenchPoint],
    out_dir: Path,
    meta: dict[str, Any],
    extra_md: str = "",
    extra_json: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``results.json``, ``results.md`` and PNG plots into ``out_dir``; returns the paths.

    ``extra_md`` is appended to the markdown; ``extra_json`` is merged into the JSON top level.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    data = {"meta": meta, "points": [asdict(p) for p in points], **(extra_json or {})}
    (out_dir / "results.json").write_text(json.dumps(data, indent=2))
    written.append(out_dir / "results.json")
    header = f"# kvpush benchmark\n\n```\n{json.dumps(meta, indent=2)}\n```\n\n"
    md = header + markdown_table(points) + extra_md
    (out_dir / "results.md").write_text(md)
    written.append(out_dir / "results.md")
    written.extend(_plots(points, out_dir))
    return written


def _plots(points: list[BenchPoint], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    keys = sorted({p.key() for p in points})
    if not keys:
        return paths
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for p in sorted((p for p in points if p.key() == key), key=lambda p: p.system):
            if p.ttfts:
                xs = sorted(t * 1000 for t in p.ttfts)
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=p.system)
        ax.set_title(f"{key[0]} {key[1]}/{key[2]} @ {key[3]:g} req/s")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_cdf.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(points)), 4))
    labels = [f"{p.system}\n{p.model} {p.input_len}/{p.output_len}@{p.rate:g}" for p in points]
    ax.bar(range(len(points)), [(p.summary["tpot_mean"] or 0) * 1000 for p in points])
    ax.set_xticks(range(len(points)), labels, fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("TPOT mean (ms)")
    fig.tight_layout()
    fig.savefig(out_dir / "tpot.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "tpot.png")

    phased = [p for p in points if p.phases]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * max(1, len(phased))), 4))
    bottoms = [0.0] * len(phased)
    for phase in dict.fromkeys(ph for p in phased for ph in p.phases):
        vals = [p.phases.get(phase, 0.0) * 1000 for p in phased]
        ax.bar(range(len(phased)), vals, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(range(len(phased)), [f"{p.system}\n{p.model} @{p.rate:g}" for p in phased],
                  fontsize=7)
    ax.set_ylabel("mean ms of TTFT")
    ax.set_title("TTFT by phase (from spans)")
    if phased:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_phases.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "ttft_phases.png")
    return paths
