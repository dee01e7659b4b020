"""C kernels for the CPU path: decode attention over the torch backend's paged cache, the cache write, and the
decoder layers' element-wise ops (RMSNorm with its residual add, SiLU-and-mul, rotary of q and k) in cpu_kernels.c;
bfloat16 linear layers on AMX tiles in cpu_matmul.c; GGUF-quantized linear layers in cpu_quant.c (wrapped by
cpu_quant.py); the sampler's draw, logprobs and penalties in cpu_sampling.c
(wrapped by cpu_sampling.py).

Built on first use with the system C compiler (`cc -O3 -march=native`, with OpenMP when the compiler has it) into a
per-user cache directory, keyed by the source, the compiler, the flags and the CPU, and loaded with ctypes: a build
takes about a second once, later starts only load it. Without a compiler `compiled()` is None and the torch backend
keeps its torch-op path, which computes the same thing."""

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

from pagedllm import envs

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_kernels.c", "cpu_matmul.c", "cpu_sampling.c", "cpu_logprobs.c", "cpu_logits.c", "cpu_quant.c")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_vectors.h", "cpu_rows.h"))  # part of the build's key
# OpenMP for threads and for the `omp simd` reductions; without it, the simd pragmas alone; where -march=native is
# refused, generic code (still threaded when OpenMP is there). First, on x86, loops vectorized at AVX-512's full width
# where the CPU has it (GCC prefers 256-bit vectors on Intel CPUs; at 512 the element-wise kernels ran 20-30% faster);
# other compilers and CPUs refuse the flag and take the next set.
FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp"],
    ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
    ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd"],
    ["-O3", "-fno-math-errno", "-fopenmp"],
    ["-O3", "-fno-math-errno"],
)
LANES, MAX_GROUP, MAX_DIM, MAX_BLOCK_VALUES = 16, 16, 256, 8192  # the C kernels' limits (cpu_kernels.c)
_BF16 = {torch.float32: 0, torch.bfloat16: 1}  # the dtypes the kernels take

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_DECODE_ARGS = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, *[_i64] * 6, _f32, _i64, _int]
_WRITE_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]
_NORM_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int]
_SILU_ARGS = [_ptr, _i64, _ptr, _i64, _i64, _int]
_SAMPLE_ARGS = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
_ARGMAX_ARGS = [_ptr, _i64, _i64, _i64, _ptr, _int]
_LOGPROBS_ARGS = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
_BITMASK_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _int]
_PENALTIES_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _int]
_PACK_TILES_ARGS = [_ptr, _i64, _ptr, _i64, _i64]
_LINEAR_TILES_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
_ROTARY_ARGS = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _f32, _f32, _int]


def _cache_dir() -> Path:
    return Path(envs.cache_root()) / "kernels"


_CPU_FIELDS = ("vendor_id", "cpu family", "model", "flags", "Features", "CPU implementer", "CPU architecture")


def _cpu_id() -> str:
    """What -march=native compiles for: the first CPU's identity and features from /proc/cpuinfo (x86 and ARM
    name them differently), with the machine and processor names."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        lines = []
    fields = [line for line in lines if line.split(":")[0].strip() in _CPU_FIELDS or line.startswith("CPU part")]
    return "|".join([platform.machine(), platform.processor(), *fields])


def _build(compiler: str) -> Path | None:
    """The kernels' library for this source, compiler and CPU: the cached one, else built now with the first flag
    set that compiles. A flag set that failed leaves a marker, so later starts do not try it again."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"|".join([source, " ".join([compiler, *flags]).encode(), _cpu_id().encode()]))
        target = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        failed = target.with_suffix(".failed")
        if target.exists():
            return target
        if failed.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = compile_source(compiler, flags, out)
            if proc.returncode == 0:
                os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
                return target
            logger.debug("CPU kernels: %s failed: %s", " ".join(proc.args), proc.stderr[-2000:])
            failed.write_text(proc.stderr[-2000:])
    return None


