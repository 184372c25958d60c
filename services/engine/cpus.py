"""Where an engine's processes run: CPU lists, vLLM's per-rank OpenMP binding, and moving
threads that strayed (vLLM's stock NIXL worker moves its compute thread to the last core)
back onto the engine's cores."""

from __future__ import annotations

import os

import psutil


class CPUListError(ValueError):
    """A CPU list that names no CPU."""


def parse_cpus(cpus: str) -> list[int]:
    """CPU ids of a ``taskset``-style list such as ``0``, ``0,2`` or ``2-3``."""
    out: list[int] = []
    for part in cpus.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out:
        raise CPUListError(f"empty CPU list {cpus!r}")
    return sorted(set(out))


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """CPU affinity of every thread of every process in ``pid``'s tree, by thread id."""
    out: dict[int, set[int]] = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                out[tid] = set(os.sched_getaffinity(tid))
            except OSError:
                continue
    return out


def omp_bind(cpus: str | None, tp: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: one core list per TP rank, ``|``-separated.

    The cores (``cpus``, else every core this process may use) are split into ``tp``
    contiguous shares; with fewer cores than ranks, ranks share cores round-robin. vLLM's
    ``auto`` needs a NUMA node per rank, which a one-node host does not have."""
    cores = parse_cpus(cpus) if cpus is not None else sorted(os.sched_getaffinity(0))
    if tp <= 1:
        return cpus if cpus is not None else ",".join(map(str, cores))
    if len(cores) < tp:
        return "|".join(str(cores[r % len(cores)]) for r in range(tp))
    per = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(tp))


def repin_tree(pid: int, cpus: list[int]) -> int:
    """Move every thread in ``pid``'s process tree that may run outside ``cpus`` onto
    them; returns threads moved. A thread bound to some of ``cpus`` (a TP rank's share)
    stays where it is."""
    moved = 0
    for tid, current in thread_affinities(pid).items():
        if not current <= set(cpus):
            try:
                os.sched_setaffinity(tid, cpus)
                moved += 1
            except OSError:
                continue
    return moved
