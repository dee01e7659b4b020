"""Every engine keyword and `vllm serve` flag of vLLM's documents is accepted: it works, is a documented no-op, or
(another value than the supported one) is a ValueError naming why. The names are vLLM's EngineArgs fields and
server flags, of the seed-era manual and of the current one."""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import fields

import pytest

from pagedllm.cli import build_parser, main
from pagedllm.engine_args import EngineArgs
from pagedllm.engine_compat import COMPAT_ARGS, CompatArgs, check_compat_args
from pagedllm.entrypoints.cli_config import bool_values
from pagedllm.entrypoints.openai.serve_compat import SERVE_COMPAT, check_serve_compat

SEED_ENGINE_ARGS = """
model served_model_name tokenizer task skip_tokenizer_init tokenizer_mode intial_incremental_detokenization_offset
trust_remote_code allowed_local_media_path download_dir load_format config_format dtype kv_cache_dtype seed
max_model_len distributed_executor_backend pipeline_parallel_size tensor_parallel_size max_parallel_loading_workers
block_size enable_prefix_caching disable_sliding_window use_v2_block_manager swap_space cpu_offload_gb
gpu_memory_utilization max_num_batched_tokens max_num_seqs max_logprobs disable_log_stats revision code_revision
rope_scaling rope_theta hf_overrides tokenizer_revision quantization enforce_eager max_seq_len_to_capture
disable_custom_all_reduce tokenizer_pool_size tokenizer_pool_type tokenizer_pool_extra_config limit_mm_per_prompt
mm_processor_kwargs disable_mm_preprocessor_cache enable_lora enable_lora_bias max_loras max_lora_rank
enable_prompt_adapter max_prompt_adapters max_prompt_adapter_token fully_sharded_loras lora_extra_vocab_size
long_lora_scaling_factors lora_dtype max_cpu_loras device num_scheduler_steps multi_step_stream_outputs
ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config ignore_patterns
preemption_mode scheduler_delay_factor enable_chunked_prefill guided_decoding_backend logits_processor_pattern
speculative_model speculative_model_quantization speculative_draft_tensor_parallel_size num_speculative_tokens
speculative_disable_mqa_scorer speculative_max_model_len speculative_disable_by_batch_size ngram_prompt_lookup_max
ngram_prompt_lookup_min spec_decoding_acceptance_method typical_acceptance_sampler_posterior_threshold
typical_acceptance_sampler_posterior_alpha qlora_adapter_name_or_path disable_logprobs_during_spec_decoding
otlp_traces_endpoint collect_detailed_traces disable_async_output_proc scheduling_policy override_neuron_config
override_pooler_config compilation_config worker_cls kv_transfer_config generation_config override_generation_config
enable_sleep_mode model_impl calculate_kv_scales disable_log_requests quantization_param_path worker_use_ray
engine_use_ray
""".split()
CURRENT_ENGINE_ARGS = """
hf_config_path runner convert enable_prompt_embeds allowed_media_domains safetensors_load_strategy cuda_graph_sizes
cudagraph_capture_sizes max_cudagraph_capture_size decode_context_parallel_size data_parallel_size data_parallel_rank
data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port data_parallel_hybrid_lb
data_parallel_backend enable_expert_parallel all2all_backend enable_dbo dbo_decode_token_threshold
dbo_prefill_token_threshold disable_nccl_for_dp_synchronization eplb_config enable_eplb expert_placement_strategy
num_redundant_experts eplb_window_size eplb_step_interval eplb_log_balancedness prefix_caching_hash_algo
disable_cascade_attn kv_cache_memory_bytes max_num_partial_prefills max_long_partial_prefills
long_prefill_token_threshold logprobs_mode aggregate_engine_logging hf_token enable_mm_embeds interleave_mm_strings
media_io_kwargs mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_tp_mode
mm_encoder_attn_backend io_processor_plugin skip_mm_profiling video_pruning_rate default_mm_loras
disable_chunked_mm_input disable_hybrid_kv_cache_manager structured_outputs_config reasoning_parser
guided_decoding_disable_fallback guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties
speculative_config show_hidden_metrics_for_version scheduler_cls pooler_config worker_extension_cls kv_events_config
override_attention_dtype mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size additional_config use_tqdm_on_load
pt_load_map_location enable_multimodal_encoder_data_parallel logits_processors async_scheduling
kv_sharing_fast_prefill
""".split()
# `vllm serve` flags that are not engine fields (the OpenAI frontend's), seed-era and current
SERVE_FLAGS = """
host port uvicorn-log-level allow-credentials allowed-origins allowed-methods allowed-headers api-key lora-modules
prompt-adapters chat-template chat-template-content-format response-role ssl-keyfile ssl-certfile ssl-ca-certs
ssl-cert-reqs root-path middleware return-tokens-as-token-ids disable-frontend-multiprocessing
enable-request-id-headers enable-auto-tool-choice tool-call-parser tool-parser-plugin disable-log-requests max-log-len
disable-fastapi-docs enable-prompt-tokens-details enable-reasoning reasoning-parser trust-request-chat-template
default-chat-template-kwargs exclude-tools-when-tool-choice-none tool-server log-config-file
enable-server-load-tracking enable-force-include-usage enable-tokenizer-info-endpoint enable-log-outputs
enable-log-deltas log-error-stack tokens-only uds disable-uvicorn-access-log disable-access-log-for-endpoints
enable-ssl-refresh ssl-ciphers h11-max-incomplete-event-size h11-max-header-count enable-offline-docs headless
api-server-count enable-log-requests served-model-name max-logprobs model
""".split()


