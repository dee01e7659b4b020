"""GPT-2, StarCoder2, Gemma 2 and Gemma 3 GGUF files, written the way llama.cpp's converter writes them (tensor
names, GPT-2's transposed Conv1D weights, Gemma's norms stored as 1 + w, metadata, a byte-level BPE tokenizer),
loaded by `LLM(model="x.gguf")` alone and run against HF transformers."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedllm import LLM, SamplingParams
from pagedllm.layers.q4_linear import PackedQ4
from pagedllm.model_loader import gguf_loader
from pagedllm.model_loader.gguf_loader import gguf_config, gguf_weights

T = gguf.GGMLQuantizationType
EOT = "<|endoftext|>"
VOCAB = 320
CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # HF [in, out]; GGUF [out, in]
GLOBAL = {  # HF module -> GGUF name, both families
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
LAYER = {  # HF module inside a block -> GGUF name
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Hello, world! Paged attention keeps the cache in blocks; a block holds sixteen tokens.",
    "GGUF files carry the tokenizer: tokens, merges and token types.",
]
TEXTS = ["Hello, world!", "The lazy fox returns a + b", "  spaces\tand\nnewlines <|endoftext|> here", "Ünïcödé 🤖"]


def train_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of exactly VOCAB tokens (GPT-2's pre-tokenizer and byte alphabet), EOT as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() == VOCAB
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT)


GEMMA2_LAYER = {  # Gemma 2 and 3
    **LAYER,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensor_name(hf_name: str, model_type: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in GLOBAL:
        return f"{GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)  # transformer.h.N.<rest> / model.layers.N.<rest>
    names = GEMMA2_LAYER if model_type in ("gemma2", "gemma3_text") else LAYER
    return f"blk.{layer}.{names[rest]}.{suffix}"


def encode(w: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, the float32 values it holds). 1-D tensors stay F32, as the converter keeps them."""
    if w.ndim == 1 or qtype == T.F32:
        return w, w
    if qtype == T.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)  # (rows, bytes per row) uint8
    return data, gguf.quants.dequantize(data, qtype)


def write_tokenizer(writer: gguf.GGUFWriter, tok: transformers.PreTrainedTokenizerFast) -> None:
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == EOT else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_add_bos_token(False)


def write_metadata(writer: gguf.GGUFWriter, config) -> None:
    """The hyperparameters llama.cpp's converter writes for the family."""
    if config.model_type == "gpt2":
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)  # the converter's value, whatever n_inner is
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if config.model_type == "starcoder2":
        writer.add_layer_norm_eps(config.norm_epsilon)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        return
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)  # Gemma: no layer pattern; no rope base for Gemma 2
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma3_text":
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(config.sliding_window)


def write_gguf(path: str, hf: transformers.PreTrainedModel, tok, qtype: T) -> dict[str, torch.Tensor]:
    """Write `hf` as llama.cpp's converter does; return the HF-layout float32 tensors the file holds."""
    config = hf.config
    writer = gguf.GGUFWriter(path, "gemma3" if config.model_type == "gemma3_text" else config.model_type)
    write_metadata(writer, config)
    write_tokenizer(writer, tok)
    stored = {}
    for hf_name, param in hf.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = param.detach().numpy().astype(np.float32)
        conv1d = config.model_type == "gpt2" and hf_name.endswith(CONV1D)
        if conv1d:
            w = np.ascontiguousarray(w.T)
        gemma_norm = config.model_type.startswith("gemma") and hf_name.endswith("norm.weight")
        if gemma_norm:
            w = w + np.float32(1)
        data, values = encode(w, qtype)
        values = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(w.shape)
        if gemma_norm:  # the reference holds the values the loader recovers
            values = values - 1
        stored[hf_name] = values.t() if conv1d else values
        raw_dtype = None if data.dtype == np.float32 else (T.F16 if data.dtype == np.float16 else qtype)
        writer.add_tensor(gguf_tensor_name(hf_name, config.model_type), np.ascontiguousarray(data), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


CASES = {  # name -> (family, file type, tied embedding)
    "gpt2-f32-tied": ("gpt2", T.F32, True),
    "gpt2-f16-untied": ("gpt2", T.F16, False),
    "gpt2-q8_0-tied": ("gpt2", T.Q8_0, True),
    "starcoder2-f32-untied": ("starcoder2", T.F32, False),
    "starcoder2-q8_0-tied": ("starcoder2", T.Q8_0, True),
    "gemma2-f16-untied": ("gemma2", T.F16, False),
    "gemma2-f32-tied": ("gemma2", T.F32, True),
    "gemma3-f32-tied": ("gemma3", T.F32, True),
    "gemma3-q8_0-tied": ("gemma3", T.Q8_0, True),
}


def hf_model(family: str, tied: bool, eos: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_inner=96, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, tie_word_embeddings=tied
        )
        model_cls = transformers.GPT2LMHeadModel
    elif family == "gemma2":
        config = transformers.Gemma2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=tied,
            query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
        )  # fmt: skip
        model_cls = transformers.Gemma2ForCausalLM
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=16, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=8,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], tie_word_embeddings=tied,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            },
        )  # fmt: skip
        model_cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.Starcoder2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=128, sliding_window=8, use_bias=True, tie_word_embeddings=tied,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        )  # fmt: skip
        model_cls = transformers.Starcoder2ForCausalLM
    config.bos_token_id = config.eos_token_id = eos
    hf = model_cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_model(request, tmp_path_factory):
    """(case, HF reference model holding the file's values, HF tokenizer, path, stored tensors, LLM on the .gguf)."""
    family, qtype, tied = CASES[request.param]
    tok = train_tokenizer()
    hf = hf_model(family, tied, tok.eos_token_id)
    path = str(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf")
    stored = write_gguf(path, hf, tok, qtype)
    if qtype == T.F32 and not family.startswith("gemma"):  # the file holds the checkpoint itself
        assert all(torch.equal(stored[n], p) for n, p in hf.state_dict().items() if n in stored)
    # the reference holds the values the file holds (f16-rounded, Q8_0-dequantized, (1 + w) - 1)
    hf.load_state_dict(stored, strict=False)
    with pytest.MonkeyPatch.context() as mp:  # the converted tokenizer is cached under the test's folder
        mp.setattr(gguf_loader, "_default_cache_dir", lambda: str(tmp_path_factory.mktemp("cache")))
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes=1 << 22, block_size=4, max_num_batched_tokens=16)
    return request.param, hf, tok, path, stored, llm


