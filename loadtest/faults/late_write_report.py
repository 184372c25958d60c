"""The late-write rows of ``kvpush reliability``: both stacks of ``late_write.py`` run in
turn, then the "Late WRITEs" section of RELIABILITY.md."""

from __future__ import annotations

import logging
from pathlib import Path

from kvpush.loadtest.faults.late_write import (
    POOL,
    SKEW_S,
    UNGUARDED_S,
    VICTIM_LEN,
    LateWriteResult,
    LateWriteStack,
    run_late_write_row,
)
from kvpush.loadtest.faults.outcomes import FaultConfig

logger = logging.getLogger(__name__)

GUARDED_KINDS = ("sigstop", "link_cut", "clock_skew")


def run_late_writes(workdir: Path, cfg: FaultConfig, measure_off: bool = True
                    ) -> tuple[list[LateWriteResult], list[LateWriteResult], list[str]]:
    """Every row on prefill A at TP 1 (then, with ``measure_off``, the same faults with the
    quarantine off), then on A at TP 2: (guarded rows, measured rows, leftover processes)."""
    guarded: list[LateWriteResult] = []
    off: list[LateWriteResult] = []
    leftover: list[str] = []
    for a_tp in (1, 2):
        st = LateWriteStack(workdir / f"tp{a_tp}", cfg, a_tp=a_tp)
        try:
            st.start()
            for i, kind in enumerate(GUARDED_KINDS):
                logger.info("late-write row %s on %s", kind, st.stack_name)
                guarded.append(run_late_write_row(st, kind, seed=10 * a_tp + i))
            if measure_off and a_tp == 1:
                for i, kind in enumerate(GUARDED_KINDS):
                    logger.info("late-write row %s on %s, quarantine off", kind, st.stack_name)
                    off.append(run_late_write_row(st, kind, guarded=False, seed=50 + i))
        finally:
            st.stop()
        leftover += st.leaked_processes()
    return guarded, off, leftover


_HEAD = [
    "| fault | prefill A -> decode | victim's answer | verified at their end (changed) "
    "| late bytes | ended after decode gave up | quarantine: entered / fenced / cut off "
    "| lost | leaked | verdict |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def _rows(results: list[LateWriteResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped:
            lines.append(f"| {r.fault} | {r.stack} | - | - | - | - | - | - | - | "
                         f"skipped: {r.skipped} |")
            continue
        answer = (f"failed: {r.victim_error[:60]}" if r.victim_error else
                  "**different**" if not r.victim_equal else
                  "as alone and colocated" if r.colocated_equal else
                  "as alone, **not as colocated**")
        q = r.quarantines
        leaked = "; ".join(f"{k}: {v}" for k, v in r.leaks.items() if v) or "none"
        after = "-" if r.after_give_up_s is None else f"{r.after_give_up_s:.1f} s"
        verdict = ("measured" if not r.guarded else
                   "pass" if not r.violations() else "**FAIL**")
        lines.append(
            f"| {r.fault} | {r.stack} | {answer} | {r.rechecked} ({r.changed}) | "
            f"{r.late_bytes if r.late_bytes is not None else '-'} | {after} | "
            f"{q.get('entered', 0):.0f} / {q.get('fenced', 0):.0f} / "
            f"{q.get('cut_off', 0):.0f} | {r.lost} | {leaked[:120]} | {verdict} |")
    return lines


def render_late_writes(guarded: list[LateWriteResult], off: list[LateWriteResult],
                       leftover: list[str]) -> list[str]:
    """The report's "Late WRITEs" section."""
    lines = [
        "## Late WRITEs", "",
        "A push's WRITEs that arrive after decode gave the push up must never land in "
        "blocks another request uses (`loadtest/faults/late_write.py`). The stack: prefill "
        "A, whose push of a request R1 the fault hits; prefill B, which pushes the victim; "
        f"a decode with a pool of {POOL} blocks and no prefix cache, so that the victim's "
        f"{VICTIM_LEN}-token prompt fits only with some of R1's blocks; every push "
        "checksummed, and every pushed request checked again when it ends. Each engine in "
        "its own network namespace, NIXL/UCX over TCP on a bridge; A's namespace caps TCP's "
        f"retransmission timeout at {LateWriteStack.tcp_rto_max_ms} ms, so that bytes left in "
        "its socket cross within a second of a heal, as on a fabric whose NIC retries at "
        "once. In every row A stops (SIGSTOP) right before layer 1's WRITE of R1, after "
        "its deadline check; decode gives R1 up; the victim is pushed from B; then A "
        "resumes, or its link heals, and R1's remaining WRITEs go out. In the clock-skew "
        f"row decode's clock runs {SKEW_S:.0f} s ahead, and A writes on time by its own.", "",
        "A row passes when the victim answers exactly as it did alone, pushed from B, and "
        "as decode computing it alone (a colocated engine; greedy), no "
        "verified block changed while a request used it, R1 failed cleanly, decode "
        "released R1's blocks on A's fence (not at the quarantine's bound), and nothing "
        "is lost or held once the row settled. **verified at their end** counts the "
        "pushed requests of the row checked again when they ended (the victim and B's "
        "small pushes that keep decode progressing NIXL), **changed** those with a block "
        "changed while in use; **late bytes** R1's bytes (for the link cut: what crossed "
        "A's link after the heal); **ended after decode gave up** when R1's last WRITE "
        "ended, after decode's deadline and grace by decode's clock.", "",
        *_HEAD, *_rows(guarded), "",
    ]
    if off:
        diff = sum(1 for r in off if r.victim_error is None and not r.victim_equal)
        changed = sum(1 for r in off if r.changed)
        lines += [
            "### The same faults with the quarantine off (measured)", "",
            f"Decode's quarantine bound at {UNGUARDED_S * 1000:.0f} ms, as good as off: "
            "R1's blocks go back to vLLM as soon as decode gives R1 up, which is what a "
            "timer-only design does. The victim gets them, and R1's late WRITEs land in its "
            f"KV. **{diff} of {len(off)} victims answered differently from their answer "
            f"alone, with HTTP 200**, and the end-of-request check found a changed block "
            f"in {changed} of {len(off)} rows: the guard is load-bearing.", "",
            *_HEAD, *_rows(off), "",
        ]
    lines += [f"Leftover processes after the stacks stopped: {', '.join(leftover) or 'none'}.",
              ""]
    return lines
