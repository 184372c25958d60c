"""What the connector refuses at startup, naming the shape: mamba / linear attention and
other KV cache specs it cannot push, pipeline and context parallelism."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpush.connector.push_connector import (
    UnsupportedDeployment,
    _check_supported,
    _group_windows,
    _layer_groups,
)


def _spec(cls: type, **fields: Any) -> Any:
    """A KV cache spec of ``cls`` without its constructor (only its type matters here)."""
    spec = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(spec, k, v)
    return spec


def _config(pp: int = 1, dcp: int = 1) -> Any:
    par = SimpleNamespace(pipeline_parallel_size=pp, decode_context_parallel_size=dcp,
                          prefill_context_parallel_size=1)
    return SimpleNamespace(parallel_config=par)


def _groups(*specs: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}a", f"l{i}b"])
        for i, s in enumerate(specs)])


def test_full_mla_and_sliding_groups_are_pushed() -> None:
    kv = _groups(_spec(FullAttentionSpec), _spec(SlidingWindowSpec, sliding_window=128))
    _check_supported(_config(), kv)
    _check_supported(_config(), _groups(_spec(MLAAttentionSpec)))
    assert _group_windows(kv) == [0, 128]
    assert _layer_groups(kv) == {"l0a": 0, "l0b": 0, "l1a": 1, "l1b": 1}


@pytest.mark.parametrize(("cls", "name"), [(MambaSpec, "MambaSpec"),
                                           (ChunkedLocalAttentionSpec,
                                            "ChunkedLocalAttentionSpec")])
def test_specs_it_cannot_push_are_refused_by_name(cls: type, name: str) -> None:
    with pytest.raises(UnsupportedDeployment, match=f"group 1 \\({name}"):
        _check_supported(_config(), _groups(_spec(FullAttentionSpec), _spec(cls)))


def test_pipeline_and_context_parallelism_are_refused() -> None:
    with pytest.raises(UnsupportedDeployment, match="pipeline_parallel_size=1"):
        _check_supported(_config(pp=2), None)
    with pytest.raises(UnsupportedDeployment, match="context parallelism"):
        _check_supported(_config(dcp=2), None)
