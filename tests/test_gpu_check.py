"""scripts/gpu_check.py in CPU mode (issue #48): its arguments, its copy of vLLM's layout
strides and cache views, a real two-agent NIXL push over DRAM, the failures it must report,
and that it imports only what a bare GPU box has (torch, numpy, msgspec, nixl)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.worker_util import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


gpu_check = load_script(SCRIPT)


def _run(*args: str, timeout: float = 90, fault: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVPUSH_GPU_CHECK_FAULT"}
    if fault:
        env["KVPUSH_GPU_CHECK_FAULT"] = fault
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--layouts", "LBNHC,XYZ"], "unknown KV cache layout 'XYZ'"),
    (["--blocks", "0"], "0 is not a positive integer"),
    (["--heads", "two"], "invalid positive value: 'two'"),
    (["--dtype", "fp16"], "invalid choice: 'fp16'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--timeout", "1"], "--timeout must be between"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    done = _run("--check-args", "--device", "cpu", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_check_args_on_cpu_prints_the_plan() -> None:
    done = _run("--check-args", "--device", "cpu", "--layouts", "nhd,BLHNC", "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NIXL nixl_cu" in done.stdout
    assert "would run on cpu: layouts LBNHC,BLHNC, bf16, 4 layers x 3 blocks" in done.stdout


def test_check_args_for_cuda_without_a_gpu_names_the_problem() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = _run("--check-args")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu-check: --device cuda: torch.cuda.is_available() is False (torch "
        f"{torch.__version__}, CUDA build None)"]


SHAPES = [  # (layers, blocks, kv heads, block size, head size, dtype)
    (3, 10, 8, 16, 128, "bfloat16"),
    (2, 7, 1, 32, 64, "float8_e4m3fn"),
    (5, 4, 3, 16, 80, "float16"),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + s[5])
def test_strides_and_views_equal_vllms_for_every_layout(shape: tuple) -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvpush.connector.page_layout import LAYOUTS

    layers, blocks, heads, block_size, head_size, dtype = shape
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=getattr(torch, dtype))
    cell = 2 * head_size * spec.dtype.itemsize
    assert spec.state_content_size_bytes == cell
    cfg = gpu_check.Config(device="cpu", layouts=(), dtype="bf16", layers=layers,
                           blocks=blocks, block_size=block_size, heads=heads,
                           head_size=head_size, timeout=60)
    assert {m.name for m in KVCacheLayout} == set(LAYOUTS)
    for member in KVCacheLayout:
        assert LAYOUTS[member.name] == member.value
        ours = gpu_check.layout_strides(member.value, (layers, blocks, heads, block_size, cell))
        assert ours == compute_layout_strides(spec, blocks, layers, member), member.name
        if dtype != "bfloat16":
            continue
        # The views the check builds are the ones vLLM hands the attention backend.
        raw, views = gpu_check.build_cache(torch, cfg, member.name, blocks, "cpu")
        tensor = KVCacheTensor(size=raw.numel(), layers=[f"l{i}" for i in range(layers)],
                               layer_stride=ours[0], block_stride=ours[1])
        want = create_kv_cache_views(raw.view(torch.int8), spec, blocks, member, tensor)
        for got, ref in zip(views, want, strict=True):
            assert (got.shape, got.stride(), got.dtype) == (ref.shape, ref.stride(), ref.dtype)
            assert got.data_ptr() == ref.data_ptr(), member.name


def _layout_lines(out: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w{5}) +(ok|FAIL)\b", out, re.M)}


def test_cpu_quick_run_pushes_every_default_layout_byte_exact() -> None:
    started = time.monotonic()
    done = _run("--device", "cpu", "--quick", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _layout_lines(done.stdout) == dict.fromkeys(gpu_check.DEFAULT_LAYOUTS, "ok")
    assert "CRCs 12/12" in done.stdout  # 4 layers x 3 blocks, the partial one included
    assert done.stdout.strip().splitlines()[-1].startswith("gpu-check: PASS: 4/4 layouts")
    assert time.monotonic() - started < 60


def test_packed_and_legacy_layouts_in_fp8() -> None:
    done = _run("--device", "cpu", "--quick", "--dtype", "fp8", "--layouts",
                "BLNHC,BHLNC,HND", "--layers", "3", "--block-size", "5", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _layout_lines(done.stdout) == {"BLNHC": "ok", "BHLNC": "ok", "LBHNC": "ok"}


def test_a_misplaced_write_fails_the_layout() -> None:
    done = _run("--device", "cpu", "--quick", "--layouts", "LHBNC", fault="misplace")
    assert done.returncode == 1, done.stdout + done.stderr
    assert _layout_lines(done.stdout) == {"LHBNC": "FAIL"}
    assert "layer 3 block 2 (decode 6): CRC" in done.stdout
    assert "bytes differ from prefill's source page" in done.stdout
    assert "bytes outside the target pages changed" in done.stdout
    assert "K/V elements of prompt tokens differ from the kernel's" in done.stdout
    assert "gpu-check: FAIL: 0/1 layouts" in done.stdout


def test_a_frozen_peer_ends_at_the_deadline() -> None:
    started = time.monotonic()
    done = _run("--device", "cpu", "--quick", "--timeout", "10", fault="freeze", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("decode failed: deadline passed waiting for notification 'done LBNHC'"
            in done.stdout)
    assert time.monotonic() - started < 30


# Imports of the script and of everything its agents run, in a fresh interpreter that
# already holds what the GPU box has (torch, numpy): only msgspec, NIXL and the repo's
# connector/common may come on top, and kvpush from the repo without installing it.
_PROBE = """
import json, sys
import numpy, torch
before = {m.split(".")[0] for m in sys.modules}
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = mod
spec.loader.exec_module(mod)
mod.use_repo()
mod.load_nixl()
import kvpush.connector.device, kvpush.connector.nixl_transport
new = {m.split(".")[0] for m in sys.modules} - before - set(sys.stdlib_module_names)
print(json.dumps({"new": sorted(new), "file": kvpush.connector.__file__,
                  "kvpush": sorted(m for m in sys.modules if m.startswith("kvpush"))}))
"""


def test_imports_only_what_a_bare_gpu_box_has() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE, str(SCRIPT)], capture_output=True,
                          text=True, timeout=60, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(probe["new"]) <= {"gpu_check", "kvpush", "msgspec", "nixl", "nixl_cu12",
                                 "nixl_cu13", "nixl_meta_utils"}, probe["new"]
    assert set(probe["kvpush"]) <= {
        "kvpush", "kvpush.common", "kvpush.common.wire", "kvpush.connector",
        "kvpush.connector.device", "kvpush.connector.nixl_transport",
        "kvpush.connector.page_layout", "kvpush.connector.transport"}, probe["kvpush"]
    # Through the script's own kvpush directory, not the editable install.
    assert "/kvpush-gpu-check-" in probe["file"], probe["file"]
