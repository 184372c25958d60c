"""Stream-ordered push: a WRITE leaves only once the device event recorded after the
kernels that write its KV completed, so prefill never sends KV a GPU has not computed yet.

A prefill and a decode ``WorkerSide`` run in this process over the in-process fake
transport (real torch KV tensors, the real Redis of conftest.py for the agent registry);
the prefill sender is bound to a :class:`FakeDevice`, whose events complete only when a
test says so, as a GPU's would some time after the hook. Recorded events, in order: one
per layer hook of a forward pass that computes prefill steps, then one in
``wait_for_save`` (the step event).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpush.common.wire import now_ms
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.device import FakeDevice, HostDevice
from kvpush.connector.fake_transport import FakeFabric, FakeTransport
from kvpush.connector.metadata import KVPushMetadata, PrefillStep, RecvSpec, SendTarget
from kvpush.connector.state import PushState
from kvpush.connector.stats import PUSH_LAYERWISE, PUSH_PER_STEP, layerwise_on, push_mode
from kvpush.connector.worker_side import WorkerSide
from tests.worker_util import engine_step

BS = 4  # tokens per block
NUM_BLOCKS = 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
PROMPT = 10  # tokens: 3 blocks, the last one partial
SRC = [5, 6, 7]  # prefill's blocks of the request
DST = [1, 3, 4]  # decode's blocks of the request
RID = "cmpl-1"


@dataclass
class Pair:
    prefill: WorkerSide
    decode: WorkerSide
    p_kv: dict[str, torch.Tensor]
    d_kv: dict[str, torch.Tensor]
    device: FakeDevice | HostDevice
    decode_device: FakeDevice

    @property
    def writes(self) -> list[Any]:
        """Every WRITE prefill posted, in order."""
        transport = self.prefill.transport
        assert isinstance(transport, FakeTransport)
        return transport.writes

    def regions(self) -> list[list[int]]:
        """The layers (regions) of each WRITE posted, in order."""
        return [list(x.handle.regions) for x in self.writes]

    def landed(self) -> bool:
        return all(torch.equal(self.d_kv[n][d], self.p_kv[n][s])
                   for n in LAYERS for s, d in zip(SRC, DST, strict=True))


@pytest.fixture
def make_pair(redis_url: str) -> Iterator[Callable[..., Pair]]:
    sides: list[WorkerSide] = []

    def make(host: bool = False, layerwise: bool = True) -> Pair:
        fabric = FakeFabric()
        factory = functools.partial(FakeTransport, fabric=fabric)

        def side(engine: str, generation: int, kv: dict[str, torch.Tensor],
                 device: FakeDevice | HostDevice) -> WorkerSide:
            cfg = ConnectorConfig(redis_url=redis_url, engine_id=engine, layerwise=layerwise)
            w = WorkerSide(cfg, tp_rank=0, tp_size=1, block_size=BS, num_blocks=NUM_BLOCKS,
                           generation=generation, transport_factory=factory)
            sides.append(w)
            w.register_kv_caches(kv)
            assert w.transport is not None and w.layout is not None
            layers = [kv[n] for n in w.layout.layer_names]
            w.sender.bind(w.transport, w.layout, layers, device=device)
            w.receiver.bind(w.transport, w.layout, layers, device=device)
            return w

        torch.manual_seed(0)
        p_kv = {n: torch.randn(NUM_BLOCKS, 2, BS, 16) for n in LAYERS}
        d_kv = {n: torch.zeros(NUM_BLOCKS, 2, BS, 16) for n in LAYERS}
        device = HostDevice() if host else FakeDevice()
        decode_device = FakeDevice()
        return Pair(side("P", 1, p_kv, device), side("D", 2, d_kv, decode_device), p_kv, d_kv,
                    device, decode_device)

    yield make
    for w in sides:
        w.shutdown()


def _target() -> SendTarget:
    return SendTarget(RID, "D", 2, [list(DST)], skip_blocks=[0], num_tokens=PROMPT,
                      deadline_ms=now_ms() + 30_000)


def _recv() -> KVPushMetadata:
    return KVPushMetadata(recvs={"d-1": RecvSpec(RID, "P", [list(DST)], [0],
                                                 now_ms() + 30_000)})


def _prefill(computed: int = PROMPT, target: bool = True, before: int = 0,
             block_ids: list[int] = SRC, restarted: bool = False) -> KVPushMetadata:
    """A step computing prompt tokens ``before:computed``, with decode's target known."""
    return KVPushMetadata(
        steps={"p-1": PrefillStep(RID, [list(block_ids)], before, computed, PROMPT,
                                  restarted)},
        targets={"p-1": _target()} if target else {})


_step = functools.partial(engine_step, layers=LAYERS)


