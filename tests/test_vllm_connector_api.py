"""``scripts/check_vllm_connector_api.py``: the connector's interface against a vLLM base.

The installed vLLM (the release every other test proves against) must pass; a synthetic
``base.py`` with a new abstract method and a renamed parameter must fail naming both. The
check reads sources only, so none of this imports vLLM.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from tests.worker_util import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_vllm_connector_api.py"


check_api = load_script(SCRIPT)

# A vLLM that grew an abstract scheduler hook and renamed save_kv_layer's ``kv_layer``.
SYNTHETIC_BASE = '''
from abc import ABC, abstractmethod
from typing import Any


class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None): ...

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_cache, attn_metadata, **kwargs): ...

    @abstractmethod
    def wait_for_save(self): ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    @abstractmethod
    def prepare_step(self, scheduler_output) -> None: ...
'''


def test_installed_vllm_base_is_compatible(capsys):
    base = check_api.installed_base()
    assert base is not None, "vLLM is not installed in this interpreter"
    assert check_api.main([]) == 0
    out = capsys.readouterr().out
    assert "problem:" not in out
    assert out.rstrip().endswith("compatible")
    # The installed release is its own reference: nothing is new to it.
    assert "info: new in" not in out
    # The installed release's KVCacheLayout members are the ones page_layout addresses.
    assert "KVCacheLayout members in" in out


def test_synthetic_base_with_new_abstract_method_and_renamed_parameter_fails(tmp_path, capsys):
    base = tmp_path / "base.py"
    base.write_text(SYNTHETIC_BASE)
    assert check_api.main([str(base)]) == 1
    lines = capsys.readouterr().out.splitlines()
    problems = [line for line in lines if line.startswith("problem: ")]
    assert lines[-1] == f"{len(problems)} problem(s)"
    assert any("save_kv_layer" in p and "`kv_cache`" in p and "`kv_layer`" in p
               for p in problems), problems
    assert any(p.startswith("problem: prepare_step: abstract in KVConnectorBase_V1")
               and "not implemented by KVPushConnector" in p for p in problems), problems
    assert "info: new in KVConnectorBase_V1: prepare_step(scheduler_output) (abstract)" in lines
    # A hook the connector overrides that this base no longer has: vLLM stops calling it.
    assert any(p.startswith("problem: has_pending_push_work: overridden by KVPushConnector "
                            "but no longer defined") for p in problems), problems
    # The matching methods are not reported.
    assert not any(p.startswith(("problem: wait_for_layer_load", "problem: __init__"))
                   for p in problems), problems


def _method(src: str) -> object:
    cls = ast.parse(textwrap.dedent(src)).body[0]
    assert isinstance(cls, ast.ClassDef)
    return next(iter(check_api.class_methods(cls).values()))


@pytest.mark.parametrize(("base", "ours", "problem", "note"), [
    # An optional parameter only the base has is fine while vLLM leaves it out.
    ("def f(self, a, b=None): ...", "def f(self, a): ...", None, "`b`"),
    ("def f(self, a, *, b=None): ...", "def f(self, a): ...", None, "`b`"),
    # ... and absorbed by **kwargs.
    ("def f(self, a, *, b): ...", "def f(self, a, **kw): ...", None, None),
    ("def f(self, a, b): ...", "def f(self, a): ...", "required parameter `b`", None),
    ("def f(self, a, **kw): ...", "def f(self, a): ...", "(**kwargs)", None),
    ("def f(self, a=1): ...", "def f(self, a): ...", "has a default", None),
    ("def f(self, a): ...", "def f(self, a, /): ...", "positional-only", None),
    ("def f(self, a): ...", "def f(self, a, b): ...", "requires `b`", None),
    ("def f(self, a): ...", "def f(self, a, b=0, *, c=1): ...", None, None),
    ("def f(self, a): ...", "@classmethod\ndef f(cls, a): ...", "instance in", None),
    ("@classmethod\ndef f(cls, x): ...", "@classmethod\ndef f(klass, x): ...", None, None),
])
def test_parameter_rules(base, ours, problem, note):
    b = _method("class KVConnectorBase_V1:\n" + textwrap.indent(base, "    "))
    o = _method("class KVPushConnector:\n" + textwrap.indent(ours, "    "))
    problems, notes = check_api.compare(b, o)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0], notes
