"""Tiny Qwen2-VL and Qwen2.5-VL against HF transformers in float32: greedy tokens with one and two images of other
sizes (dynamic resolution), batched with text-only requests, with chunked prefill cutting through an image, with
prefix caching keyed by the image, and with videos; M-RoPE positions against HF's get_rope_index."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from tiny_qwen2_vl import IMAGE, IMAGE_TOKEN_ID, VIDEO, hf_generate, image, mp4_data_url, video

from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.mrope import mrope_positions

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [
    (f"Say: {IMAGE} what?", [image(0, (84, 112))]),
    (f"Two {IMAGE} and {IMAGE}!", [image(2), image(3, (60, 130))]),
    ("No picture here.", []),
]


def make_llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", max_model_len=160, kv_cache_memory_bytes=1 << 22, block_size=4)
    return LLM(path, **{**options, **kwargs})


def as_prompt(text: str, images: list, videos: list | None = None) -> dict:
    data = {k: v for k, v in (("image", images), ("video", videos)) if v is not None and len(v)}
    return {"prompt": text, "multi_modal_data": data} if data else {"prompt": text}


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_vl):
    return make_llm(tiny_qwen2_vl[2], limit_mm_per_prompt={"image": 2, "video": 1})


@pytest.fixture(scope="module")
def expected(tiny_qwen2_vl):
    hf, processor, _ = tiny_qwen2_vl
    return [hf_generate(hf, processor, text, images, GREEDY.max_tokens) for text, images in PROMPTS]


def test_greedy_tokens_match_hf_batched_with_text(qwen, tiny_qwen2_vl, expected):
    outputs = qwen.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    processor = tiny_qwen2_vl[1]
    for out, (text, images) in zip(outputs, PROMPTS):  # placeholders expanded as transformers' processor does
        assert out.prompt_token_ids == processor(text=[text], images=images or None)["input_ids"][0]
    assert expected[0] != expected[2]  # the image decides the tokens
    # dynamic resolution: 84x112 pixels -> a 3x4 grid of merged patches
    assert outputs[0].prompt_token_ids.count(IMAGE_TOKEN_ID) == 12


@pytest.mark.parametrize("budget", [5, 7])
def test_chunked_prefill_through_an_image(tiny_qwen2_vl, expected, budget):
    llm = make_llm(tiny_qwen2_vl[2], max_num_batched_tokens=budget, max_num_seqs=2, enable_prefix_caching=False)
    outputs = llm.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert llm.llm_engine.core.executor.runner.mm.num_encoder_runs == 3  # each image once, cut into chunks


def test_prefix_cache_hits_only_with_the_same_image(qwen, tiny_qwen2_vl):
    hf, processor, _ = tiny_qwen2_vl
    qwen.reset_prefix_cache()
    text = f"A long shared prefix of text before {IMAGE}!"
    first = qwen.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    same = qwen.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    other = qwen.generate(as_prompt(text, [image(8)]), GREEDY, use_tqdm=False)[0]
    num_before = first.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert first.num_cached_tokens == 0 and same.num_cached_tokens > num_before
    assert other.num_cached_tokens == num_before // 4 * 4  # only the whole blocks before the image
    assert tokens([same]) == tokens([first]) == [hf_generate(hf, processor, text, [image(7)], GREEDY.max_tokens)]
    assert tokens([other]) == [hf_generate(hf, processor, text, [image(8)], GREEDY.max_tokens)]


def test_video_matches_hf(qwen, tiny_qwen2_vl):
    """3 frames (padded to 4: two temporal patches), with an image; frames as an array and as PIL images."""
    from PIL import Image

    hf, processor, _ = tiny_qwen2_vl
    text = f"Clip {VIDEO} then {IMAGE}."
    frames = video(5)
    engine = qwen.llm_engine.multimodal_processor()
    ids, features = engine.process(text, {"video": frames, "image": image(1)})
    video_feature = next(f for f in features if f.modality == "video")
    assert video_feature.grid == (2, 2, 1) and video_feature.data["video_grid_thw"].tolist() == [[2, 4, 2]]
    want = hf_generate(
        hf,
        processor,
        text,
        [image(1)],
        GREEDY.max_tokens,
        (video_feature.data["pixel_values_videos"], video_feature.data["video_grid_thw"]),
    )
    as_array = qwen.generate(as_prompt(text, [image(1)], frames), GREEDY, use_tqdm=False)
    as_pil = qwen.generate(as_prompt(text, [image(1)], [[Image.fromarray(f) for f in frames]]), GREEDY, use_tqdm=False)
    assert tokens(as_array) == tokens(as_pil) == [want]
    assert as_array[0].prompt_token_ids == ids


def test_video_patches_match_the_image_processor(qwen, tiny_qwen2_vl):
    """Two equal frames make the patches transformers' image processor makes of one frame (it repeats an image
    over the temporal patch): the patch layout is transformers'."""
    _, processor, _ = tiny_qwen2_vl
    frame = video(6, 1)[0]
    engine = qwen.llm_engine.multimodal_processor()
    _, features = engine.process(VIDEO, {"video": np.stack([frame, frame])})
    ref = processor.image_processor(images=[frame], return_tensors="pt")
    assert torch.equal(features[0].data["video_grid_thw"], ref["image_grid_thw"])
    torch.testing.assert_close(features[0].data["pixel_values_videos"], ref["pixel_values"], rtol=0, atol=1e-6)


