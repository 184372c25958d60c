"""The push front of ``kvpush up``: the gateway app with a push scheduler in the same process."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import SecretStr

from kvpush.common.settings import GatewaySettings, SchedulerSettings
from kvpush.services.gateway import BackgroundTask, Gateway, create_app
from kvpush.services.scheduler import run_scheduler

if TYPE_CHECKING:
    from kvpush.services.local.stack import StackContext

logger = logging.getLogger(__name__)


def in_process_scheduler(settings: SchedulerSettings) -> BackgroundTask:
    """A push scheduler as a background task of the gateway app (one process for a local
    stack; deployments run ``kvpush scheduler`` on its own)."""
    return functools.partial(run_scheduler, settings)


def stack_gateway_settings(ctx: StackContext) -> GatewaySettings:
    """The push front's gateway settings: the environment's ``KVPUSH_GATEWAY_*``, serving
    the stack's model on its port.

    The tokenizer is ``KVPUSH_GATEWAY_TOKENIZER`` if set, else the directory the engines
    load (a built-in model's build, or the operator's own directory as given); the
    context limit is ``KVPUSH_GATEWAY_MAX_MODEL_LEN`` if set, else the engines' maximum
    sequence length. ``ctx.gateway_overrides`` win over all of it."""
    env = GatewaySettings(**_common(ctx))
    tokenizer = env.gateway_tokenizer or (str(ctx.model_path) if ctx.model_path else None)
    return env.model_copy(update={
        "gateway_model": ctx.model, "gateway_tokenizer": tokenizer,
        "gateway_max_model_len": env.gateway_max_model_len or ctx.max_model_len,
        "gateway_port": ctx.settings.stack_port,
        "engine_api_key": SecretStr(ctx.engine_api_key) if ctx.engine_api_key else None,
        # A local single-user stack: the benchmarks and the demo read /metrics on the API port.
        "gateway_expose_metrics": True, **ctx.gateway_overrides})


def _common(ctx: StackContext) -> dict[str, Any]:
    return {
        "redis_url": ctx.redis_url,
        "key_prefix": ctx.settings.key_prefix,
        "model_dir": ctx.settings.model_dir,
        "log_level": ctx.settings.log_level,
    }


def create_stack_app(ctx: StackContext) -> FastAPI:
    """Gateway plus an in-process scheduler, configured from the running stack."""
    gs = stack_gateway_settings(ctx)
    logger.info("stack gateway serves %s (tokenizer %s, context %s)", gs.gateway_model,
                gs.gateway_tokenizer, gs.gateway_max_model_len)
    ss = SchedulerSettings(**_common(ctx)).model_copy(update=ctx.scheduler_overrides)
    gateway = (Gateway(gs, tracer_provider=ctx.tracer_provider)
               if ctx.tracer_provider is not None else None)
    return create_app(gs, gateway=gateway, background=[in_process_scheduler(ss)],
                      freeze_heap=True)