def test_no_write_leaves_before_its_layer_event_completes(make_pair) -> None:
    pair = make_pair()
    _step(pair.decode, _recv())
    pair.prefill.on_metadata(_prefill())
    for name in LAYERS:
        pair.prefill.save_kv_layer(name)
        assert pair.writes == []
    pair.prefill.wait_for_save()
    assert pair.prefill.get_transfer_results() == (set(), set(), set())
    assert pair.writes == []  # nor a catch-up: every layer is queued, none due yet
    assert len(pair.device.events) == len(LAYERS) + 1  # one per layer, one per step
    # The GPU finishes the layers one at a time: each WRITE follows its own layer.
    for done in range(1, len(LAYERS) + 1):
        pair.device.complete(done)
        pair.prefill.get_transfer_results()
        assert pair.regions() == [[r] for r in range(done)]
    assert all(x.handle.local_blocks == SRC for x in pair.writes)
    pair.device.complete()
    _step(pair.prefill)  # the answer is sampled: PushDone leaves with the next step
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.landed()
    assert len(pair.writes) == len(LAYERS)  # nothing posted twice


def test_layer_write_leaves_from_a_later_hook_within_the_forward_pass(make_pair) -> None:
    """The push still overlaps the forward pass: a layer done on the device is written
    from the next hook, not after the pass."""
    pair = make_pair()
    pair.prefill.on_metadata(_prefill())
    pair.prefill.save_kv_layer(LAYERS[0])
    pair.prefill.save_kv_layer(LAYERS[1])
    assert pair.writes == []
    pair.device.complete(1)  # layer 0's kernels are done, layer 1's still running
    pair.prefill.save_kv_layer(LAYERS[2])
    assert pair.regions() == [[0]]
    assert pair.prefill.sender.jobs["p-1"].record.layerwise_xfers == 1


def test_catch_up_waits_for_the_step_event(make_pair) -> None:
    """Layer-wise writes off: the step's blocks go out after the forward pass, every layer
    at once, once the event recorded after the pass completed."""
    pair = make_pair(layerwise=False)
    pair.prefill.on_metadata(_prefill())
    for name in LAYERS:
        pair.prefill.save_kv_layer(name)
    pair.prefill.wait_for_save()
    pair.device.complete(len(LAYERS))  # every layer event, not the step's
    pair.prefill.get_transfer_results()
    assert pair.writes == []
    pair.device.complete()
    pair.prefill.get_transfer_results()
    assert pair.regions() == [list(range(len(LAYERS)))]


def test_catch_up_of_earlier_blocks_waits_for_the_step_that_computed_them(make_pair
                                                                          ) -> None:
    """Decode's target arrives a step after the prompt was computed: the catch-up reads
    blocks the earlier step wrote, so it waits for that step's event."""
    pair = make_pair()
    _step(pair.prefill, _prefill(target=False))
    step_event = pair.device.events[-1]
    _step(pair.prefill, KVPushMetadata(targets={"p-1": _target()}))
    assert pair.writes == []
    step_event.done = True  # the earlier step's event alone suffices
    pair.prefill.get_transfer_results()
    assert pair.regions() == [list(range(len(LAYERS)))]


def test_push_done_waits_for_pending_posts_and_in_flight_writes(make_pair) -> None:
    pair = make_pair()
    pair.prefill.transport.polls_to_complete = 2
    _step(pair.decode, _recv())
    _step(pair.prefill, _prefill())
    job = pair.prefill.sender.jobs["p-1"]
    for _ in range(3):  # the answer was sampled, decode is waiting: still nothing posted
        _step(pair.prefill)
        assert job.state is PushState.PUSHING and not job.notified
        assert pair.prefill.sender._posts.holds(job)
    assert _step(pair.decode) == (set(), set(), set())
    pair.device.complete()
    pair.prefill.get_transfer_results()
    assert len(pair.writes) == len(LAYERS) and job.xfers  # posted, in flight
    assert not job.notified
    while not job.notified:
        assert pair.prefill.get_transfer_results() == (set(), set(), set())
    assert job.state is PushState.DONE and job.xfers == []
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.landed()
    assert pair.decode_device.visible_calls == 1  # before decode runs the request


