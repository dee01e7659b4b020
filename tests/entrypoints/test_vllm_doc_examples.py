"""vLLM's documented usage, run with only the import (or the command name) changed: the quickstart's offline
batch and chat, the generative-models page (generate, beam_search, chat, load_chat_template), the offline examples'
command-line scripts (EngineArgs.add_cli_args on an argument group with FlexibleArgumentParser, `LLM(**vars(args))`,
`get_default_sampling_params()` edited in place), the LLMEngine and AsyncLLMEngine loops and embeddings (the server
launch lines: openai/test_serve_doc_launch_lines.py).

Each script below makes the documents' calls against vLLM (`from vllm import ...`, hub model names; fewer prompts
and shorter generations, for CPU test time); the test swaps `vllm` for `pagedllm` in the imports and the hub names
for the bundled models, and runs it. Nothing else changes."""

from __future__ import annotations

import pytest
from doc_scripts import run_script as _run

QUICKSTART_OFFLINE = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model="facebook/opt-125m")
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

messages_list = [[{"role": "user", "content": prompt}] for prompt in prompts]
outputs = llm.chat(messages_list, sampling_params)
for idx, output in enumerate(outputs):
    print(f"Prompt: {prompts[idx]!r}, Generated text: {output.outputs[0].text!r}")
"""

# the examples' scripts: engine flags on an argument group, defaults set on it, LLM(**vars(args))
CLI_GENERATE = """
import sys
from vllm import LLM, EngineArgs
from vllm.utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
engine_group = parser.add_argument_group("Engine arguments")
EngineArgs.add_cli_args(engine_group)
engine_group.set_defaults(model="meta-llama/Llama-3.2-1B-Instruct")
sampling_group = parser.add_argument_group("Sampling parameters")
sampling_group.add_argument("--max-tokens", type=int)
sampling_group.add_argument("--temperature", type=float)
args = vars(parser.parse_args(sys.argv[1:]))
max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
llm = LLM(**args)
sampling_params = llm.get_default_sampling_params()
if max_tokens is not None:
    sampling_params.max_tokens = max_tokens
if temperature is not None:
    sampling_params.temperature = temperature
for output in llm.generate(["Hello, my name is", "The capital of France is"], sampling_params):
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
outputs = llm.chat(conversation, sampling_params, use_tqdm=False,
                   chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}")
print(outputs[0].outputs[0].text)
"""

LLM_ENGINE_LOOP = """
import argparse, sys
from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams

parser = argparse.ArgumentParser()
parser = EngineArgs.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
engine_args = EngineArgs.from_cli_args(args)
engine = LLMEngine.from_engine_args(engine_args)
test_prompts = [
    ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
    ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=5)),
    ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
]
request_id = 0
while test_prompts or engine.has_unfinished_requests():
    if test_prompts:
        prompt, sampling_params = test_prompts.pop(0)
        engine.add_request(str(request_id), prompt, sampling_params)
        request_id += 1
    request_outputs: list[RequestOutput] = engine.step()
    for request_output in request_outputs:
        if request_output.finished:
            print(request_output)
"""

ASYNC_ENGINE = """
import asyncio
from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

async def main():
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="Qwen/Qwen2.5-1.5B-Instruct"))
    final = None
    async for output in engine.generate("The capital of France is", SamplingParams(max_tokens=4), "req-0"):
        final = output
    print(final.outputs[0].text, final.finished)

asyncio.run(main())
"""

EMBED = """
from vllm import LLM

prompts = ["Hello, my name is", "The capital of France is"]
llm = LLM(model="intfloat/e5-small", task="embed", enforce_eager=True)
outputs = llm.embed(prompts)
for prompt, output in zip(prompts, outputs):
    embeds = output.outputs.embedding
    print(f"Prompt: {prompt!r} | Embeddings: {embeds[:4]!r} (size={len(embeds)})")
"""
# the generative-models page: generate with and without SamplingParams, beam_search, chat, a loaded chat template
GENERATIVE_PAGE = """
from vllm import LLM, SamplingParams
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.sampling_params import BeamSearchParams

llm = LLM(model="facebook/opt-125m")
for params in (None, SamplingParams(temperature=0)):
    outputs = llm.generate("Hello, my name is") if params is None else llm.generate("Hello, my name is", params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
params = BeamSearchParams(beam_width=3, max_tokens=8)
outputs = llm.beam_search([{"prompt": "Hello, my name is "}], params)
for output in outputs:
    print(f"Generated text: {output.sequences[0].text!r}")
conversation = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"}]
outputs = llm.chat(conversation)
print(f"Chat: {outputs[0].outputs[0].text!r}")
custom_template = load_chat_template(chat_template=TEMPLATE_PATH)
outputs = llm.chat(conversation, chat_template=custom_template)
print(f"Prompt: {outputs[0].prompt!r}")
"""
GENERATIVE_HUB_NAMES = ("facebook/opt-125m", "meta-llama/Llama-3.2-1B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")


@pytest.fixture
def small_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")  # the environment, not the script, sizes the cache


def test_quickstart_offline(smollm2, small_cache):
    out = _run(QUICKSTART_OFFLINE, dict.fromkeys(GENERATIVE_HUB_NAMES, smollm2))
    assert out.count("Generated text: ") == 6 and "Prompt: 'The capital of France is'" in out


def test_example_scripts_with_engine_flags(smollm2, small_cache):
    argv = ["--max_tokens", "4", "--temperature", "0", "--max-model-len", "512", "--enforce-eager=true"]
    out = _run(CLI_GENERATE, dict.fromkeys(GENERATIVE_HUB_NAMES, smollm2), argv)
    assert out.count("Generated text: ") == 2
    out = _run(LLM_ENGINE_LOOP, {}, ["--model", smollm2, "--max-model-len", "256", "--max-num-seqs", "4"])
    assert out.count("RequestOutput(") == 3 and "finished=True" in out


def test_async_engine(smollm2, small_cache):
    out = _run(ASYNC_ENGINE, dict.fromkeys(GENERATIVE_HUB_NAMES, smollm2))
    assert out.strip().endswith("True")


def test_generative_models_page(smollm2, small_cache, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    script = GENERATIVE_PAGE.replace("TEMPLATE_PATH", repr(str(template)))  # the page's "<path_to_template>"
    out = _run(script, dict.fromkeys(GENERATIVE_HUB_NAMES, smollm2))
    assert out.count("Generated text: ") == 3 and "Chat: " in out
    assert "Prompt: '[system] You are a helpful assistant\\n[user] Hello\\n'" in out


def test_embed(minilm, small_cache):
    out = _run(EMBED, {"intfloat/e5-small": minilm})
    assert out.count("(size=384)") == 2
