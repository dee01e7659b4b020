"""Vision-language models under tensor and pipeline parallelism: LLaVA, Qwen2-VL and Qwen2.5-VL split over two CPU
processes (gloo, float32, async scheduling; TP=2 or PP=2) give the greedy tokens and logprobs of one process, and HF's
tokens, with images (and a Qwen video) batched with text-only requests, chunked prefill cutting through an image, and
a repeated image (encoder cache and prefix cache). The vision towers shard by heads; ones whose sizes do not split
are replicated; with pipeline stages the first stage holds the tower. Gemma 3 (bidirectional image attention) runs
PP=2 here, TP=2 in tests/multimodal/test_gemma3.py."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_llava
import tiny_qwen2_vl
import torch
from tiny_gemma3 import hf_generate as gemma3_generate
from tiny_gemma3 import image as gemma3_image
from tiny_gemma3 import save_tiny_gemma3
from tiny_qwen2_vl import IMAGE, VIDEO

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.layers.build_context import BuildContext
from pagedllm.model_loader.loader import get_model

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
# a budget of 8 tokens cuts prompts through their images; the prefix cache serves the repeated prompt
ENGINE = dict(dtype="float32", device="cpu", max_model_len=160, kv_cache_memory_bytes=1 << 22, block_size=4)
ENGINE.update(max_num_batched_tokens=8, enable_prefix_caching=True, limit_mm_per_prompt={"image": 2, "video": 1})

LLAVA_PROMPTS = [
    ("Say: <image> what?", [tiny_llava.image(0)]),
    ("No picture here.", []),
    ("Two <image> and <image>!", [tiny_llava.image(2), tiny_llava.image(3, (60, 30))]),
]
QWEN_PROMPTS = [
    (f"Say: {IMAGE} what?", [tiny_qwen2_vl.image(0, (84, 112))]),
    ("No picture here.", []),
    (f"Two {IMAGE} and {IMAGE}!", [tiny_qwen2_vl.image(2), tiny_qwen2_vl.image(3, (60, 130))]),
]


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "q25"])
def vlm(request, tmp_path_factory):
    """(name, HF model, its processor, checkpoint folder, prompts)."""
    if request.param == "llava":
        return ("llava", *tiny_llava.save_tiny_llava(tmp_path_factory, "llava-tp"), LLAVA_PROMPTS)
    hf, processor, path = tiny_qwen2_vl.save_tiny_qwen2_vl(tmp_path_factory, request.param)
    return (request.param, hf, processor, path, QWEN_PROMPTS)


def _prompt(text: str, images: list, video=None) -> dict:
    data = {k: v for k, v in (("image", images), ("video", video)) if v is not None and len(v)}
    return {"prompt": text, "multi_modal_data": data} if data else {"prompt": text}


def _run(path: str, tp: int, prompts: list[dict], pp: int = 1, **engine):
    """(each output's (tokens, logprobs), the repeated prompt's cached tokens, the driver's encoder runs)."""
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**ENGINE, **engine})
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        outs += llm.generate(prompts[:1], PARAMS, use_tqdm=False)  # the same image again
        rows = []
        for out in outs:
            c = out.outputs[0]
            rows.append((list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]))
        return rows, outs[-1].num_cached_tokens, llm.llm_engine.core.executor.runner.mm.num_encoder_runs
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda t: f"tp{t[0]}-pp{t[1]}")
def test_two_ranks_match_one_and_hf(vlm, layout):
    """PP=2: the first stage holds the vision tower and embeds the tokens, the second takes hidden states (and, for
    Qwen's M-RoPE, each step's 3D positions, from the items it keeps too)."""
    name, hf, processor, path, cases = vlm
    prompts = [_prompt(text, images) for text, images in cases]
    num_items = sum(len(images) for _, images in cases)
    if name != "llava":  # a video too (HF's side takes videos as patches: compared with one rank only)
        prompts.append(_prompt(f"Clip {VIDEO} then {IMAGE}.", [tiny_qwen2_vl.image(1)], tiny_qwen2_vl.video(5)))
        num_items += 2
    if (name, "one") not in ONE_RANK:
        ONE_RANK[name, "one"] = _run(path, 1, prompts)
    tp, pp = layout
    two = _run(path, tp, prompts, pp, async_scheduling=True)  # (one step in flight)
    gen = tiny_llava.hf_generate if name == "llava" else tiny_qwen2_vl.hf_generate
    expected = [gen(hf, processor, text, images, PARAMS.max_tokens) for text, images in cases]
    _check(expected, ONE_RANK[name, "one"], two, num_items)


