"""The benchmark datasets of `pagedllm bench` (vLLM's names and flags): `random` (random token ids of given lengths,
optionally behind a shared prefix) and `sharegpt` (a ShareGPT-format JSON file: the first human turn is the prompt,
the reply's length is the output length)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt")


@dataclass
class BenchRequest:
    prompt: str | list[int]  # token ids (random) or text (sharegpt)
    prompt_len: int
    output_len: int

    def engine_prompt(self) -> str | dict:
        return {"prompt_token_ids": self.prompt} if isinstance(self.prompt, list) else self.prompt


def add_dataset_args(
    parser: argparse.ArgumentParser, input_len: int, output_len: int, num_prompts: int, seed_flag: bool = True
) -> None:
    """The dataset flags; `seed_flag=False` where the engine's flags already hold --seed (it seeds both)."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--dataset-path", "--dataset", default=None, help="the ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=input_len)
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=output_len)
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in [len*(1-r), len*(1+r)]")
    parser.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int, default=0)
    parser.add_argument("--sharegpt-output-len", type=int, default=None, help="output length instead of the reply's")
    if seed_flag:
        parser.add_argument("--seed", type=int, default=0)


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len={args.prefix_len} must be at least 0")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio={args.random_range_ratio} must be in [0, 1)")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")


def sample_requests(args: argparse.Namespace, vocab_size: int, tokenizer=None) -> list[BenchRequest]:
    """args.num_prompts requests of the chosen dataset (seeded by args.seed)."""
    _check(args)
    seed = getattr(args, "seed", 0)  # the engine's --seed where the command has engine flags (absent: default 0)
    if args.dataset_name == "sharegpt":
        if tokenizer is None:
            raise ValueError("--dataset-name sharegpt needs a tokenizer (the model has none loaded)")
        return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, seed)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    return random_requests(
        vocab_size, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.prefix_len,
        seed, special,
    )  # fmt: skip


def random_requests(
    vocab_size: int,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    special_ids: set[int] | frozenset = frozenset(),
) -> list[BenchRequest]:
    """Prompts of prefix_len shared + ~input_len random ids (no special tokens), ~output_len tokens out each."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio)))

    prefix = [rng.choice(allowed) for _ in range(prefix_len)]
    requests = []
    for _ in range(num):
        ids = prefix + [rng.choice(allowed) for _ in range(length(input_len))]
        requests.append(BenchRequest(ids, len(ids), length(output_len)))
    return requests


def sharegpt_requests(path: str, tokenizer, num: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """vLLM's ShareGPT sampling: conversations with a reply, shuffled; prompts or replies under 4 tokens, prompts
    over 1024 or prompt + reply over 2048 tokens are skipped (unless --sharegpt-output-len fixes the reply's)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} objects")
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in data
        if isinstance(c, dict) and len(c.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len or len(tokenizer.encode(reply))
        if output_len is None and (prompt_len < 4 or out_len < 4 or prompt_len > 1024 or prompt_len + out_len > 2048):
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path}: no conversation fits (a prompt of 4 to 1024 tokens with a reply of 4 or more)")
    return requests
