"""Load a .gguf checkpoint: its transformers config, its weights under HF names, and its tokenizer."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

try:
    import gguf
except ModuleNotFoundError as e:  # a core dependency, but a hand-made environment may lack it
    raise ModuleNotFoundError(
        "reading a .gguf model (the default model is one) needs the gguf package: pip install 'gguf>=0.10'",
        name="gguf",
    ) from e
import numpy as np
import torch
import transformers

from pagedllm.layers.q4_linear import PackedQ4
from pagedllm.model_loader.gguf_dequant import PACKABLE_Q4, dequantize, unpack_q4, unpack_q8

logger = logging.getLogger(__name__)

# GGUF architecture name (also transformers' model_type) -> HF architecture. Mistral GGUFs use the "llama" name.
_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "starcoder2": "Starcoder2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_Q8_HEADS = frozenset({"token_embd.weight", "output.weight"})  # possible LM heads: Q8_0 ones keep their 8 bits
# Architectures whose converter interleaved the rotary halves of the Q/K rows.
_PERMUTED_QK = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GPT-2: HF keeps its linear weights as Conv1D [in, out]; the converter transposed them to [out, in].
_GPT2_GLOBAL_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2_LAYER_NAMES = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GEMMA2_LAYER_NAMES = {  # Gemma 2 and 3: norms after attention and around the MLP
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's norms scale by (1 + w): llama.cpp's converter stores w + 1
_NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
# arch -> (global names, per-layer names, HF prefix of layer i)
_NAMES = {
    "gpt2": (_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, "transformer.h.{}"),
    "starcoder2": (_GLOBAL_NAMES, {**_LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}, "model.layers.{}"),
    "gemma2": (_GLOBAL_NAMES, _GEMMA2_LAYER_NAMES, "model.layers.{}"),
    "gemma3": (_GLOBAL_NAMES, _GEMMA2_LAYER_NAMES, "model.layers.{}"),
    **{arch: (_GLOBAL_NAMES, _LAYER_NAMES, "model.layers.{}") for arch in ("llama", "qwen2", "qwen3")},
}
_TRANSPOSED = frozenset({("gpt2", part) for part in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")})
# Tensors with no HF parameter (llama3 rope frequency factors are not representable here).
_SKIPPED = frozenset({"rope_freqs.weight"})
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
_SHORT_ARRAY = 64  # longer header arrays are stepped over (_Reader)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _Reader(gguf.GGUFReader):
    """GGUFReader that parses the header through a plain ndarray view of its memmap, and steps over long arrays.

    Slicing a numpy.memmap is several times slower than slicing an ndarray. The header of a file with a large
    vocabulary has arrays of ~10^5 items (tokens, scores, token types, merges), which gguf turns into one or two numpy
    arrays per item (~0.7 s). pagedllm reads its tokenizer from the converted copy (transformers converts with its own
    reader), so an array of more than _SHORT_ARRAY items keeps only its item type and length (`_array_length`) and one
    uint8 part over its bytes: its `contents()` is empty. The returned arrays still view the read-only memory map.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if int(length[0]) <= _SHORT_ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item = gguf.GGUFValueType(int(item_type[0]))
        offs = start = orig_offs + 12
        if item == gguf.GGUFValueType.STRING:
            order = ">" if self.byte_order == "S" else "<"  # "S": the file's byte order is swapped against ours
            for _ in range(int(length[0])):  # each string: a uint64 byte count, then the bytes
                offs += 8 + struct.unpack_from(order + "Q", self._plain, offs)[0]
        elif item in self.gguf_scalar_to_np:
            offs += int(length[0]) * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        else:  # nested arrays: item by item
            return super()._get_field_parts(orig_offs, raw_type)
        parts = [item_type, length, self._get(start, np.uint8, offs - start)]
        return offs - orig_offs, parts, [], [gguf.GGUFValueType.ARRAY, item]

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dt, count = np.dtype(dtype), int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _file_key(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """(absolute path, size, mtime in ns): identifies one version of a file."""
    abspath = os.path.abspath(os.fspath(path))
    st = os.stat(abspath)
    return abspath, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _open_reader(key: tuple[str, int, int]) -> gguf.GGUFReader:
    try:
        return _Reader(key[0], "r")
    except (AttributeError, TypeError):  # a gguf version whose reader internals differ
        return gguf.GGUFReader(key[0], "r")


def _reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    return _open_reader(_file_key(path))


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
    return arch


def _rope_parameters(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """transformers-5 `rope_parameters` from the {arch}.rope.* metadata."""
    theta = _field(reader, f"{arch}.rope.freq_base", 10000.0)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return params
    if scaling not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")
    params["rope_type"] = scaling
    params["factor"] = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    optional = {
        "original_context_length": "original_max_position_embeddings",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
    }
    for gguf_key, hf_key in optional.items():
        value = _field(reader, f"{arch}.rope.scaling.{gguf_key}")
        if value is not None and scaling == "yarn":
            params[hf_key] = value
    return params


def _rope_and_dtype_kwargs(rope: dict[str, Any]) -> dict[str, Any]:
    """Config kwargs for the rope and dtype: `rope_parameters`/`dtype` in transformers 5, the older names before."""
    if _TRANSFORMERS_MAJOR >= 5:
        return {"rope_parameters": rope, "dtype": torch.float32}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = {**scaling, "type": scaling["rope_type"]} if scaling["rope_type"] != "default" else None
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling, "torch_dtype": torch.float32}


def _array_length(field: Any) -> int:
    """Items of an array field: its parts start with the key's length and bytes, the value type, the item type and
    the length (both readers)."""
    return int(field.parts[4][0])


def _tensor_names(reader: gguf.GGUFReader) -> set[str]:
    return {t.name for t in reader.tensors}


def _vocab_size(reader: gguf.GGUFReader, arch: str) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF order: (hidden, vocab)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return _array_length(tokens)
    return int(_field(reader, f"{arch}.vocab_size"))


def _token_ids(reader: gguf.GGUFReader) -> dict[str, int | None]:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {hf: _field(reader, f"tokenizer.ggml.{name}_token_id") for hf, name in keys.items()}


def _tensor_shape(reader: gguf.GGUFReader, name: str) -> tuple[int, ...] | None:
    """A tensor's shape in torch order (GGUF lists dims innermost first), None when the file lacks it."""
    for tensor in reader.tensors:
        if tensor.name == name:
            return tuple(int(s) for s in reversed(tensor.shape))
    return None


def gguf_config(path: str | os.PathLike[str]) -> transformers.PretrainedConfig:
    """The config of a .gguf file's model, built from its metadata: a plain `PretrainedConfig` with the model's
    fields and `model_type`. Importing transformers' own config classes (LlamaConfig, ...) pulls in torch._dynamo and
    costs ~2 s of every start; `transformers.AutoConfig.for_model` makes one from these fields when needed."""
    reader = _reader(path)
    arch = _architecture(reader)
    kwargs = _KWARGS.get(arch, _llama_kwargs)(reader, arch)
    if "rope_freqs.weight" in _tensor_names(reader):
        logger.warning("%s has rope_freqs (llama3-style rope scaling): it is ignored", path)
    return transformers.PretrainedConfig(model_type=_MODEL_TYPES.get(arch, arch), **kwargs)


def _common_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """Config fields every architecture has under the same GGUF keys."""
    kwargs: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "hidden_size": int(_field(reader, f"{arch}.embedding_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": int(_field(reader, f"{arch}.attention.head_count")),
        "vocab_size": _vocab_size(reader, arch),
        "tie_word_embeddings": "output.weight" not in _tensor_names(reader),
        **_token_ids(reader),
    }
    context = _field(reader, f"{arch}.context_length")
    if context is not None:
        kwargs["max_position_embeddings"] = int(context)
    return kwargs


def _llama_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    kwargs = _common_kwargs(reader, arch)
    hidden, heads = kwargs["hidden_size"], kwargs["num_attention_heads"]
    kwargs.update(
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        **_rope_and_dtype_kwargs(_rope_parameters(reader, arch)),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in _tensor_names(reader)
    return kwargs


def _gpt2_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """GPT-2 (gelu_new, LayerNorm, learned positions). The inner MLP width comes from ffn_up: llama.cpp's converter
    writes 4 * n_embd as feed_forward_length whatever the checkpoint's n_inner."""
    kwargs = _common_kwargs(reader, arch)
    up = _tensor_shape(reader, "blk.0.ffn_up.weight")  # (inner, hidden)
    inner = up[0] if up is not None else int(_field(reader, "gpt2.feed_forward_length"))
    dtype_key = "dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype"
    kwargs.update(
        n_inner=inner,
        layer_norm_epsilon=float(_field(reader, "gpt2.attention.layer_norm_epsilon")),
        activation_function="gelu_new",
        **{dtype_key: torch.float32},
    )
    return kwargs


def _starcoder2_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """StarCoder2 (LayerNorm, plain gelu MLP, biases where attn_q has one, an optional sliding window)."""
    kwargs = _common_kwargs(reader, arch)
    heads = kwargs["num_attention_heads"]
    kwargs.update(
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        norm_epsilon=float(_field(reader, f"{arch}.attention.layer_norm_epsilon")),
        use_bias="blk.0.attn_q.bias" in _tensor_names(reader),
        hidden_act="gelu_pytorch_tanh",
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
        **_rope_and_dtype_kwargs(_rope_parameters(reader, arch)),
    )
    return kwargs


def _gemma2_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """Gemma 2: soft-capping from the file; what llama.cpp fixes: even layers sliding, odd ones global; attention
    scaled by head_dim ** -0.5 (hidden / heads for the 46-layer 27B); rope base 10000 (not stored)."""
    kwargs = _llama_kwargs(reader, arch)
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    kwargs.update(
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        query_pre_attn_scalar=hidden // heads if layers == 46 else kwargs["head_dim"],
        attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh",
    )
    return kwargs


def _gemma3_kwargs(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """Gemma 3 text. What llama.cpp fixes rather than stores: every 6th layer global, the others sliding; local
    rotary base 10000 (unscaled); attention scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B)."""
    kwargs = _llama_kwargs(reader, arch)
    rope = kwargs.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    kwargs.pop("rope_scaling", None)
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    local = {"rope_type": "default", "rope_theta": 10000.0}
    if _TRANSFORMERS_MAJOR >= 5:
        kwargs["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling = {**scaling, "type": scaling["rope_type"]} if scaling["rope_type"] != "default" else None
        kwargs.update(rope_theta=rope["rope_theta"], rope_scaling=scaling, rope_local_base_freq=local["rope_theta"])
    kwargs.update(
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        query_pre_attn_scalar=hidden // heads if layers == 62 else kwargs["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return kwargs


_KWARGS = {
    "gpt2": _gpt2_kwargs,
    "starcoder2": _starcoder2_kwargs,
    "gemma2": _gemma2_kwargs,
    "gemma3": _gemma3_kwargs,
}
# model_type of the config, where transformers' differs from the GGUF architecture name
_MODEL_TYPES = {"gemma3": "gemma3_text"}


def _hf_name(name: str, arch: str) -> str:
    """GGUF tensor name -> HF parameter name."""
    global_names, layer_names, layer_prefix = _NAMES[arch]
    base, _, suffix = name.rpartition(".")
    if base in global_names and suffix in ("weight", "bias"):
        return f"{global_names[base]}.{suffix}"
    match = _LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} has no known HF counterpart")
    layer, part, suffix = match.groups()
    return f"{layer_prefix.format(layer)}.{layer_names[part]}.{suffix}"


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary interleave of Q/K rows (weights or biases): within each head the converter moved row
    ``j * (head_dim // 2) + i`` (half j, index i) to row ``2 * i + j``; this maps them back to HF's halves."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])  # (heads, head_dim/2, 2, ...) interleaved pairs
    return w.transpose(1, 2).reshape(weight.shape)  # (heads, 2, head_dim/2, ...) -> rows


def _qk_heads(reader: gguf.GGUFReader, arch: str, part: str) -> int:
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    if part == "attn_k":
        return int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    return heads


def gguf_weights(path: str | os.PathLike[str], keep_q4: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (HF parameter name, float32 tensor in HF layout) for every tensor of a .gguf file. With keep_q4,
    Q4_0/Q4_1 linear weights come as PackedQ4 (4-bit values, per-32 scale/zero), except where HF's layout is
    transposed (GPT-2's Conv1D), and a Q8_0 LM head / tied embedding carries its 8-bit form as `gguf_q8`."""
    reader = _reader(path)
    arch = _architecture(reader)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        name = _hf_name(tensor.name, arch)
        shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        transposed = (arch, part) in _TRANSPOSED and len(shape) == 2
        if keep_q4 and tensor.tensor_type in PACKABLE_Q4 and len(shape) == 2 and part and not transposed:
            weight = PackedQ4(*unpack_q4(tensor.data, tensor.tensor_type, shape))
        else:
            weight = dequantize(tensor.data, tensor.tensor_type, shape)
            if keep_q4 and tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0 and tensor.name in _Q8_HEADS:
                weight.gguf_q8 = unpack_q8(tensor.data, shape)
        if transposed:
            weight = weight.t()  # [out, in] -> HF's Conv1D [in, out]
        if arch in _NORM_PLUS_ONE and tensor.name.endswith("norm.weight"):
            weight = weight - 1
        if arch in _PERMUTED_QK and part in ("attn_q", "attn_k"):
            heads = _qk_heads(reader, arch, part)
            if isinstance(weight, PackedQ4):
                weight = weight.map_rows(lambda t, heads=heads: unpermute_qk(t, heads))
            else:
                weight = unpermute_qk(weight, heads)
        yield name, weight


def _default_cache_dir() -> str:
    from pagedllm import envs

    return envs.cache_root()  # VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/pagedllm


def _tokenizer_key(path: str | os.PathLike[str]) -> str:
    abspath, size, mtime_ns = _file_key(path)
    return hashlib.sha256(f"{abspath}\0{size}\0{mtime_ns}".encode()).hexdigest()


def _convert_tokenizer(path: str | os.PathLike[str]) -> transformers.PreTrainedTokenizerFast:
    """Have transformers convert the GGUF vocabulary (slow: seconds)."""
    abspath = os.path.abspath(os.fspath(path))
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(abspath), gguf_file=os.path.basename(abspath))
    template = _field(_reader(abspath), "tokenizer.chat_template")
    if template is not None and not tok.chat_template:
        tok.chat_template = template
    return tok


def _save_atomically(tok: transformers.PreTrainedTokenizerFast, target: str) -> None:
    """save_pretrained into a temp dir next to `target`, then rename it into place (first writer wins)."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp-", dir=parent)
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, "tokenizer.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cached(target: str) -> transformers.PreTrainedTokenizerFast | None:
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        return None
    try:
        return transformers.PreTrainedTokenizerFast.from_pretrained(target)
    except Exception as exc:  # a damaged cache entry: rebuild it
        logger.warning("ignoring unreadable tokenizer cache %s: %s", target, exc)
        shutil.rmtree(target, ignore_errors=True)
        return None


def gguf_tokenizer(path: str | os.PathLike[str], cache_dir: str | None = None) -> transformers.PreTrainedTokenizerFast:
    """The .gguf file's tokenizer (special tokens, bos/eos, chat template).

    The first call converts it with transformers and saves it under
    ``<cache_dir>/tokenizers/<sha256 of path, size, mtime>``; later calls load that copy.
    """
    root = cache_dir if cache_dir is not None else _default_cache_dir()
    target = os.path.join(root, "tokenizers", _tokenizer_key(path))
    tok = _load_cached(target)
    if tok is not None:
        return tok
    tok = _convert_tokenizer(path)
    try:
        _save_atomically(tok, target)
    except OSError as exc:  # a read-only cache must not prevent loading
        logger.warning("could not cache the tokenizer in %s: %s", target, exc)
    return tok


@functools.lru_cache(maxsize=8)
def _chat_template(key: tuple[str, int, int]) -> str | None:
    return _field(_open_reader(key), "tokenizer.chat_template")


def gguf_chat_template(path: str | os.PathLike[str]) -> str | None:
    """The chat template stored in a .gguf file (None when it has none)."""
    return _chat_template(_file_key(path))
