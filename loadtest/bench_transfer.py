"""Transfer microbenchmark: kvpush's NIXL push path vs raw NIXL WRITE vs memcpy, two processes.

The serving benchmark (``loadtest/bench.py``) says how the whole system behaves; this one
isolates the data path. On the KV block layouts of the local models it measures, between two
NIXL agents in separate processes (UCX):

* ``kvpush-layerwise``: ``connector.nixl_transport.NixlTransport.write`` exactly as the
  connector's ``save_kv_layer`` calls it, one post per layer region over prepared descriptor
  lists, block ids as given (contiguous or fragmented);
* ``kvpush-one-post``: the same transport, every region in one post (the connector's
  catch-up path);
* ``dynamic-dlist``: an emulation of a per-request descriptor build (merge contiguous runs,
  ``get_xfer_descs`` + ``initialize_xfer`` every request), the shape of cost the anchors
  report for upstream when KV memory fragments;
* ``raw-contiguous``: one NIXL WRITE of one contiguous region of the same byte count;
* ``memcpy-contiguous`` / ``memcpy-gather``: a local torch copy of the same bytes, flat or
  block-gathered.

Every NIXL method is checked byte for byte on the receiver once per (layout, pattern). The
last part measures the CPU an idle agent burns: kvpush's (progress thread off) and, for
contrast, one with NIXL's default progress thread.

Run: ``python -m loadtest.bench_transfer --out out/transfer`` or ``kvpush bench transfer``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush.loadtest.transfer_agents import (
    BlockLayout,
    BytesMismatch,
    TransferBenchError,
    block_ids,
    measure_idle,
    merged_runs,
    parse_layouts,
    progthread_agent,
    run_receiver,
    run_sender,
)

logger = logging.getLogger(__name__)


@dataclass
class TransferReport:
    """Everything one microbenchmark run produced."""

    meta: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)
    idle: dict[str, dict[str, float]] = field(default_factory=dict)


def default_runs(layout: BlockLayout) -> list[int]:
    """Contiguous, runs of 8 and 2 blocks, fully scattered."""
    n = layout.request_blocks
    return sorted({n, min(8, n), min(2, n), 1}, reverse=True)


def run_layout(layout: BlockLayout, iters: int | None = None, runs: list[int] | None = None,
               idle_s: float = 0.0, seed: int = 7, ucx_tls: str | None = None,
               timeout_s: float = 600.0) -> tuple[list[dict[str, Any]], dict]:
    """Benchmark one layout in a fresh receiver/sender pair; returns (results, idle CPU)."""
    ctx = mp.get_context("spawn")
    if iters is None:
        # About 256 MiB moved per method, at least 5 and at most 200 repetitions.
        iters = max(5, min(200, (256 << 20) // max(1, layout.request_bytes)))
    runs = runs or default_runs(layout)
    a, b = ctx.Pipe()
    results = ctx.Queue()
    recv = ctx.Process(target=run_receiver, args=(layout, a, seed, ucx_tls), daemon=True)
    send = ctx.Process(target=run_sender,
                       args=(layout, b, results, runs, iters, seed, idle_s, ucx_tls),
                       daemon=True)
    recv.start()
    send.start()
    idle: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferBenchError(f"{layout.name}: no result in {timeout_s}s")
            try:
                kind, *payload = results.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: check the processes are still alive
                if not send.is_alive():
                    raise TransferBenchError(
                        f"{layout.name}: sender exited with {send.exitcode}") from None
                continue
            if kind == "idle":
                pid, secs = payload
                idle = measure_idle({"kvpush-sender": pid, "kvpush-receiver": recv.pid}, secs)
            elif kind == "error":
                raise TransferBenchError(f"{layout.name}: {payload[0]}")
            else:
                return payload[0], idle
    finally:
        for p in (send, recv):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def progthread_idle(idle_s: float) -> dict[str, float]:
    """Idle CPU of an agent with NIXL's default progress thread (UCX, memory registered)."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=progthread_agent, args=(ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(120):
            raise TransferBenchError("progress-thread agent did not start")
        time.sleep(0.5)
        return measure_idle({"nixl-default": proc.pid}, idle_s)["nixl-default"]
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_transfer_bench(layouts: list[BlockLayout], out_dir: Path | None = None,
                       iters: int | None = None, idle_s: float = 3.0,
                       progthread_contrast: bool = True, ucx_tls: str | None = None,
                       ) -> TransferReport:
    """Run every layout (idle CPU measured after the first), write reports to ``out_dir``."""
    report = TransferReport(meta={
        "layouts": [asdict(layout) | {"block_len": layout.block_len,
                                      "request_blocks": layout.request_blocks,
                                      "request_bytes": layout.request_bytes}
                    for layout in layouts],
        "iters": iters, "idle_s": idle_s, "ucx_tls": ucx_tls or os.environ.get("UCX_TLS"),
        "cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })
    for i, layout in enumerate(layouts):
        logger.info("transfer bench: layout %s (%s bytes per request, %s blocks)",
                    layout.name, layout.request_bytes, layout.request_blocks)
        res, idle = run_layout(layout, iters=iters, idle_s=idle_s if i == 0 else 0.0,
                               ucx_tls=ucx_tls)
        report.results.extend(res)
        report.idle.update(idle)
    if progthread_contrast and idle_s > 0:
        report.idle["nixl-default-progress-thread"] = progthread_idle(idle_s)
    bad = [r for r in report.results if r.get("wrong_bytes")]
    if out_dir is not None:
        write_transfer_report(report, out_dir)
    if bad:
        raise BytesMismatch(f"{len(bad)} method(s) left wrong bytes on the receiver: "
                            + ", ".join(f"{r['layout']}/{r['method']}/run{r['run']}"
                                        for r in bad))
    return report


def markdown(report: TransferReport) -> str:
    """Tables: every method per layout and pattern, then idle CPU."""
    lines = [
        "| layout | method | run | descs/req | posts/req | prep µs p50 | post µs p50 "
        "| post µs p90 | total ms p50 | GB/s | verified bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        run = "contig" if r["run"] >= r["blocks"] else str(r["run"])
        ver = "—" if r["verified_bytes"] is None else (
            f"{r['verified_bytes']} ok" if not r["wrong_bytes"]
            else f"{r['wrong_bytes']} WRONG of {r['verified_bytes']}")
        lines.append(
            f"| {r['layout']} | {r['method']} | {run} | {r['descriptors']} | {r['posts']} "
            f"| {'—' if r['prep_us_p50'] is None else format(r['prep_us_p50'], '.1f')} "
            f"| {r['post_us_p50']:.1f} | {r['post_us_p90']:.1f} | {r['total_ms_p50']:.3f} "
            f"| {r['gbps']:.2f} | {ver} |")
    lines += ["", "| idle process | CPU s | wall s | CPU % of one core |", "|---|---|---|---|"]
    for name, v in report.idle.items():
        lines.append(f"| {name} | {v['cpu_s']:.4f} | {v['wall_s']:.2f} | {v['cpu_pct']:.2f} |")
    return "\n".join(lines) + "\n"


def write_transfer_report(report: TransferReport, out_dir: Path) -> list[Path]:
    """``transfer.json``, ``transfer.md`` and two PNGs (post cost vs run, GB/s)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "transfer.json", out_dir / "transfer.md"]
    paths[0].write_text(json.dumps(asdict(report), indent=2))
    paths[1].write_text("# kvpush transfer microbenchmark\n\n```\n"
                        + json.dumps(report.meta, indent=2) + "\n```\n\n" + markdown(report))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in report.results})
    fig, axes = plt.subplots(1, max(1, len(layouts)), figsize=(5 * max(1, len(layouts)), 4),
                             squeeze=False)
    for ax, name in zip(axes[0], layouts, strict=False):
        for method in ("kvpush-layerwise", "kvpush-one-post", "dynamic-dlist"):
            rows = sorted((r for r in report.results
                           if r["layout"] == name and r["method"] == method),
                          key=lambda r: -r["run"])
            if rows:
                xs = [merged_runs(block_ids(r["blocks"], r["run"], 2 * r["blocks"])[0])
                      for r in rows]
                line = ax.plot(xs, [r["prep_us_p50"] or 0 for r in rows], marker="o",
                               label=f"{method} prep")[0]
                ax.plot(xs, [r["post_us_p50"] for r in rows], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{method} post")
        ax.set_title(f"{name}: per-request cost vs fragmentation")
        ax.set_xlabel("contiguous runs per request (1 = contiguous)")
        ax.set_ylabel("µs per request (p50)")
        ax.set_xscale("log")
        ax.set_yscale("log")  # prep is µs, post (which moves the data) is ms
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "transfer_post_cost.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "transfer_post_cost.png")

    rows = [r for r in report.results if r["run"] >= r["blocks"] or r["method"] == "memcpy-gather"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["gbps"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['layout']}\n{r['method']}" for r in rows],
                  fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("GB/s (p50, contiguous ids)")
    fig.tight_layout()
    fig.savefig(out_dir / "transfer_gbps.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "transfer_gbps.png")
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the transfer microbenchmark (shared with ``kvpush bench transfer``)."""
    g = p.add_argument_group("transfer microbenchmark")
    g.add_argument("--layouts", default="tiny-b16,tiny-b32,kv-heavy-b16,kv-heavy-b32",
                   help="<model>-b<block size>, comma separated")
    g.add_argument("--request-tokens", type=int, default=512, help="tokens per request")
    g.add_argument("--iters", type=int, default=None,
                   help="repetitions per method (default: about 256 MiB moved)")
    g.add_argument("--idle-s", type=float, default=3.0,
                   help="seconds of idle CPU measurement (0: skip)")
    g.add_argument("--no-progthread-contrast", action="store_true",
                   help="skip the idle agent with NIXL's default progress thread")
    g.add_argument("--ucx-tls", default=None, help="UCX_TLS for both agents (default: UCX's)")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench transfer`` and ``python -m loadtest.bench_transfer``."""
    layouts = parse_layouts(args.layouts, args.request_tokens)
    out = Path(args.out) if args.out else None
    report = run_transfer_bench(layouts, out, iters=args.iters, idle_s=args.idle_s,
                                progthread_contrast=not args.no_progthread_contrast,
                                ucx_tls=args.ucx_tls)
    print(markdown(report))
    if out is not None:
        print(f"report written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/transfer", help="report directory ('' for none)")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
