"""Local model builder: deterministic, idempotent, rebuilt when half built, right KV size."""

from __future__ import annotations

import json

import pytest

from kvpush.common.settings import CommonSettings
from kvpush.services.local import models


@pytest.fixture
def settings(tmp_path) -> CommonSettings:
    return CommonSettings(model_dir=tmp_path / "models")


def test_kv_heavy_matches_llama3_8b_kv_bytes():
    spec = models.model_spec("kv-heavy")
    assert spec.kv_bytes_per_token == 131072
    assert spec.dtype == "bfloat16"
    # The tiny model moves about 2 KiB per token, as the anchors assume.
    assert models.model_spec("tiny").kv_bytes_per_token == 2048


def test_kv_bytes_from_built_config(settings):
    path = models.ensure_model("tiny", settings)
    cfg = json.loads((path / "config.json").read_text())
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert kv == models.model_spec("tiny").kv_bytes_per_token
    assert cfg["max_position_embeddings"] >= 4096


def test_build_is_deterministic_and_idempotent(settings, tmp_path):
    path = models.ensure_model("tiny", settings)
    marker = path / models.MARKER
    first_mtime = marker.stat().st_mtime_ns
    first_hash = models.weights_hash(path)
    first_cfg = (path / "config.json").read_text()

    # A second call finds the marker and builds nothing.
    assert models.ensure_model("tiny", settings) == path
    assert marker.stat().st_mtime_ns == first_mtime

    # A build elsewhere yields the same config and the same weights.
    other = models.ensure_model("tiny", CommonSettings(model_dir=tmp_path / "other"))
    assert other != path
    assert models.weights_hash(other) == first_hash
    assert (other / "config.json").read_text() == first_cfg
    assert (other / "tokenizer.json").read_text() == (path / "tokenizer.json").read_text()


def test_half_built_model_is_rebuilt(settings):
    path = models.model_path("tiny", settings)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{ truncated")
    assert not models.is_built(path)
    models.ensure_model("tiny", settings)
    assert models.is_built(path)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 4


def test_tokenizer_and_chat_template(settings):
    from transformers import AutoTokenizer

    path = models.ensure_model("tiny", settings)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) <= models.VOCAB_SIZE
    text = "def main(argv):\n    return 0\n"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n")


def test_unknown_model_is_a_named_error(settings):
    with pytest.raises(models.UnknownModel):
        models.ensure_model("gpt-5", settings)


@pytest.mark.parametrize(("name", "arch", "attention", "kv_bytes"), [
    ("mla", "DeepseekV2ForCausalLM", "mla", 4 * 576 * 2),
    ("hybrid", "Gemma2ForCausalLM", "sliding/full", 2048),
    ("sliding", "MistralForCausalLM", "sliding", 2048),
])
def test_model_shapes_build_from_their_configs(settings, name, arch, attention, kv_bytes):
    """Each shape's config says what the connector sees: MLA's 576-wide latent, the
    hybrid's alternating layer types and a window shorter than the test prompts."""
    spec = models.model_spec(name)
    assert spec.attention == attention and spec.kv_bytes_per_token == kv_bytes
    cfg = json.loads((models.ensure_model(name, settings) / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    if name == "mla":
        assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
        assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]  # no MoE weights
    else:
        assert cfg["sliding_window"] == 128
    if name == "hybrid":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2


def test_models_list_into_a_reader_that_stops_early_is_not_a_traceback(tmp_path):
    """`kvpush models list | head -1`: the pipe closing under the listing ends it quietly."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVPUSH_MODEL_DIR": str(tmp_path)}
    # A pipe whose reader has gone: every write from the listing raises EPIPE.
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvpush.services.cli", "models", "list"],
                              stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=60)
    finally:
        os.close(write)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