def test_mrope_positions_match_hf(qwen, tiny_qwen2_vl):
    hf, _, _ = tiny_qwen2_vl
    text = f"a{IMAGE}bc{VIDEO}{IMAGE}d"
    engine = qwen.llm_engine.multimodal_processor()
    ids, features = engine.process(text, {"image": [image(0, (84, 112)), image(1)], "video": video(2, 4)})
    ids_t = torch.tensor([ids])
    kinds = torch.where(ids_t == IMAGE_TOKEN_ID, 1, torch.where(ids_t == IMAGE_TOKEN_ID + 1, 2, 0))
    kwargs = {}
    video_feature = next(f for f in features if f.modality == "video")
    if video_feature.time_interval != 1.0:  # Qwen2.5-VL: seconds per temporal patch at 2 fps
        kwargs["second_per_grid_ts"] = torch.tensor([1.0])
    want, delta = hf.model.get_rope_index(
        ids_t,
        kinds,
        torch.cat([f.data["image_grid_thw"] for f in features if f.modality == "image"]),
        video_feature.data["video_grid_thw"],
        **kwargs,
    )
    got = mrope_positions(np.arange(len(ids) + 3), features)
    np.testing.assert_array_equal(got[:, : len(ids)], want[:, 0].numpy())
    # generated tokens continue from the prompt's last position, shifted alike on every axis
    np.testing.assert_array_equal(got[:, len(ids) :], np.arange(len(ids), len(ids) + 3) + int(delta) + np.zeros((3, 1)))


@pytest.mark.parametrize(
    "data, match",
    [
        ({"video": [video(0), video(1)]}, r"2 items, more than limit_mm_per_prompt\['video'\]=1"),
        ({"video": "frames"}, r"multi_modal_data\['video'\]\[0\] has type str"),
        ({"image": image(0)}, r"0 image placeholders"),
        ({"video": video(0).astype(np.float32)}, r"\['video'\]\[0\] has type ndarray; expected frames"),
        ({"video": video(0, 0)}, r"\['video'\]\[0\] has type ndarray"),
        ({"video": video(0, 2, (28, 28 * 201))}, r"aspect ratio must be smaller than 200"),
    ],
)
def test_bad_video_prompts(qwen, data, match):
    with pytest.raises(ValueError, match=match):
        qwen.generate({"prompt": f"{VIDEO}", "multi_modal_data": data}, GREEDY, use_tqdm=False)
    assert not qwen.llm_engine.has_unfinished_requests()


def test_limits_of_zero_run_text_only(tiny_qwen2_vl, expected):
    llm = make_llm(tiny_qwen2_vl[2], limit_mm_per_prompt={"image": 0, "video": 0})
    model = llm.llm_engine.core.executor.runner.model
    assert model.visual is None and not any("visual" in n for n, _ in model.named_parameters())
    assert tokens(llm.generate(PROMPTS[2][0], GREEDY, use_tqdm=False)) == [expected[2]]