def _serve_options() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings}


def test_every_documented_keyword_and_flag_is_accepted():
    names = set(EngineArgs.names())
    assert [n for n in SEED_ENGINE_ARGS + CURRENT_ENGINE_ARGS if n not in names] == []
    options = _serve_options()
    engine_flags = ["--" + n.replace("_", "-") for n in SEED_ENGINE_ARGS + CURRENT_ENGINE_ARGS]
    assert [f for f in engine_flags + ["--" + f for f in SERVE_FLAGS] if f not in options] == []


def _other_values(annotation: str, default) -> list:
    """Values of the field's type other than its default (both booleans where the default is None)."""
    first = next(p.strip() for p in annotation.split("|") if p.strip() != "None")
    if first == "bool":
        return [v for v in (True, False) if v is not default]
    if first in ("int", "float"):
        return [(default or 0) + 3]
    if first.startswith("dict"):
        return [{"key": 1}]
    if first.startswith("list"):
        return [["x"]]
    return ["something-else"]


@pytest.mark.parametrize("field", [f for f in fields(CompatArgs)], ids=lambda f: f.name)
def test_compat_keyword_is_a_no_op_or_a_clear_error(field):
    kind, _, why = COMPAT_ARGS[field.name]
    check_compat_args({field.name: field.default})  # the default is always accepted
    refused = []
    for value in _other_values(typing.cast(str, field.type), field.default):
        try:
            check_compat_args({field.name: value})
        except ValueError as e:
            assert str(e) == f"{field.name}={value!r} is not supported: {why}"
            refused.append(value)
    assert (refused == []) == (kind == "no-op"), refused


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "m", *argv])


def test_serve_compat_flags():
    check_serve_compat(_serve_args("--disable-frontend-multiprocessing", "--enable-reasoning", "--no-enable-log-deltas",
                                   "--api-server-count", "1", "--enable-offline-docs"))  # fmt: skip
    for argv in (["--headless"], ["--api-server-count", "2"], ["--middleware", "my.mw"], ["--tool-server", "demo"],
                 ["--enable-log-outputs"], ["--tokens-only"], ["--h11-max-header-count", "10"]):  # fmt: skip
        name = argv[0].removeprefix("--").replace("-", "_")
        with pytest.raises(ValueError, match=rf"^{argv[0]}=.* is not supported: {re.escape(SERVE_COMPAT[name][2])}"):
            check_serve_compat(_serve_args(*argv))
    args = _serve_args("--default-chat-template-kwargs", '{"enable_thinking": false}', "--uds", "/tmp/s.sock",
                       "--ssl-ciphers", "ECDHE", "--h11-max-incomplete-event-size", "1024")  # fmt: skip
    assert args.default_chat_template_kwargs == {"enable_thinking": False} and args.uds == "/tmp/s.sock"
    with pytest.raises(SystemExit):
        _serve_args("--default-chat-template-kwargs", "[1]")


def test_older_boolean_form_and_a_refused_value(capsys):
    """`--enable-chunked-prefill=false` (vLLM's older form) parses; a refused value names the reason."""
    argv = bool_values(["--enable-prefix-caching=false", "--enable-chunked-prefill=false"])
    args = EngineArgs.from_cli_args(_serve_args(*argv))
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    assert main(["serve", "/nonexistent", "--enable-prefix-caching=false", "--enable-sleep-mode=true"]) == 2
    assert "enable_sleep_mode=True is not supported: no sleep mode" in capsys.readouterr().err