def _check(expected: list, one: tuple, two: tuple, num_items: int) -> None:
    """Two ranks' run gives HF's tokens (`expected`, one per case), and one rank's tokens and logprobs; the repeated
    prompt (the last) hits the prefix cache and the encoder cache as on one rank."""
    (one, cached_one, runs_one), (two, cached_two, runs_two) = one, two
    assert [tokens for tokens, _ in two[: len(expected)]] == expected
    for (tokens_1, lps_1), (tokens_2, lps_2) in zip(one, two, strict=True):
        assert tokens_2 == tokens_1
        np.testing.assert_allclose(lps_2, lps_1, atol=1e-4, rtol=0)
    assert two[-1][0] == two[0][0]
    assert cached_two == cached_one > 0
    assert runs_two == runs_one == num_items  # the repeated image came from the encoder cache


GEMMA3_PROMPTS = [
    ("Say: <start_of_image> what?", [gemma3_image(0)]),
    ("No picture here.", []),
    ("Two <start_of_image> and <start_of_image>!", [gemma3_image(2), gemma3_image(3, (60, 30))]),
]


def test_gemma3_two_stages_match_one_and_hf(tmp_path_factory):
    """Gemma 3 with PP=2 (4 layers, sliding-window and global in turn: two a stage): the first stage holds the vision
    tower and embeds the tokens; the second, without it, computes each step's image spans from the items it keeps,
    so that an image's tokens attend both ways in its layers too (its first layer's mask shows in the tokens)."""
    hf, processor, path = save_tiny_gemma3(tmp_path_factory, "gemma3-vl-4", num_layers=4)
    prompts = [_prompt(text, images) for text, images in GEMMA3_PROMPTS]
    engine = dict(limit_mm_per_prompt={"image": 2})
    one = _run(path, 1, prompts, **engine)
    two = _run(path, 1, prompts, 2, async_scheduling=True, **engine)
    expected = [gemma3_generate(hf, processor, t, i, PARAMS.max_tokens) for t, i in GEMMA3_PROMPTS]
    _check(expected, one, two, num_items=3)


ONE_RANK: dict = {}  # (model, "one") -> its one-process run (both layouts compare with it)


