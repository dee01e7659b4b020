"""Downloading a model repo: from the Hugging Face Hub (huggingface_hub's snapshot download into the HF cache, or
into `download_dir`), or from ModelScope when VLLM_USE_MODELSCOPE=1. Only the files the engine reads are fetched:
configs and tokenizer files, plus the weights in one format (safetensors, else .bin) or a single GGUF file."""

from __future__ import annotations

import fnmatch
import os

from pagedllm import envs

# configs, tokenizer files (tokenizer.json/.model, vocab/merges .txt, tiktoken) and chat templates
CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
IGNORE_PATTERNS = ["original/*", "*/original/*"]  # the checkpoint's other-framework copy (e.g. Meta's consolidated)


def _pick_gguf(repo_id: str, files: list[str], quant: str | None) -> str:
    """The one GGUF file of a GGUF-only repo; `quant` (from `repo:Q4_K_M`) picks among several by name."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if quant:
        ggufs = [f for f in ggufs if quant.lower() in os.path.basename(f).lower()]
    if len(ggufs) == 1:
        return ggufs[0]
    which = f" matching {quant!r}" if quant else ""
    raise ValueError(
        f"model {repo_id!r} holds {len(ggufs)} GGUF files{which} and no config.json: name one quantization as "
        f"'{repo_id}:<QUANT>' (e.g. {repo_id}:Q4_K_M); files: {ggufs[:20]}"
    )


def download_patterns(repo_id: str, files: list[str], quant: str | None, tokenizer_only: bool) -> list[str]:
    """The allow_patterns for a repo with `files`: configs, tokenizer and one weight format, or one GGUF file (the
    one `quant` names, or the only one of a repo without config.json)."""
    if quant or ("config.json" not in files and any(f.endswith(".gguf") for f in files)):
        return [_pick_gguf(repo_id, files, quant)]
    if tokenizer_only:
        return CONFIG_PATTERNS
    for weights in ("*.safetensors", "*.bin", "*.pt"):
        if any(fnmatch.fnmatch(f, weights) for f in files):
            return CONFIG_PATTERNS + [weights]
    raise ValueError(
        f"model {repo_id!r} on the Hub has no weights pagedllm reads (safetensors, .bin, .pt or GGUF); files: "
        f"{sorted(files)[:20]}"
    )


def _gguf_file(path: str, patterns: list[str]) -> str:
    """A GGUF download is the file itself, as a local .gguf path is."""
    if len(patterns) == 1 and patterns[0].endswith(".gguf"):
        return os.path.join(path, patterns[0])
    return path


def download_model(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    quant: str | None = None,
    tokenizer_only: bool = False,
    token: str | bool | None = None,
    ignore_patterns: str | list[str] | None = None,
) -> str:
    """The local path of `repo_id` after downloading what the engine needs; ValueError with the reason if not.
    token: the Hub token (unset: HF_TOKEN, else a saved login); ignore_patterns: files not to download."""
    if envs.use_modelscope():
        return _from_modelscope(repo_id, revision, download_dir, quant, tokenizer_only)
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    from pagedllm.model_loader.resolve import hf_cache_dir

    endpoint, token = envs.hf_endpoint(), token if token is not None else envs.hf_token()
    ignore = IGNORE_PATTERNS + ([ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or []))
    where = endpoint or "https://huggingface.co"
    try:
        files = HfApi(endpoint=endpoint, token=token).list_repo_files(repo_id, revision=revision)
        patterns = download_patterns(repo_id, files, quant, tokenizer_only)
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir or hf_cache_dir(),  # where resolve_model looks (HF_HUB_CACHE read now)
            allow_patterns=patterns,
            ignore_patterns=ignore,
            endpoint=endpoint,
            token=token,
        )
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r} on the Hub ({where})") from None
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hub ({where}): accept its terms, set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model {repo_id!r} was not found: not a local path, not in the local Hugging Face cache, and not on "
            f"the Hub ({where}; a private repo needs HF_TOKEN)"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(f"model {repo_id!r}: the Hub ({where}) answered an error: {e}") from None
    except (OSError, ConnectionError) as e:  # unreachable host, disk full
        raise ValueError(f"model {repo_id!r} could not be downloaded from {where}: {e}") from None
    except Exception as e:  # httpx's connect/timeout errors: the Hub is not reachable
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2"):
            raise
        raise ValueError(
            f"model {repo_id!r} was not found locally and the Hub ({where}) is not reachable ({e}); place the model "
            f"files locally and pass their path, or set HF_HUB_OFFLINE=1 to use only the local cache"
        ) from None
    return _gguf_file(path, patterns)


def _from_modelscope(repo_id, revision, download_dir, quant, tokenizer_only) -> str:
    try:
        from modelscope.hub.api import HubApi
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError:
        raise ValueError(
            "VLLM_USE_MODELSCOPE=1 downloads models from ModelScope, which needs the `modelscope` package: "
            "pip install modelscope"
        ) from None
    try:
        listing = HubApi().get_model_files(repo_id, revision=revision or "master", recursive=True)
        files = [f["Path"] for f in listing if f.get("Type", "blob") == "blob"]  # files, not folders
        patterns = download_patterns(repo_id, files, quant, tokenizer_only)
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except ValueError:
        raise
    except Exception as e:  # modelscope raises its own HTTP and not-found errors
        raise ValueError(f"model {repo_id!r} could not be downloaded from ModelScope: {e}") from None
    return _gguf_file(path, patterns)
