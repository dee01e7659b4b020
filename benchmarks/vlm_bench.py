"""Vision-language throughput: LLaVA or Qwen2.5-VL with dummy weights, one image per request.

Workloads, each one JSON line on stdout (and appended to benchmarks/results.jsonl unless --no-append):
  vlm-distinct  --num-requests requests, each with its own random --image-size square image: output tok/s,
                requests/s and the mean time to first token
  vlm-repeat    the same requests all with one image: the same figures, and how many encoder runs the encoder
                cache saved (one run for the image, the rest hits)

--shapes llava-1.5-7b: CLIP ViT-L/14 at 336 pixels (576 image tokens) + Llama-2-7B, in bfloat16 on a GPU;
--shapes qwen2.5-vl-3b: Qwen2.5-VL-3B (dynamic resolution: a 1024x1024 image is 37x37 = 1369 tokens);
--shapes tiny / qwen2.5-vl-tiny: two-layer models for a CPU smoke run. The checkpoint folder (config, image
processor, a character-level tokenizer with the image token) is written to a temporary directory; weights are
random (load_format="dummy").

    python benchmarks/vlm_bench.py                                   # on a GPU
    python benchmarks/vlm_bench.py --shapes tiny --num-requests 4 --max-tokens 4 --image-size 64 --no-append
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

try:
    from benchmarks.common import emit, git_commit, machine_description, make_record, rounded
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from common import emit, git_commit, machine_description, make_record, rounded

SHAPES = {
    "llava-1.5-7b": dict(
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096),
    ),
    "tiny": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                    patch_size=14, projection_dim=32),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048),
    ),
}  # fmt: skip
QWEN_SHAPES = {
    "qwen2.5-vl-3b": dict(
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                  rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
    ),
    "qwen2.5-vl-tiny": dict(
        vision=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, window_size=112,
                    fullatt_block_indexes=[1]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048,
                  rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}),
    ),
}  # fmt: skip
IMAGE_TOKEN_ID = 97  # after the tokenizer's 96 characters and </s>
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def char_tokenizer(special: list[str]):
    import transformers as T
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)} | {"</s>": 96}, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def write_qwen_checkpoint(shapes: dict, folder: str) -> None:
    """config.json, the Qwen2-VL image processor (default min/max pixels) and a character tokenizer."""
    import transformers as T

    special = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    char_tokenizer(special).save_pretrained(folder)
    T.Qwen2VLImageProcessorPil().save_pretrained(folder)
    vision = dict(shapes["vision"], hidden_act="silu", tokens_per_second=2, patch_size=14, spatial_merge_size=2)
    config = T.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=dict(shapes["text"], tie_word_embeddings=True),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=IMAGE_TOKEN_ID + 1,
        vision_start_token_id=IMAGE_TOKEN_ID + 2,
        vision_end_token_id=IMAGE_TOKEN_ID + 3,
        tie_word_embeddings=True,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    config.save_pretrained(folder)


def write_checkpoint(shapes: dict, folder: str) -> None:
    """config.json, the processor (CLIPImageProcessor + a character tokenizer with <image>) and no weights."""
    import transformers as T

    tokenizer = char_tokenizer(["<image>"])
    side = shapes["vision"]["image_size"]
    images = T.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = T.LlavaProcessor(images, tokenizer, patch_size=shapes["vision"]["patch_size"],
                                 vision_feature_select_strategy="default", image_token="<image>",
                                 num_additional_image_tokens=1)  # fmt: skip
    processor.save_pretrained(folder)
    config = T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**shapes["vision"]),
        text_config=T.LlamaConfig(**shapes["text"]),
        image_token_index=IMAGE_TOKEN_ID,
        architectures=["LlavaForConditionalGeneration"],
    )
    config.save_pretrained(folder)


def random_image(seed: int, size: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8))


def run(llm, images: list, max_tokens: int, placeholder: str = "<image>") -> dict:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt": f"USER: {placeholder}\nDescribe picture {i}. ASSISTANT:", "multi_modal_data": {"image": img}}
               for i, img in enumerate(images)]  # fmt: skip
    mm = llm.llm_engine.core.executor.runner.mm
    runs_before = mm.num_encoder_runs
    stats = llm.llm_engine.output_processor.stats.time_to_first_token
    ttft_sum, ttft_count = stats.sum, sum(stats.counts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = (stats.sum - ttft_sum) / max(sum(stats.counts) - ttft_count, 1)
    runs = mm.num_encoder_runs - runs_before
    return dict(
        num_requests=len(images),
        prompt_tokens=len(outputs[0].prompt_token_ids),
        output_tok_s=rounded(generated / elapsed),
        requests_s=rounded(len(images) / elapsed, 3),
        mean_ttft_s=rounded(ttft, 4),
        encoder_runs=runs,
        encoder_cache_hits=len(images) - runs,
        seconds=rounded(elapsed, 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES) + sorted(QWEN_SHAPES), default="llava-1.5-7b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()

    from pagedllm import LLM

    with tempfile.TemporaryDirectory() as folder:
        qwen = args.shapes in QWEN_SHAPES
        if qwen:
            write_qwen_checkpoint(QWEN_SHAPES[args.shapes], folder)
        else:
            write_checkpoint(SHAPES[args.shapes], folder)
        llm = LLM(folder, load_format="dummy", dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False)
        placeholder = QWEN_IMAGE if qwen else "<image>"
        run(llm, [random_image(1000, args.image_size)], 2, placeholder)  # warm-up (the processor, kernels)
        machine, commit = machine_description(), git_commit()
        common = dict(shapes=args.shapes, image_size=args.image_size, max_tokens=args.max_tokens)
        distinct = [random_image(i, args.image_size) for i in range(args.num_requests)]
        figures = run(llm, distinct, args.max_tokens, placeholder)
        emit(make_record("vlm-distinct", machine, commit, **common, **figures), not args.no_append)
        same = [random_image(2000, args.image_size)] * args.num_requests  # not among the distinct ones
        figures = run(llm, same, args.max_tokens, placeholder)
        emit(make_record("vlm-repeat", machine, commit, **common, **figures), not args.no_append)


if __name__ == "__main__":
    main()