def _checkpoint_tensor(path: str, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")[name]


def _rank_model(path: str, tp_rank: int):
    config = EngineArgs(model=path, device="cpu", dtype="float32", skip_tokenizer_init=True).create_engine_config()
    return get_model(config.model, torch.device("cpu"), BuildContext(tp_rank=tp_rank, tp_size=2))


def test_qwen2_vl_rank_takes_its_heads_of_the_fused_qkv(tmp_path_factory):
    """Rank 1 of two holds heads 2-3 of each of q, k and v of the checkpoint's fused qkv, and the second half of
    fc2's columns (the bias of a row-parallel layer stays on rank 0)."""
    _, _, path = tiny_qwen2_vl.save_tiny_qwen2_vl(tmp_path_factory, "qwen2_vl")
    block = _rank_model(path, 1).visual.blocks[0]
    qkv = _checkpoint_tensor(path, "visual.blocks.0.attn.qkv.weight")  # [3 * 32, 32]: q, k, v of 4 heads
    mine = torch.cat([part[16:] for part in qkv.chunk(3)])  # heads 2-3 of 8 dims each
    attn, mlp = block.attn, block.mlp
    assert attn.num_heads == 2
    torch.testing.assert_close(attn.qkv(torch.eye(32)).T - attn.qkv.bias[:, None], mine, rtol=0, atol=1e-6)
    fc2 = _checkpoint_tensor(path, "visual.blocks.0.mlp.fc2.weight")  # [32, 64]
    rank_part = mlp.fc2.quant_method.apply(mlp.fc2, torch.eye(32))  # (before the all-reduce; no bias on rank 1)
    torch.testing.assert_close(rank_part.T, fc2[:, 32:], rtol=0, atol=1e-6)


def test_llava_tower_that_does_not_split_is_replicated(tmp_path_factory):
    """CLIP with 3 heads does not split over two ranks: every rank holds the whole tower (and gets HF's hidden
    states); the projector and the LM still shard."""
    import transformers as T

    config = tiny_llava.llava_config()
    config.vision_config.num_attention_heads = 3
    config.vision_config.hidden_size = config.vision_config.intermediate_size = 48
    torch.manual_seed(0)
    hf = T.LlavaForConditionalGeneration(config).eval()
    path = str(tmp_path_factory.mktemp("llava-3heads"))
    hf.save_pretrained(path)
    model = _rank_model(path, 1)
    attn = model.vision_tower.encoder.layers[0].self_attn
    assert attn.qkv_proj.output_size_per_partition == 3 * 48 and attn.out_proj.tp_size == 1
    assert model.multi_modal_projector.linear_1.output_size_per_partition == config.text_config.hidden_size // 2
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        ref = hf.model.vision_tower(pixels, output_hidden_states=True).hidden_states[2]
        ours = model.vision_tower(pixels, [2])[0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_items_reach_the_ranks_as_plain_data():
    """The step message pickles an item's tensors as numpy arrays of its own elements (a torch view would carry the
    whole batch it was cut from); they come back as tensors, bfloat16 ones too."""
    import pickle

    from pagedllm.multimodal.inputs import MultiModalFeature

    batch = torch.randn(4, 3, 64, 64)  # [images, C, H, W]: 192 KiB
    items = [
        MultiModalFeature("image", f"h{i}", 8 * i, 4, {"pixel_values": batch[i : i + 1], "ids": torch.tensor([i])})
        for i in range(4)
    ]
    items[3].data["pixel_values"] = batch[3:].bfloat16()
    message = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(message) < 4 * 3 * 64 * 64 * 4 + 4096  # each image once, not the whole batch per item
    for ours, sent in zip(items, pickle.loads(message), strict=True):
        assert (sent.modality, sent.identifier, sent.offset, sent.length) == (
            ours.modality,
            ours.identifier,
            ours.offset,
            ours.length,
        )
        for key, value in ours.data.items():
            assert isinstance(sent.data[key], torch.Tensor) and torch.equal(sent.data[key], value)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_two_gpus_profile_and_match_one(name, tmp_path_factory):
    """On two GPUs (NCCL) with the memory profile (each rank runs the encoder's profile, its all-reduces included),
    CUDA graphs for decode steps: the tokens of one GPU, logprobs within 1e-3."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if name == "llava":
        _, _, path = tiny_llava.save_tiny_llava(tmp_path_factory, "llava-gpu")
        cases = LLAVA_PROMPTS
    else:
        _, _, path = tiny_qwen2_vl.save_tiny_qwen2_vl(tmp_path_factory, name)
        cases = QWEN_PROMPTS
    prompts = [_prompt(text, images) for text, images in cases]
    gpu = dict(device="cuda", kv_cache_memory_bytes=None, gpu_memory_utilization=0.3)
    one, _, _ = _run(path, 1, prompts, **gpu)
    two, cached, _ = _run(path, 2, prompts, **gpu)
    assert cached > 0
    for (tokens_1, lps_1), (tokens_2, lps_2) in zip(one, two, strict=True):
        assert tokens_2 == tokens_1
        np.testing.assert_allclose(lps_2, lps_1, atol=1e-3, rtol=0)


def test_lora_leaves_the_vision_tower_alone(tmp_path_factory):
    """The towers' parallel linears are not LoRA layers (adapters apply to the language model, as before the towers
    were built from them)."""
    from pagedllm.lora.model import LoRAModel

    _, _, path = tiny_qwen2_vl.save_tiny_qwen2_vl(tmp_path_factory, "q25")
    lora = LoRAModel(_rank_model(path, 0), max_loras=1, rank=4, dtype=torch.float32, device=torch.device("cpu"))
    assert lora.layers and all(name.startswith("language_model.") for name in lora.layers)
