"""EngineArgs is the one definition of the engine's options: add_cli_args makes a flag of every field (vLLM's
spelling, short forms -tp / -pp / -q), from_cli_args reads them back, `pagedllm serve` takes them all, and LLM(...)
takes every field as a keyword."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.openai.cli_args import add_serve_parser


def _parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_every_field_is_a_flag_and_defaults_stay():
    parser = _parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(EngineArgs):
        assert f"--{f.name.replace('_', '-')}" in flags, f.name
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


def test_flags_parse_to_fields():
    argv = ["-tp", "2", "-pp", "1", "-q", "fp8", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
            "--enforce-eager", "--hf-overrides", '{"num_hidden_layers": 1}', "--gpu-memory-utilization", "0.5",
            "--disable-log-requests", "--disable-log-stats", "--dtype", "float32", "--rope-theta", "1e4"]  # fmt: skip
    args = EngineArgs.from_cli_args(_parser().parse_args(argv))
    expected = EngineArgs(
        tensor_parallel_size=2, pipeline_parallel_size=1, quantization="fp8", max_num_batched_tokens=512,
        enable_prefix_caching=False, enforce_eager=True, hf_overrides={"num_hidden_layers": 1},
        gpu_memory_utilization=0.5, disable_log_requests=True, disable_log_stats=True, dtype="float32",
        rope_theta=1e4,
    )  # fmt: skip
    assert args == expected
    with pytest.raises(SystemExit):
        _parser().parse_args(["--hf-overrides", "{not json"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-num-seqs", "many"])


def test_serve_takes_the_engine_flags():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--disable-log-requests", "-tp", "1", "--api-key", "k", "--seed", "3"])
    assert EngineArgs.cli_kwargs(args) == {"disable_log_requests": True, "tensor_parallel_size": 1, "seed": 3}
    assert args.api_key == ["k"] and args.model == "m"


def test_llm_takes_every_field(tmp_path_factory):
    path = save_tiny_decoder("cli", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip
    llm = LLM(path, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, disable_log_stats=True,
              disable_log_requests=True)  # fmt: skip
    assert llm.engine_args.disable_log_stats and llm.engine_args.disable_log_requests
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['no_such_option'\]"):
        LLM(path, no_such_option=1)


def test_compat_options_no_ops_and_refusals(tmp_path_factory):
    from pagedllm.engine_compat import COMPAT_ARGS

    assert set(COMPAT_ARGS) <= set(EngineArgs.names())
    path = save_tiny_decoder("compat", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip
    base = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, dtype="float32")
    no_ops = dict(use_v2_block_manager=False, num_scheduler_steps=8, disable_custom_all_reduce=True,
                  max_seq_len_to_capture=32, swap_space=0, enable_chunked_prefill=True, preemption_mode="recompute",
                  disable_async_output_proc=True, tokenizer_pool_size=4, num_lookahead_slots=2,
                  disable_cascade_attn=True)  # fmt: skip
    llm = LLM(path, **base, **no_ops)
    reference = LLM(path, **base)
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = {"prompt_token_ids": [1, 2, 3, 4]}
    got = llm.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == reference.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids  # no effect
    for name, value in (("preemption_mode", "swap"), ("cpu_offload_gb", 4),
                        ("scheduling_policy", "priority"), ("tokenizer_mode", "mistral"),
                        ("enable_expert_parallel", True), ("kv_transfer_config", {"kv_role": "kv_both"}),
                        ("worker_cls", "my.Worker")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"{name}={value!r} is not supported: "):
            LLM(path, **base, **{name: value})
    args = EngineArgs.from_cli_args(_parser().parse_args(["--num-scheduler-steps", "8", "--use-v2-block-manager"]))
    assert args.num_scheduler_steps == 8 and args.use_v2_block_manager is True


# launch lines of vLLM's documents and deployment guides, with `vllm` replaced by `pagedllm` (the model a path)
LAUNCH_LINES = [
    "serve /models/llama --dtype auto --api-key token-abc123",
    "serve /models/llama --disable-log-requests --disable-log-stats --host 0.0.0.0 --port 8000",
    "serve /models/llama --gpu-memory-utilization 0.95 --max-model-len 4096 -tp 1 --max-num-seqs 128",
    "serve /models/llama --enable-prefix-caching --enable-chunked-prefill --max-num-batched-tokens 2048",
    "serve /models/llama --swap-space 16 --use-v2-block-manager --num-scheduler-steps 8 --disable-custom-all-reduce",
    "serve /models/llama --served-model-name llama --trust-remote-code --seed 0 --block-size 16 --enforce-eager",
    "serve /models/llama -q fp8 --kv-cache-dtype auto --tokenizer-mode auto --load-format auto",
    "serve /models/bge --task embed --max-model-len 512",
    "serve --model /models/llama --max-seq-len-to-capture 8192 --disable-async-output-proc --preemption-mode recompute",
    "run-batch -i in.jsonl -o out.jsonl --model /models/llama --disable-log-stats",
    "serve /models/llama --response-role bot --return-tokens-as-token-ids --enable-force-include-usage "
    "--enable-prompt-tokens-details --disable-uvicorn-access-log --disable-fastapi-docs --enable-log-requests "
    "--tokenizer-pool-size 0 --disable-cascade-attn --hf-token hf_x --ignore-patterns *.pt --download-dir /hf",
    "serve /models/r1 --enable-reasoning --reasoning-parser deepseek_r1 --disable-log-requests --swap-space 0 "
    "--gpu-memory-utilization 0.95 --disable-frontend-multiprocessing --seed 42",
    "serve --model=/models/llama --served-model-name=llama -tp 1 --max-num-seqs=8 --max-model-len=2048 "
    "--disable-frontend-multiprocessing --enable-prefix-caching=false --port=8080",
    "serve /models/llama --cuda-graph-sizes 1 2 4 8 --max-logprobs 20 --override-generation-config "
    '{"temperature":0.5} --default-chat-template-kwargs {"enable_thinking":false} --api-server-count 1',
]


def test_documented_launch_lines_parse_and_validate():
    from pagedllm.cli import build_parser
    from pagedllm.engine_compat import check_compat_args
    from pagedllm.entrypoints.cli_config import expand_config
    from pagedllm.entrypoints.openai.serve_compat import check_serve_compat

    for line in LAUNCH_LINES:
        args = build_parser().parse_args(expand_config(line.split()))
        engine = EngineArgs.from_cli_args(args)
        check_compat_args(vars(engine))  # no compatibility option at an unsupported value
        if args.command == "serve":
            check_serve_compat(args)
        assert (args.model or args.model_flag).startswith("/models/"), line


def test_override_generation_config(tmp_path_factory):
    path = save_tiny_decoder("gen", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip
    base = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, dtype="float32")
    llm = LLM(path, **base, override_generation_config={"temperature": 0.3, "max_new_tokens": 7})
    params = llm.get_default_sampling_params()
    assert params.temperature == 0.3 and params.max_tokens == 7
    with pytest.raises(ValueError, match=r"override_generation_config=\{'temp': 1\} must be a dict of the keys"):
        LLM(path, **base, override_generation_config={"temp": 1})