def test_preempted_request_never_posts_its_pending_writes(make_pair) -> None:
    pair = make_pair()
    # The first chunk computes blocks 0 and 1; their WRITEs wait for the device.
    _step(pair.prefill, _prefill(computed=8))
    job = pair.prefill.sender.jobs["p-1"]
    assert job.written == 2 and pair.writes == []
    # vLLM preempts the request and frees blocks 5, 6 before the GPU finished the step.
    _step(pair.prefill, KVPushMetadata(preempted={"p-1"}))
    pair.device.complete()
    for _ in range(2):
        _step(pair.prefill)
    assert pair.writes == []
    assert job.written == 0  # nothing of it was written
    assert job.state is PushState.PUSHING
    # Rescheduled with new blocks and recomputed: every block comes from the new ones.
    new = [2, 3, 4]
    _step(pair.prefill, _prefill(target=False, block_ids=new, restarted=True))
    pair.device.complete()
    pair.prefill.get_transfer_results()
    assert pair.regions() == [[r] for r in range(len(LAYERS))]
    assert all(x.handle.local_blocks == new for x in pair.writes)


def test_failed_push_drops_its_pending_posts_and_seals_at_once(make_pair) -> None:
    pair = make_pair()
    _step(pair.decode, _recv())
    _step(pair.prefill, _prefill())
    # Decode ended the request first: the push is cancelled before its event completed.
    _step(pair.prefill, KVPushMetadata(cancel={"p-1"}))
    job = pair.prefill.sender.jobs["p-1"]
    assert job.state is PushState.ABORTED and job.notified
    assert not pair.prefill.sender._posts.holds(job)
    pair.device.complete()
    _step(pair.prefill)
    assert pair.writes == []


def test_host_device_posts_at_the_hook(make_pair) -> None:
    """On a CPU every kernel has run when the hook is called: WRITEs leave from it."""
    pair = make_pair(host=True)
    _step(pair.decode, _recv())
    pair.prefill.on_metadata(_prefill())
    for i, name in enumerate(LAYERS):
        pair.prefill.save_kv_layer(name)
        assert pair.regions() == [[r] for r in range(i + 1)]
    assert not pair.prefill.sender._posts
    pair.prefill.wait_for_save()
    _step(pair.prefill)
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.landed() and len(pair.writes) == len(LAYERS)


def test_decode_makes_received_kv_visible_once_per_call_with_a_success(make_pair) -> None:
    pair = make_pair(host=True)
    _step(pair.decode, _recv())
    assert pair.decode_device.visible_calls == 0  # nothing received yet
    _step(pair.prefill, _prefill())
    _step(pair.prefill)
    assert _step(pair.decode) == (set(), {"d-1"}, set())
    assert pair.decode_device.visible_calls == 1
    _step(pair.decode)
    assert pair.decode_device.visible_calls == 1


def _config(extra: dict[str, Any] | None, mode: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        compilation_config=SimpleNamespace(cudagraph_mode=mode))


@pytest.mark.parametrize(("extra", "mode", "expected"), [
    ({}, None, PUSH_LAYERWISE),  # layer-wise is the default
    ({"layerwise": True}, "PIECEWISE", PUSH_LAYERWISE),
    ({}, "FULL_AND_PIECEWISE", PUSH_LAYERWISE),  # batches with prefill run piecewise
    ({}, "FULL_DECODE_ONLY", PUSH_LAYERWISE),
    ({}, "FULL", PUSH_PER_STEP),  # a full graph's replay skips the layer hooks
    ({"layerwise": False}, "PIECEWISE", PUSH_PER_STEP),
    ({"layerwise": "false"}, None, PUSH_PER_STEP),  # read as the connector reads it
])
def test_push_mode_from_the_config(extra: dict[str, Any], mode: object, expected: str
                                   ) -> None:
    assert push_mode(_config(extra, mode)) == expected


def test_push_mode_of_a_partial_config_and_the_cuda_graph_enum() -> None:
    from vllm.config.compilation import CUDAGraphMode

    assert push_mode(SimpleNamespace(kv_transfer_config=None)) == PUSH_LAYERWISE
    assert push_mode(None) == PUSH_LAYERWISE
    assert push_mode(_config(None, CUDAGraphMode.FULL)) == PUSH_PER_STEP
    assert push_mode(_config(None, CUDAGraphMode.PIECEWISE)) == PUSH_LAYERWISE
    assert layerwise_on({"layerwise": "off"}) is False
    assert layerwise_on({"layerwise": "not-a-bool"}) is True  # refused at start anyway


def test_push_mode_metric_and_piecewise_requirement() -> None:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvpush.connector.push_connector import KVPushConnector
    from kvpush.connector.stats import KVPushPromMetrics

    assert KVPushConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVPushConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    KVPushPromMetrics(_config({"layerwise": False}, "PIECEWISE"), types,
                      ["model_name", "engine"], {0: ["tiny", "0"]})
    samples = {tuple(sorted(s.labels.items())): s.value
               for fam in REGISTRY.collect() for s in fam.samples
               if s.name == "kvpush_push_mode_info"}
    assert samples == {(("engine", "0"), ("mode", PUSH_PER_STEP), ("model_name", "tiny")): 1}
