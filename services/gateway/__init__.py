"""OpenAI-compatible gateway: authenticates, counts tokens, asks the scheduler, dispatches.

Per request: authenticate the API key to a tenant (``gateway_auth``) and admit it under the
tenant's quotas; enqueue a ``ScheduleRequest``; await its ``Assignment`` (one reader task
demultiplexes the gateway's assignment stream); send prefill (one token) and decode (the
client's request) **concurrently**, each with ``kv_transfer_params`` and ``X-Request-Id``;
relay decode's tokens. The reservation is renewed while the request runs and released when
it ends however it ends (the decode connector releases it too; release is idempotent), and
so is the quota admission, refunding the tokens the request did not use. A client that goes
away cancels the decode stream and the prefill request (closing an HTTP request aborts it in
vLLM).

Tenancy: the tenant comes from the API key only, never from a request field. Its prefix
cache is isolated by ``cache_salt`` (overwriting any client value). A key is checked when a
request arrives: revoking it stops *new* requests within ``gateway_auth_cache_s``, while a
stream already running is allowed to finish (cutting it would waste the work already done
and gains nothing: the request was admitted and charged when the key was still valid).

Tracing (docs: /work/shared/design.md "Spans"): a SERVER span per request, a PRODUCER span
around the ``XADD`` whose context rides in the stream entry's ``tp`` field, and one CLIENT
span per engine call whose context goes out in the ``traceparent`` header and in
``kv_transfer_params.traceparent``, so vLLM's and the connector's spans join the trace.

The modules follow one request in order; README.md in this folder lists them.
"""

from kvpush.services.gateway.app import (
    BackgroundTask,
    create_app,
    main,
    serve_gateway,
    uvicorn_server,
)
from kvpush.services.gateway.assignment import AssignmentWaiter
from kvpush.services.gateway.context import DEFAULT_TENANT, RequestCtx, span_traceparent
from kvpush.services.gateway.engines import EngineFailed
from kvpush.services.gateway.flight import Flight, Reroute
from kvpush.services.gateway.state import Gateway, GatewayError, default_gateway_id

__all__ = [
    "DEFAULT_TENANT",
    "AssignmentWaiter",
    "BackgroundTask",
    "EngineFailed",
    "Flight",
    "Gateway",
    "GatewayError",
    "RequestCtx",
    "Reroute",
    "create_app",
    "default_gateway_id",
    "main",
    "serve_gateway",
    "span_traceparent",
    "uvicorn_server",
]
