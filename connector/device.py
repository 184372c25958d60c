"""The device seam: when a layer's KV is really in the cache, and when received KV is
visible to the engine's kernels.

vLLM calls ``save_kv_layer`` once the layer's kernels are *queued*. On a GPU they finish
later, and a NIXL WRITE reads device memory outside any stream's order, so a WRITE posted
at the hook could send bytes ``reshape_and_cache`` has not written yet. The sender records
an event on the computing stream at each hook and posts that layer's WRITEs only once the
event completed, polling it without ever blocking the forward pass. On a CPU every kernel
has run by the time the hook is called: the event is complete at once and costs nothing.
"""

from __future__ import annotations

from typing import Any, Protocol


class Event(Protocol):
    """A point in a device stream's work."""

    def ready(self) -> bool:
        """True once every kernel queued before the point has completed (non-blocking)."""
        ...


class Device(Protocol):
    """Where the KV cache lives, as the push needs to know it."""

    name: str

    def record(self) -> Event:
        """An event after the work queued so far on the stream computing the model."""
        ...

    def make_visible(self) -> None:
        """Make KV that peers wrote into this device's memory visible to its kernels."""
        ...


class _Done:
    """An event that has always completed."""

    __slots__ = ()

    def ready(self) -> bool:
        return True


DONE: Event = _Done()


class HostDevice:
    """A CPU cache: kernels are synchronous, so every event is complete when recorded."""

    name = "cpu"

    def record(self) -> Event:
        return DONE

    def make_visible(self) -> None:
        """Direct writes into host memory are visible once the transport reports them."""


class _CudaEvent:
    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def ready(self) -> bool:
        return bool(self._event.query())


class CudaDevice:
    """A CUDA (or ROCm) cache: one ``torch.cuda.Event`` per recorded point, on the stream
    that is current when the hook runs (the one vLLM computes the layer on)."""

    def __init__(self, index: int) -> None:
        import torch

        self._torch = torch
        self.index = index
        self.name = f"cuda:{index}"

    def record(self) -> Event:
        torch = self._torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.index))
        return _CudaEvent(event)

    def make_visible(self) -> None:
        # A NIC or a peer's copy engine wrote the blocks outside this device's streams;
        # synchronizing orders the engine's next kernels after those writes (what vLLM's
        # own connector does before running directly received KV where it is needed).
        self._torch.cuda.synchronize(self.index)


def device_of(tensor: Any) -> Device:
    """The device seam for a KV cache tensor."""
    kind = tensor.device.type
    if kind == "cpu":
        return HostDevice()
    if kind == "cuda":
        return CudaDevice(tensor.get_device())
    raise ValueError(f"no device seam for KV caches on {kind!r}")


class FakeEvent:
    """An event of :class:`FakeDevice`: completes when the test says so."""

    __slots__ = ("done", "seq")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.done = False

    def ready(self) -> bool:
        return self.done


class FakeDevice:
    """A device whose events complete later, under a test's control (as a GPU's do), so
    the order of WRITEs against layer events can be checked on a CPU."""

    name = "fake"

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.visible_calls = 0

    def record(self) -> Event:
        event = FakeEvent(len(self.events))
        self.events.append(event)
        return event

    def complete(self, upto: int | None = None) -> None:
        """Complete every event recorded so far (or the first ``upto``)."""
        for event in self.events[:upto]:
            event.done = True

    def make_visible(self) -> None:
        self.visible_calls += 1
