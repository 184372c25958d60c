"""Every request field of vLLM's completion, chat and responses models is handled by the
gateway: forwarded (with a sample the real-engine conformance test sends) or refused with a
400 naming it. A field vLLM adds fails this test until it is classified in
``tests/openai_fields.py``."""

from __future__ import annotations

import pytest

from kvpush.services.gateway.openai_api import (
    BadRequest,
    parse_chat,
    parse_completion,
    parse_responses,
)
from tests.openai_fields import REFUSED, TABLES, unclassified, vllm_models

_BASE = {"completions": {"prompt": "hello"},
         "chat": {"messages": [{"role": "user", "content": "hello"}]},
         "responses": {"input": "hello"}}
_PARSE = {"completions": lambda b: parse_completion(b),
          "chat": lambda b: parse_chat(b, 16),
          "responses": lambda b: parse_responses(b, 16)}


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_every_vllm_field_is_forwarded_or_refused(endpoint: str) -> None:
    assert unclassified(endpoint, vllm_models()[endpoint]) == []


@pytest.mark.parametrize("endpoint", list(TABLES))
def test_refused_fields_are_named_and_samples_pass_the_gateways_schema(endpoint: str) -> None:
    for field, sample in TABLES[endpoint].items():
        body = {**_BASE[endpoint], field: True if sample is REFUSED else sample}
        if sample is REFUSED:
            with pytest.raises(BadRequest) as exc:
                _PARSE[endpoint](body)
            assert exc.value.param == field, (endpoint, field)
        else:
            _PARSE[endpoint](body)  # the engine, not the gateway, judges the sample