@pytest.mark.parametrize("content_format", ["openai", "string"])
def test_chat_image_url_matches_hf(qwen, tiny_qwen2_vl, content_format):
    from test_llava_inputs import data_url, image_message

    hf, processor, _ = tiny_qwen2_vl
    img = image(11, (56, 84))
    out = qwen.chat(image_message(data_url(img)), GREEDY, use_tqdm=False, chat_template_content_format=content_format)
    rendered = f"user: Look:{IMAGE}\nassistant:" if content_format == "openai" else f"user: Look:\n{IMAGE}\nassistant:"
    assert out[0].prompt == rendered
    assert tokens(out) == [hf_generate(hf, processor, rendered, [img], GREEDY.max_tokens)]


def test_mm_processor_kwargs_set_the_resolution(qwen, tiny_qwen2_vl):
    _, processor, _ = tiny_qwen2_vl
    img = image(4, (84, 112))
    size = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 2}
    want = int(processor.image_processor(images=[img], size=size)["image_grid_thw"][0].prod()) // 4
    prompt = {"prompt": IMAGE, "multi_modal_data": {"image": img}, "mm_processor_kwargs": {"max_pixels": 28 * 28 * 2}}
    out = qwen.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == want < 12  # 12 tokens at the checkpoint max_pixels
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['max_pixels'\]=0 must be an integer >= 1"):
        qwen.generate({**prompt, "mm_processor_kwargs": {"max_pixels": 0}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"unknown keys \['sizes'\]"):
        qwen.generate({**prompt, "mm_processor_kwargs": {"sizes": 1}}, GREEDY, use_tqdm=False)


def test_chat_video_url_matches_the_decoded_frames(qwen, tiny_qwen2_vl):
    """A video_url part (an MP4 data URL) gives the tokens of its decoded frames given as multi_modal_data."""
    pytest.importorskip("av")
    from pagedllm.multimodal.media import decode_video

    url = mp4_data_url(video(9, 4))
    frames = decode_video(base64.b64decode(url.split(",", 1)[1]), "video")
    assert frames.shape == (4, 56, 28, 3)
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Clip:"}, {"type": "video_url", "video_url": {"url": url}}],
        }
    ]
    out = qwen.chat(messages, GREEDY, use_tqdm=False, chat_template_content_format="string")
    assert out[0].prompt == f"user: Clip:\n{VIDEO}\nassistant:"
    want = qwen.generate(as_prompt(out[0].prompt, [], frames), GREEDY, use_tqdm=False)
    assert tokens(out) == tokens(want)
    assert out[0].prompt_token_ids == want[0].prompt_token_ids
    with pytest.raises(ValueError, match=r"the video cannot be decoded"):
        qwen.chat(
            [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
            GREEDY,
            use_tqdm=False,
        )


def test_step_positions_are_1d_where_every_axis_agrees(qwen):
    """Decode steps after an image take one shifted position per token (what CUDA graphs replay); a step with image
    tokens takes [3, n]; a step of requests without items takes the plain positions (None)."""
    runner = qwen.llm_engine.core.executor.runner.mm
    _, features = qwen.llm_engine.multimodal_processor().process(f"ab{IMAGE}c", {"image": image(0, (84, 112))})
    (f,) = features  # 3x4 grid at offset 3: 12 tokens, text after it shifted by max(3, 4) - 12 = -8
    runner.features = {"a": features}
    try:
        qsl = np.array([0, 1, 2])
        decode = runner.step_positions(["a", "b"], qsl, np.array([f.end + 5, 40]))
        np.testing.assert_array_equal(decode, [f.end + 5 - 8, 40])
        prefill = runner.step_positions(["a"], np.array([0, 2]), np.array([f.offset, f.offset + 5]))
        np.testing.assert_array_equal(prefill, [[3, 3], [3, 4], [3, 4]])
        assert runner.step_positions(["b"], np.array([0, 1]), np.array([7])) is None
    finally:
        runner.features = {}


def test_original_checkpoint_layout(tiny_qwen2_vl, expected, tmp_path):
    """The released checkpoints name the weights `model.layers.*` and `visual.*` (transformers 4's layout)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_qwen2_vl[2], tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v for k, v in weights.items()
    }
    assert "visual.merger.mlp.2.weight" in renamed and "model.layers.0.mlp.up_proj.weight" in renamed
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text, images = PROMPTS[0]
    assert tokens(make_llm(str(tmp_path)).generate(as_prompt(text, images), GREEDY, use_tqdm=False)) == [expected[0]]
