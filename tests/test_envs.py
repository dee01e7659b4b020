"""pagedllm/envs.py: vLLM's environment variables and their PAGEDLLM_ spellings, read in that module only; the CPU
KV cache sized from VLLM_CPU_KVCACHE_SPACE, threads bound by VLLM_CPU_OMP_THREADS_BIND, the log set up from
VLLM_LOGGING_LEVEL / VLLM_CONFIGURE_LOGGING, kernels cached under VLLM_CACHE_ROOT."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, envs

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_every_variable_has_both_spellings_and_pagedllm_wins():
    for name in envs.ENV_VARS:
        short = "PAGEDLLM_" + name.removeprefix("VLLM_")
        assert envs.get(name, {name: "a"}) == (name, "a")
        assert envs.get(name, {short: "b"}) == (short, "b")
        assert envs.get(name, {name: "a", short: "b"}) == (short, "b")
        assert envs.get(name, {name: "  "}) is None
    assert envs.api_key({"VLLM_API_KEY": "k"}) == "k"
    assert envs.hf_hub_offline({"HF_HUB_OFFLINE": "1"}) and not envs.hf_hub_offline({})
    assert envs.hf_hub_offline({"PAGEDLLM_HF_HUB_OFFLINE": "true"})


def test_values_and_bad_values():
    assert envs.cpu_kvcache_space_bytes({}) is None
    assert envs.cpu_kvcache_space_bytes({"VLLM_CPU_KVCACHE_SPACE": "4"}) == 4 << 30
    assert envs.cpu_kvcache_space_bytes({"PAGEDLLM_CPU_KVCACHE_SPACE": "0.5"}) == 1 << 29
    assert envs.cpu_omp_threads_bind({"VLLM_CPU_OMP_THREADS_BIND": "0-3,8,2"}) == [0, 1, 2, 3, 8]
    assert envs.cpu_omp_threads_bind({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) is None
    assert envs.logging_level({"VLLM_LOGGING_LEVEL": "debug"}) == "DEBUG"
    assert envs.logging_level({}) == "INFO" and envs.configure_logging({})
    assert envs.allow_long_max_model_len({"PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}) == (
        "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"
    )
    assert envs.allow_long_max_model_len({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}) is None
    assert envs.cache_root({"VLLM_CACHE_ROOT": "/c"}) == "/c"
    assert envs.cache_root({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "pagedllm")
    assert envs.torch_profiler_dir({"VLLM_TORCH_PROFILER_DIR": "/t"}) == "/t"
    for fn, name, value in (
        (envs.cpu_kvcache_space_bytes, "VLLM_CPU_KVCACHE_SPACE", "-1"),
        (envs.cpu_kvcache_space_bytes, "VLLM_CPU_KVCACHE_SPACE", "lots"),
        (envs.cpu_kvcache_space_bytes, "PAGEDLLM_CPU_KVCACHE_SPACE", "0"),
        (envs.cpu_omp_threads_bind, "VLLM_CPU_OMP_THREADS_BIND", "3-1"),
        (envs.cpu_omp_threads_bind, "VLLM_CPU_OMP_THREADS_BIND", "a,b"),
        (envs.logging_level, "VLLM_LOGGING_LEVEL", "LOUD"),
        (envs.configure_logging, "VLLM_CONFIGURE_LOGGING", "maybe"),
        (envs.allow_long_max_model_len, "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "2"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
            fn({name: value})


def test_variables_are_read_in_envs_only():
    """No other module reads one of these variables from the environment itself."""
    names = "|".join(re.escape(n.removeprefix("VLLM_")) for n in envs.ENV_VARS)
    reads = re.compile(rf"(environ|getenv)\W+[\"'](VLLM_|PAGEDLLM_)?({names})[\"']")
    found = [
        str(path.relative_to(REPO))
        for path in (REPO / "pagedllm").rglob("*.py")
        if path.name != "envs.py" and reads.search(path.read_text())
    ]
    assert found == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_decoder("envs", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip


def test_cpu_kv_cache_sized_from_the_variable(tiny, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    llm = LLM(tiny, device="cpu", dtype="float32", max_model_len=32, skip_tokenizer_init=True)
    per_block = llm.llm_engine.core.executor.kv_bytes_per_block()
    assert llm.llm_engine.config.cache.num_blocks == int(0.001 * (1 << 30)) // per_block
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.002")  # the PAGEDLLM_ spelling wins
    llm = LLM(tiny, device="cpu", dtype="float32", max_model_len=32, skip_tokenizer_init=True)
    assert llm.llm_engine.config.cache.num_blocks == int(0.002 * (1 << 30)) // per_block
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "none")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE='none'"):
        LLM(tiny, device="cpu", dtype="float32", max_model_len=32, skip_tokenizer_init=True)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    for name in envs.ENV_VARS:  # only the variables the test sets
        if name not in env:
            full.pop(name, None)
            full.pop("PAGEDLLM_" + name.removeprefix("VLLM_"), None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or 0 not in os.sched_getaffinity(0), reason="no core 0")
def test_threads_bound_to_the_listed_cores(tiny):
    code = (
        "import os, torch; from pagedllm import LLM\n"
        f"LLM({tiny!r}, device='cpu', dtype='float32', max_model_len=32, skip_tokenizer_init=True)\n"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    )
    proc = _python(code, VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[0] 1"
    proc = _python(code.replace("print", "0 and print"), VLLM_CPU_OMP_THREADS_BIND="100000")
    assert proc.returncode == 1 and "VLLM_CPU_OMP_THREADS_BIND: cores [100000] are not available" in proc.stderr


def test_logging_follows_the_variables():
    code = "import logging, pagedllm; log = logging.getLogger('pagedllm.t'); log.debug('dbg'); log.info('inf')"
    default = _python(code)
    assert default.returncode == 0 and re.search(r"^INFO \d\d-\d\d [\d:]{8} \[<string>:1\] inf$", default.stderr, re.M)
    assert "dbg" not in default.stderr
    debug = _python(code, VLLM_LOGGING_LEVEL="DEBUG")
    assert "DEBUG" in debug.stderr and "[<string>:1] dbg" in debug.stderr
    quiet = _python(code, PAGEDLLM_LOGGING_LEVEL="WARNING", VLLM_LOGGING_LEVEL="DEBUG")
    assert quiet.stderr == ""
    left = _python(code + "; print(logging.getLogger('pagedllm').handlers)", VLLM_CONFIGURE_LOGGING="0")
    assert left.stdout.strip() == "[]" and "inf" not in left.stderr


def test_logging_config_file(tmp_path):
    log_file = tmp_path / "out.log"
    config = {
        "version": 1,
        "formatters": {"f": {"format": "custom|%(name)s|%(message)s"}},
        "handlers": {"h": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "f"}},
        "loggers": {"pagedllm": {"handlers": ["h"], "level": "INFO", "propagate": False}},
    }
    (tmp_path / "log.json").write_text(json.dumps(config))
    code = "import logging, pagedllm; logging.getLogger('pagedllm.t').info('hello')"
    proc = _python(code, VLLM_LOGGING_CONFIG_PATH=str(tmp_path / "log.json"))
    assert proc.returncode == 0 and log_file.read_text() == "custom|pagedllm.t|hello\n" and "hello" not in proc.stderr
    bad = _python(code, VLLM_LOGGING_CONFIG_PATH=str(tmp_path / "missing.json"))
    assert bad.returncode == 1 and "VLLM_LOGGING_CONFIG_PATH=" in bad.stderr and "not a readable JSON" in bad.stderr


def test_kernel_cache_under_cache_root(monkeypatch, tmp_path):
    from pagedllm.kernels import cpu_kernels

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert cpu_kernels._cache_dir() == tmp_path / "kernels"
    from pagedllm.model_loader import gguf_loader

    assert gguf_loader._default_cache_dir() == str(tmp_path)


def test_offline_variable_named_in_the_missing_model_error(monkeypatch, tmp_path):
    from pagedllm.model_loader.resolve import resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("PAGEDLLM_HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="'org/missing' was not found.*HF_HUB_OFFLINE is set, so nothing is downl"):
        resolve_model("org/missing")