def test_weights_and_config(gguf_model) -> None:
    name, hf, _, path, stored, _ = gguf_model
    weights = dict(gguf_weights(path))
    assert sorted(weights) == sorted(stored)
    for key, value in stored.items():
        assert weights[key].shape == value.shape and torch.equal(weights[key], value), key
    config, ref = gguf_config(path), hf.config
    assert config.architectures == [type(hf).__name__]
    assert (config.hidden_size, config.num_attention_heads) == (64, 4)
    assert config.num_hidden_layers == ref.num_hidden_layers
    assert (config.vocab_size, config.max_position_embeddings) == (VOCAB, 128)
    assert config.tie_word_embeddings is ref.tie_word_embeddings
    if ref.model_type == "gpt2":
        assert config.n_inner == 96
        assert config.layer_norm_epsilon == pytest.approx(ref.layer_norm_epsilon)
    elif ref.model_type == "starcoder2":
        assert (config.intermediate_size, config.num_key_value_heads, config.sliding_window) == (96, 2, 8)
        assert config.norm_epsilon == pytest.approx(ref.norm_epsilon) and config.use_bias is True
        assert config.rope_parameters["rope_theta"] == 5000.0
    else:
        assert (config.head_dim, config.query_pre_attn_scalar, config.sliding_window) == (16, 16, 8)
        assert config.layer_types == ref.layer_types
        if ref.model_type == "gemma2":
            assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (1.5, 2.0)
        else:
            assert config.rope_parameters == ref.rope_parameters


def test_tokenizer_from_gguf_matches_original(gguf_model) -> None:
    _, _, tok, _, _, llm = gguf_model
    ours = llm.get_tokenizer()
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == tok.decode(ids) == text
    assert ours.eos_token_id == tok.eos_token_id == 0
    assert ours(EOT)["input_ids"] == [0]


def test_greedy_and_logprobs_match_hf(gguf_model) -> None:
    """Text prompts through the GGUF's own tokenizer; greedy tokens identical to HF's, logprobs within 1e-4."""
    name, hf, tok, _, _, llm = gguf_model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        prompt = tok(text)["input_ids"]
        assert out.prompt_token_ids == prompt
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        ref_tokens = ref.sequences[0, len(prompt) :].tolist()
        ref_logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.logits, ref_tokens)]
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{name}: {text!r}"
        ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4, rtol=0, err_msg=f"{name}: {text!r}")


@pytest.mark.parametrize("family", ["gpt2", "starcoder2"])
def test_keep_q4_packs_only_untransposed_linears(tmp_path, family: str) -> None:
    """GPT-2's linear weights are transposed to HF's Conv1D layout, so they come dense even with keep_q4;
    StarCoder2's come packed, holding the same values."""
    hf = hf_model(family, True, 0)
    path = str(tmp_path / f"{family}-q4_0.gguf")
    stored = write_gguf(path, hf, train_tokenizer(), T.Q4_0)
    packed = dict(gguf_weights(path, keep_q4=True))
    kinds = {name: isinstance(w, PackedQ4) for name, w in packed.items() if ".mlp.c_fc." in name and "weight" in name}
    assert kinds and all(kinds.values()) is (family == "starcoder2")
    for name, value in packed.items():
        dense = value.dequantize() if isinstance(value, PackedQ4) else value
        torch.testing.assert_close(dense, stored[name], rtol=0, atol=1e-6, msg=name)
