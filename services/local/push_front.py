"""The push front of ``kvpush up``: the gateway app with a push scheduler in the same process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import SecretStr

from kvpush.common.settings import GatewaySettings, SchedulerSettings
from kvpush.services.gateway import BackgroundTask, Gateway, create_app
from kvpush.services.scheduler import run_scheduler

if TYPE_CHECKING:
    from kvpush.services.local.stack import StackContext


def in_process_scheduler(settings: SchedulerSettings) -> BackgroundTask:
    """A push scheduler as a background task of the gateway app (one process for a local
    stack; deployments run ``kvpush scheduler`` on its own)."""
    return functools.partial(run_scheduler, settings)


def create_stack_app(ctx: StackContext) -> FastAPI:
    """Gateway plus an in-process scheduler, configured from the running stack."""
    model = str(ctx.model)
    tokenizer = None
    if Path(model).is_dir():
        tokenizer, model = model, Path(model).name
    common: dict[str, Any] = {
        "redis_url": ctx.redis_url,
        "key_prefix": ctx.settings.key_prefix,
        "model_dir": ctx.settings.model_dir,
        "log_level": ctx.settings.log_level,
    }
    gs = GatewaySettings(**common).model_copy(update={
        "gateway_model": model, "gateway_tokenizer": tokenizer,
        "gateway_port": ctx.settings.stack_port,
        "engine_api_key": SecretStr(ctx.engine_api_key) if ctx.engine_api_key else None,
        # A local single-user stack: the benchmarks and the demo read /metrics on the API port.
        "gateway_expose_metrics": True, **ctx.gateway_overrides})
    ss = SchedulerSettings(**common).model_copy(update=ctx.scheduler_overrides)
    gateway = (Gateway(gs, tracer_provider=ctx.tracer_provider)
               if ctx.tracer_provider is not None else None)
    return create_app(gs, gateway=gateway, background=[in_process_scheduler(ss)])