def find_compiler() -> str | None:
    """$CC, else the first of cc, gcc and clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compile_source(compiler: str, flags: list[str], out: Path) -> subprocess.CompletedProcess:
    """The C sources built with `flags` into one shared library `out`."""
    cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(out), *map(str, SOURCES), "-lm"]
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.cache
def compiled() -> ctypes.CDLL | None:
    """The built kernels, or None when no C compiler can build them (the torch-op path runs instead)."""
    compiler = find_compiler()
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
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' argument types, set on a loaded library."""
    lib.decode_attention.argtypes = _DECODE_ARGS
    lib.write_kv.argtypes = _WRITE_ARGS
    lib.rms_norm.argtypes = _NORM_ARGS
    lib.silu_and_mul.argtypes = _SILU_ARGS
    lib.qk_rotary.argtypes = _ROTARY_ARGS
    lib.sample_rows.argtypes = _SAMPLE_ARGS
    lib.argmax_rows_bf16.argtypes = _ARGMAX_ARGS
    lib.logprobs_rows.argtypes = _LOGPROBS_ARGS
    lib.apply_penalties.argtypes = _PENALTIES_ARGS
    lib.apply_bitmask.argtypes = _BITMASK_ARGS
    lib.pack_tiles.argtypes = _PACK_TILES_ARGS
    lib.linear_tiles.argtypes = _LINEAR_TILES_ARGS
    lib.linear_tiles.restype = _int
    lib.matmul_tiles.argtypes = []
    lib.matmul_tiles.restype = _int
    lib.full_width_vectors.argtypes = []
    lib.full_width_vectors.restype = _int
    lib.sampling_scratch_floats.argtypes = [_i64]
    lib.sampling_scratch_floats.restype = _i64
    return lib


def runs(x: torch.Tensor) -> bool:
    """Whether the element-wise C kernels take `x`: a float32 or bfloat16 CPU tensor, and a built library."""
    return x.device.type == "cpu" and x.dtype in _BF16 and compiled() is not None


def supports(q: torch.Tensor, num_kv_heads: int, block_size: int) -> bool:
    """Whether the C kernels take this attention: CPU, float32 or bfloat16, sizes within the kernels' limits, and a
    library built with AVX-512 (their 16-float vectors; without it they ran 1.3-3x slower than the torch ops)."""
    return _supports(q.device.type, q.dtype, q.shape[1], num_kv_heads, q.shape[2], block_size)


@functools.cache
def _supports(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    return (
        device == "cpu"
        and dtype in _BF16
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_DIM
        and head_dim % LANES == 0
        and block_size * head_dim <= MAX_BLOCK_VALUES
        and compiled() is not None
        and bool(compiled().full_width_vectors())
    )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    for cache in (k_cache, v_cache):  # [num_kv_heads, num_blocks, block_size * head_dim]
        assert cache.is_contiguous() and cache.dim() == 3 and cache.dtype == dtype


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, heads, dim] with each token's heads in one run (rows may be strided), as the kernels read it."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [num_tokens] int64; below 0: not written
) -> None:
    """Writes the new tokens' K/V to their slots."""
    num_tokens, num_kv_heads, head_dim = k.shape
    k, v = _heads_contiguous(k), _heads_contiguous(v)
    assert slots.dtype == torch.int64 and slots.is_contiguous()
    _check_cache(k_cache, v_cache, k.dtype)
    compiled().write_kv(
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
        k_cache.shape[1] * k_cache.shape[2] // head_dim,
        _BF16[k.dtype],
    )


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], head_dim contiguous
    out: torch.Tensor,  # like q: receives the attended rows
    token_rows: torch.Tensor,  # [num_rows] int64: the token (row of q and out) of each paged row
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size * head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_rows, >= blocks of the longest] int64, rows contiguous
    seq_lens: torch.Tensor,  # [num_rows] int64
    scale: float,
    sliding_window: int | None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and q.dtype == out.dtype
    for index in (token_rows, block_table, seq_lens):
        assert index.dtype == torch.int64 and index.stride(-1) == 1
    _check_cache(k_cache, v_cache, q.dtype)
    compiled().decode_attention(
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


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with contiguous rows (a view when the strides allow)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor,  # [..., n]
    weight: torch.Tensor,  # [n]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual)."""
    n = x.shape[-1]
    x2 = contiguous_rows(x)
    r2 = contiguous_rows(residual) if residual is not None else None
    weight = weight.to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    compiled().rms_norm(
        x2.data_ptr(),
        x2.stride(0),
        r2.data_ptr() if r2 is not None else None,
        r2.stride(0) if r2 is not None else 0,
        summed.data_ptr() if summed is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        x2.shape[0],
        n,
        eps,
        _BF16[x.dtype],
    )
    return out if summed is None else (out, summed)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    d = x.shape[-1] // 2
    x2 = contiguous_rows(x)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    compiled().silu_and_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], d, _BF16[x.dtype])
    return out


