"""C kernels for the CPU path (cpu_kernels.c): decode attention over the heads-major paged cache and the cache write.

Built on first use with the system C compiler (`cc -O3 -march=native`, with OpenMP when the compiler has it) into a
per-user cache directory, keyed by the source, the flags and the CPU, and loaded with ctypes: a build takes about
half a second once, later starts only load it. Without a compiler `library()` is None and the torch backend keeps
its torch-op path, which computes the same thing."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# OpenMP for threads and for the `omp simd` reductions; without it, the simd pragmas alone, then plain -O3
FLAG_SETS = (
    ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
    ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd"],
    ["-O3"],
)
LANES, MAX_GROUP, MAX_DIM, MAX_BLOCK_VALUES = 16, 16, 256, 8192  # the C kernels' limits (cpu_kernels.c)
_BF16 = {torch.float32: 0, torch.bfloat16: 1}  # the dtypes the kernels take

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_DECODE_ARGS = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, *[_i64] * 6, _f32, _i64, _int]
_WRITE_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _int]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pagedllm" / "kernels"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return "".join(line for line in lines[:30] if line.startswith(("model name", "flags")))


def _build(compiler: str) -> Path | None:
    source = SOURCE.read_bytes()
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
        target = _cache_dir() / f"cpu_kernels-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
                return target
            logger.debug("CPU kernels: %s failed: %s", " ".join(cmd), proc.stderr[-2000:])
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None when no C compiler can build them (the torch-op path runs instead)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        logger.info("no C compiler found: the CPU attention runs on torch ops")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path)) if path is not None else None
    except OSError as e:
        logger.info("CPU kernels unavailable (%s): the CPU attention runs on torch ops", e)
        return None
    if lib is None:
        logger.info("CPU kernels did not build: the CPU attention runs on torch ops")
        return None
    lib.decode_attention.argtypes = _DECODE_ARGS
    lib.write_kv.argtypes = _WRITE_ARGS
    return lib


def supports(q: torch.Tensor, num_kv_heads: int, block_size: int) -> bool:
    """Whether the C kernels take this attention: CPU, float32 or bfloat16, sizes within the kernels' limits, and a
    built library."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in _BF16
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_DIM
        and head_dim % LANES == 0
        and block_size * head_dim <= MAX_BLOCK_VALUES
        and library() is not None
    )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    for cache in (k_cache, v_cache):  # [num_kv_heads, num_blocks, block_size * head_dim]
        assert cache.is_contiguous() and cache.dim() == 3 and cache.dtype == dtype


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], each token's heads in one run
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim] (K transposed in each block)
    v_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim]
    slots: torch.Tensor,  # [num_tokens] int64; below 0: not written
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == head_dim
    assert slots.dtype == torch.int64 and slots.is_contiguous()
    _check_cache(k_cache, v_cache, k.dtype)
    library().write_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_dim,
        k_cache.shape[2] // head_dim,
        k_cache.shape[1],
        _BF16[k.dtype],
    )


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], head_dim contiguous
    out: torch.Tensor,  # like q: receives the decode rows
    token_rows: torch.Tensor,  # [num_reqs] int64: the row of q and out of each decode
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim] (K transposed in each block)
    v_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim]
    block_table: torch.Tensor,  # [num_reqs, >= blocks of the longest] int64, rows contiguous
    seq_lens: torch.Tensor,  # [num_reqs] int64
    scale: float,
    sliding_window: int | None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and q.dtype == out.dtype
    for index in (token_rows, block_table, seq_lens):
        assert index.dtype == torch.int64 and index.stride(-1) == 1
    _check_cache(k_cache, v_cache, q.dtype)
    library().decode_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        token_rows.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        len(seq_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[2] // head_dim,
        num_blocks,
        scale,
        sliding_window or 0,
        _BF16[q.dtype],
    )
