"""The systems ``kvpush bench`` compares, and how each one is brought up on this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.services.local.ports import free_port_pair, free_port_range

if TYPE_CHECKING:
    from kvpush.loadtest.bench import BenchConfig


class BenchError(RuntimeError):
    """The benchmark was misconfigured or could not run at all."""


class SystemUnavailable(BenchError):
    """A system cannot be measured in this checkout (its reason goes into the report)."""


@dataclass(frozen=True)
class SystemDef:
    """How to bring one benchmarked system up."""

    name: str
    connector: str  # EngineSpec connector / stack front
    repin: bool  # re-pin every engine thread onto its cores once up
    verify_kv: float | None = None  # kvpush only: share of pushes checksummed end to end
    all_cores: bool = False  # colocated: one engine on every allowed core
    decode_engines: int = 1  # kvpush: decode engines sharing the decode cores
    data_parallel: int = 0  # kvpush front: this many colocated engines, one per core share
    traced: bool = False  # every request traced: the phases of its time to first token
    gateway: tuple[tuple[str, Any], ...] = ()  # kvpush: gateway settings of its own
    # P/D: prefill's TP size. Its ranks share prefill's core: spread over both cores, their
    # spinning broadcast readers starved Redis and the gateway (warm-up timed out).
    prefill_tp: int = 1


SYSTEMS: dict[str, SystemDef] = {
    "colocated": SystemDef("colocated", "none", True),
    "colocated-all": SystemDef("colocated-all", "none", True, all_cores=True),
    # What a user might run instead of P/D: the same engines, each serving requests whole,
    # placed by kvpush's gateway and scheduler.
    "colocated-dp2": SystemDef("colocated-dp2", "kvpush", True, data_parallel=2),
    "nixl-pull": SystemDef("nixl-pull", "nixl-pull", False),
    "nixl-pull-repin": SystemDef("nixl-pull-repin", "nixl-pull", True),
    "nixl-push": SystemDef("nixl-push", "nixl-push", False),
    "nixl-push-repin": SystemDef("nixl-push-repin", "nixl-push", True),
    "kvpush": SystemDef("kvpush", "kvpush", True),
    "kvpush-1p2d": SystemDef("kvpush-1p2d", "kvpush", True, decode_engines=2),
    # The cost of KV integrity checks: the same push path verifying 1 % / every request.
    "kvpush-verify-0.01": SystemDef("kvpush-verify-0.01", "kvpush", True, 0.01),
    "kvpush-verify-1": SystemDef("kvpush-verify-1", "kvpush", True, 1.0),
    # Tracing costs a little: the breakdown is a system of its own, not the headline one.
    "kvpush-phases": SystemDef("kvpush-phases", "kvpush", True, traced=True),
    # What streaming the first token from prefill's answer buys: the same push path with
    # every stream's first token waiting for decode's.
    "kvpush-no-lead": SystemDef("kvpush-no-lead", "kvpush", True,
                                gateway=(("gateway_first_token_from_prefill", False),)),
    # What early prefill buys: the same push path with every prompt sent to prefill only
    # once its assignment is in.
    "kvpush-no-early": SystemDef("kvpush-no-early", "kvpush", True,
                                 gateway=(("gateway_early_prefill", False),)),
    # Prefill TP2 -> decode TP1: kvpush against stock pull at the same TP sizes and cores.
    "kvpush-tp2-1": SystemDef("kvpush-tp2-1", "kvpush", True, prefill_tp=2),
    "nixl-pull-tp2-1": SystemDef("nixl-pull-tp2-1", "nixl-pull", True, prefill_tp=2),
}
DEFAULT_SYSTEMS = [n for n, d in SYSTEMS.items()
                   if d.verify_kv is None and not d.gateway and d.prefill_tp == 1]
# KV memory per engine: kv-heavy holds 64 MiB per 512-token prompt, so a burst needs more.
DEFAULT_KV_GIB = {"tiny": 1.0, "kv-heavy": 3.0}


def default_cpus() -> tuple[str | None, str | None]:
    """Prefill on the first allowed core, decode on the last (None with one core)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return str(cpus[0]), str(cpus[-1])


def kvpush_unavailable_reason() -> str | None:
    """Why the push path cannot run in this checkout, or None when it can."""
    import importlib

    try:
        importlib.import_module("kvpush.connector.push_connector")
        importlib.import_module("kvpush.services.local.push_front")
    except Exception as exc:  # a half-edited module is as unavailable as a missing one
        return f"the push path does not import: {type(exc).__name__}: {exc}"
    return None