def qk_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim / 2] in the model dtype
    sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # Qwen3's per-head (q_norm, k_norm) weights
    eps: tuple[float, float] = (0.0, 0.0),  # their epsilons
) -> tuple[torch.Tensor, torch.Tensor]:
    """The neox rotation of q and k (after their per-head RMSNorm when given), as new contiguous tensors."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k = _heads_contiguous(q), _heads_contiguous(k)
    cos, sin = cos.reshape(num_tokens, -1).contiguous(), sin.reshape(num_tokens, -1).contiguous()
    q_norm = k_norm = None
    if norm_weights is not None:
        q_norm, k_norm = (w.to(q.dtype).contiguous() for w in norm_weights)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    compiled().qk_rotary(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        q_out.data_ptr(),
        k_out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        q_norm.data_ptr() if q_norm is not None else None,
        k_norm.data_ptr() if k_norm is not None else None,
        *eps,
        _BF16[q.dtype],
    )
    return q_out, k_out


def matmul_tiles() -> bool:
    """Whether the bfloat16 linear layers run on AMX tiles here (cpu_matmul.c): a CPU with AMX, a library built
    for it, and an OS that lets this process use the tiles."""
    lib = compiled()
    return lib is not None and _tiles_usable(lib)


@functools.cache
def _tiles_usable(lib: ctypes.CDLL) -> bool:
    return bool(lib.matmul_tiles())


def pack_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 weight [n, k] packed for linear_tiles, [n / 16, k / 32, 16, 32] (the same values, one tile per 16
    outputs and 32 inputs); None where the tile kernel does not take it (another dtype or device, n or k not a
    multiple of 32, no AMX)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % 32 or k % 32 or not n or not k or not matmul_tiles():
        return None
    weight = contiguous_rows(weight)
    packed = torch.empty(n // 16, k // 32, 16, 32, dtype=torch.bfloat16)
    compiled().pack_tiles(weight.data_ptr(), weight.stride(0), packed.data_ptr(), n, k)
    return packed


def linear_tiles(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] bfloat16 times the weight that pack_tiles packed, plus bias [n] float32 (or None): [..., n]
    bfloat16, each output's float32 sum rounded once."""
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    if x.dtype != torch.bfloat16 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"linear_tiles takes a bfloat16 CPU input [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"linear_tiles takes a contiguous float32 bias [{n}], got {bias.dtype} {tuple(bias.shape)}")
    x2 = contiguous_rows(x)
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    done = compiled().linear_tiles(
        x2.data_ptr(), x2.stride(0), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
        out.data_ptr(), x2.shape[0], n, k,
    )  # fmt: skip
    if not done:
        raise RuntimeError("the AMX tile kernel did not run (a library built without AMX, or out of memory)")
    return out
