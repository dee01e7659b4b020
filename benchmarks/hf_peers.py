"""HF transformers as the GPU peer of benchmarks/gpu_throughput.py: a randomly initialized bf16 model built from the
same config.json (dummy weights, as pagedllm's), static left-padded batches through `generate`, and plain SDPA
forwards for prefill."""

from __future__ import annotations

import time

import torch


def load_model(config_dir: str):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # ignore_eos: nothing stops a sequence early
    model.generation_config.pad_token_id = 0
    return model


def _left_padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.zeros((len(batch), width), dtype=torch.long)  # [batch, width]
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.cuda(), mask.cuda()


@torch.inference_mode()
def generate_tok_s(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int, temperature: float):
    """Static batching: each batch generates its longest max_tokens; only each sequence's own max_tokens count
    as output (what a user asked for). Returns (useful output tok/s, seconds, useful tokens)."""
    useful, seconds = 0, 0.0
    for start in range(0, len(prompts), batch_size):
        chunk, lens = prompts[start : start + batch_size], max_tokens[start : start + batch_size]
        ids, mask = _left_padded(chunk)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(lens),
        )
        torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        useful += sum(lens)
    return useful / seconds, seconds, useful


@torch.inference_mode()
def prefill_tok_s(model, prompts: list[list[int]], batch_size: int) -> tuple[float, float]:
    """Forwards over the prompts in batches (last position's logits only). Returns (tok/s, seconds)."""
    batches = [torch.tensor(prompts[i : i + batch_size], device="cuda") for i in range(0, len(prompts), batch_size)]
    model(batches[0][:1, :128], logits_to_keep=1)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids in batches:
        model(ids, logits_to_keep=1, use_cache=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return sum(map(len, prompts)) / seconds, seconds