@dataclass
class RunningSystem:
    """A system that is up: where to send requests and where its engines are."""

    sysdef: SystemDef
    model: str
    url: str
    stack: Any  # services.stack.LocalStack
    stats_file: Path | None
    receiver: Any = None  # loadtest.otlp_receiver.OTLPReceiver of a traced system

    @property
    def engine_urls(self) -> list[str]:
        """Base URLs of every engine of the system."""
        return [e.url for e in self.stack.engines]

    @property
    def decode_url(self) -> str:
        """The engine that streams the output."""
        return self.stack.decode.url

    def stop(self) -> None:
        """Tear the whole system down."""
        self.stack.stop()


def start_system(sysdef: SystemDef, model: str, cfg: BenchConfig, run_dir: Path
                 ) -> RunningSystem:
    """Start ``sysdef`` serving ``model``; raises :class:`SystemUnavailable` when it can't."""
    from kvpush.services.local.stack import LocalStack, stack_settings

    if sysdef.connector == "kvpush":
        reason = kvpush_unavailable_reason()
        if reason:
            raise SystemUnavailable(reason)
    p_default, d_default = default_cpus()
    prefill_cpus = cfg.prefill_cpus or p_default
    decode_cpus = cfg.decode_cpus or d_default
    if sysdef.connector == "none":
        decode_cpus = cfg.colocated_cpus or decode_cpus
        if sysdef.all_cores:
            decode_cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    # Absolute: Redis and the engines resolve paths from their own working directories.
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stats_file = run_dir / "kvpush-transfers.jsonl" if sysdef.connector == "kvpush" else None
    overrides: dict[str, Any] = {"repin": sysdef.repin,
                                 "ready_timeout_s": 600.0}
    if cfg.block_size:
        overrides["block_size"] = cfg.block_size
    if stats_file is not None:
        stats_file.unlink(missing_ok=True)
        overrides["extra_config"] = {"stats_file": str(stats_file)}
        if sysdef.verify_kv is not None:
            overrides["extra_config"]["verify_kv"] = sysdef.verify_kv
    receiver = trace_receiver() if sysdef.traced else None
    settings = stack_settings(
        connector=sysdef.connector, model=model, port=free_port_pair(),
        prefill_port=free_port_pair(),
        decode_port=free_port_range(2 * max(sysdef.decode_engines, sysdef.data_parallel, 1)),
        redis_port=free_port_pair(), decode_engines=sysdef.decode_engines,
        prefill_tp=sysdef.prefill_tp,
    ).model_copy(update={"run_dir": run_dir, "redis_url": None,
                         "otlp_endpoint": receiver.endpoint if receiver else None})
    kv_gib = cfg.kv_cache_gib or DEFAULT_KV_GIB.get(model, 1.0)
    stack = LocalStack(settings, prefill_cpus=prefill_cpus if sysdef.connector != "none" else None,
                       decode_cpus=decode_cpus, kv_cache_gib=kv_gib,
                       engine_overrides=overrides, data_parallel=sysdef.data_parallel,
                       # The serving benchmark compares latency at the offered rates:
                       # every system queues, none sheds (``bench overload`` measures it).
                       gateway_overrides={"gateway_shed_ttft_s": 0.0, **dict(sysdef.gateway)},
                       tracer_provider=_front_tracing() if receiver is not None else None)
    stack.start()
    if stack.connector != sysdef.connector:
        # LocalStack falls back to stock pull when kvpush is missing: never measure that
        # under kvpush's name.
        stack.stop()
        raise SystemUnavailable(f"stack came up with {stack.connector}, not {sysdef.connector}")
    return RunningSystem(sysdef, model, stack.url, stack, stats_file, receiver)


_receiver: Any = None
_provider: Any = None


def trace_receiver() -> Any:
    """The run's OTLP receiver (one per process, like the front's tracer provider)."""
    global _receiver
    if _receiver is None:
        from kvpush.loadtest.otlp_receiver import OTLPReceiver

        _receiver = OTLPReceiver().__enter__()
    return _receiver


def _front_tracing() -> Any:
    # The front runs in this process: a provider of its own exports its spans to the
    # receiver without installing a global one (which would trace everything after it).
    global _provider
    if _provider is None:
        from kvpush.common.telemetry import make_provider

        _provider = make_provider("kvpush-gateway", trace_receiver().endpoint)
    return _provider