def test_cuda_graph_sizes_reach_the_compilation_config():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--cuda-graph-sizes", "1", "2", "8"]))
    assert args.cuda_graph_sizes == [1, 2, 8]
    assert args._compilation_config().cudagraph_capture_sizes == [1, 2, 8]
    capped = EngineArgs(cudagraph_capture_sizes=[4, 1, 32], max_cudagraph_capture_size=8)
    assert capped._compilation_config().cudagraph_capture_sizes == [1, 4]
    assert EngineArgs(max_num_seqs=64, max_cudagraph_capture_size=16)._compilation_config().cudagraph_capture_sizes \
        == [1, 2, 4, 8, 16]  # fmt: skip
    with pytest.raises(ValueError, match="differ: give one"):
        EngineArgs(cudagraph_capture_sizes=[1], cuda_graph_sizes=[2])._compilation_config()
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=0 must be a positive integer"):
        EngineArgs(max_cudagraph_capture_size=0)._compilation_config()


def test_vllm_attention_backend_names():
    import torch

    from pagedllm.engine_compat import attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [attention_backend(n, cuda) for n in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "auto")] == [
        "triton", "triton", "triton", "auto"]  # fmt: skip
    assert attention_backend("TORCH_SDPA", cpu) == "torch" and attention_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='FLASH_ATTN' is a GPU backend .* use 'auto' or 'torch'"):
        attention_backend("FLASH_ATTN", cpu)


def test_vllm_attention_backend_variable(monkeypatch):
    import torch

    from pagedllm.engine_compat import attention_backend

    cpu = torch.device("cpu")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    assert attention_backend("auto", cpu) == "torch"
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    assert attention_backend("torch", cpu) == "torch"  # the keyword wins over the variable
    with pytest.raises(ValueError, match=r"^VLLM_ATTENTION_BACKEND='FLASH_ATTN' is a GPU backend"):
        attention_backend("auto", cpu)
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"^PAGEDLLM_ATTENTION_BACKEND='bogus' is not an attention backend"):
        attention_backend("auto", cpu)


def test_server_variables():
    from pagedllm import envs

    assert envs.http_timeout_keep_alive({}) == 5.0
    assert envs.http_timeout_keep_alive({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}) == 30.0
    with pytest.raises(ValueError, match=r"VLLM_HTTP_TIMEOUT_KEEP_ALIVE='-1' is out of range"):
        envs.http_timeout_keep_alive({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "-1"})
    assert envs.allow_runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not envs.allow_runtime_lora_updating({})
    with pytest.raises(ValueError, match=r"VLLM_ALLOW_RUNTIME_LORA_UPDATING='maybe' is not a boolean"):
        envs.allow_runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "maybe"})


def test_ignored_vllm_variables_are_accepted(monkeypatch, tmp_path_factory):
    """vLLM's documented variables that pagedllm has no use for change nothing (set all at once, a model runs)."""
    import transformers
    from tiny_models import TINY_DECODER, save_tiny_decoder

    from pagedllm import LLM, SamplingParams, envs

    assert not set(envs.IGNORED_ENV_VARS) & set(envs.ENV_VARS)
    path = save_tiny_decoder("ignored-env", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                             tmp_path_factory)[1]  # fmt: skip
    kwargs = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, dtype="float32")
    params, ids = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), {"prompt_token_ids": [1, 2, 3]}
    before = LLM(path, **kwargs).generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
    for name in envs.IGNORED_ENV_VARS:
        monkeypatch.setenv(name, "1")
    assert LLM(path, **kwargs).generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids == before


def test_human_readable_sizes():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--max-model-len", "32K", "--max-num-batched-tokens", "25.6k", "--kv-cache-memory-bytes", "1G"]
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (32768, 25600, 1 << 30)
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "4096"])).max_model_len == 4096
    for bad in ("1.5K", "lots", "12x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", bad])


def test_underscored_flag_names(capsys):
    from pagedllm.entrypoints.cli_config import expand_config

    argv = expand_config(["serve", "m", "--max_model_len", "64", "--enable_prefix_caching=false", "--served_model_name",
                          "x", "--chat-template", "a_b.jinja"])  # fmt: skip
    args = build_parser().parse_args(argv)
    assert (args.max_model_len, args.enable_prefix_caching, args.served_model_name) == (64, False, ["x"])
    assert args.chat_template == "a_b.jinja"  # values keep their underscores
