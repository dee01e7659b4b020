"""vLLM's multimodal-inputs page and its vision-language examples, run with only the names changed
(tests/doc_scripts.py): `vllm` -> `pagedllm` in the imports, the hub models -> the tiny random LLaVA and Qwen2-VL
(tests/tiny_llava.py, tests/tiny_qwen2_vl.py), file names and https URLs -> local files and a local HTTP server.

Each script paraphrases the documents' calls (fewer prompts, shorter and greedy generations, for CPU test time): one
image; a batch; several images in one prompt with limit_mm_per_prompt; LLM.chat with image_url and image_pil parts,
and video frames as images; a video; the examples' EngineArgs -> asdict -> LLM(**...) scripts with
mm_processor_kwargs. The model copies used here carry a generation_config.json with temperature 0 and 8 new tokens,
so the documents' calls without SamplingParams are greedy: what a script prints must be HF transformers' greedy text
for the same prompt and images. The page's other inputs (embeddings, multi_modal_uuids, the RGBA background) are in
test_vllm_mm_doc_inputs.py; the online example in openai/test_serve_mm_doc_example.py."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import tiny_llava
import tiny_qwen2_vl
import torch
from doc_scripts import run_script
from mm_doc_helpers import (
    LLAVA_HUB,
    MAX_TOKENS,
    QWEN,
    QWEN_HUB,
    hf_texts,
    load,
    printed,
    until_eos,
)

pytestmark = pytest.mark.usefixtures("mm_doc_env")


# the page's image inputs: one image, then a batch of two prompts each with its image
IMAGE_INPUTS = """
import PIL.Image
from vllm import LLM

llm = LLM(model="llava-hf/llava-1.5-7b-hf")
prompt = "USER: <image>\\nWhat is the content of this image?\\nASSISTANT:"
image = PIL.Image.open("image.jpg")
outputs = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}})
for o in outputs:
    print(o.outputs[0].text)

image_1 = PIL.Image.open("image_1.jpg")
image_2 = PIL.Image.open("image_2.jpg")
outputs = llm.generate(
    [
        {
            "prompt": "USER: <image>\\nWhat is the content of this image?\\nASSISTANT:",
            "multi_modal_data": {"image": image_1},
        },
        {
            "prompt": "USER: <image>\\nWhat's the color of this image?\\nASSISTANT:",
            "multi_modal_data": {"image": image_2},
        },
    ]
)
for o in outputs:
    print(o.outputs[0].text)
"""


def test_image_inputs(llava_docs, doc_media):
    hf, processor, path = llava_docs
    folder, _ = doc_media
    names = dict.fromkeys(LLAVA_HUB, path)
    names |= {"image.jpg": str(folder / "0.png"), "image_1.jpg": str(folder / "1.png")}
    names |= {"image_2.jpg": str(folder / "2.png")}
    namespace = {}
    out = run_script(IMAGE_INPUTS, names, namespace=namespace)
    what, color = "USER: <image>\nWhat is the content of this image?\nASSISTANT:", namespace["outputs"][1].prompt
    assert color == "USER: <image>\nWhat's the color of this image?\nASSISTANT:"
    images = [load(folder, f"{i}.png") for i in range(3)]
    requests = [(what, images[:1]), (what, images[1:2]), (color, images[2:])]
    want = hf_texts(tiny_llava.hf_generate, hf, processor, requests)
    assert out == printed(want)
    text_only = hf_texts(tiny_llava.hf_generate, hf, processor, [(what.replace("<image>", ""), [])])
    assert len(set(want + text_only)) == 4  # each image decides the text: a dropped image would show
    # the same prompts through the API with explicit greedy parameters give the same tokens
    llm, params = namespace["llm"], namespace["llm"].get_default_sampling_params()
    assert params.temperature == 0.0 and params.max_tokens == MAX_TOKENS
    again = llm.generate([{"prompt": what, "multi_modal_data": {"image": images[0]}}], params, use_tqdm=False)
    assert again[0].outputs[0].text == want[0]


# several images in one prompt (the page's Phi-3.5-vision call, in Qwen2-VL's prompt format), then the multi-image
# example's LLM.chat with image_url parts (https URLs)
MULTI_IMAGE = """
import PIL.Image
from vllm import LLM, SamplingParams

llm = LLM(
    model="microsoft/Phi-3.5-vision-instruct",
    trust_remote_code=True,
    max_model_len=4096,
    limit_mm_per_prompt={"image": 2},
)
prompt = ("<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
          "What is the content of each image?<|im_end|>\\n<|im_start|>assistant\\n")
image1 = PIL.Image.open("image1.jpg")
image2 = PIL.Image.open("image2.jpg")
outputs = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image1, image2]}})
for o in outputs:
    print(o.outputs[0].text)

image_urls = ["https://upload.wikimedia.org/duck.jpg", "https://upload.wikimedia.org/lion.jpg"]
sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
outputs = llm.chat(
    [{
        "role": "user",
        "content": [
            {"type": "text", "text": "What are the animals in these images?"},
            *({"type": "image_url", "image_url": {"url": url}} for url in image_urls),
        ],
    }],
    sampling_params=sampling_params,
)
for o in outputs:
    print(o.outputs[0].text)
"""


@QWEN
def test_multi_image(qwen_docs, doc_media):
    hf, processor, path = qwen_docs
    folder, base = doc_media
    names = dict.fromkeys(LLAVA_HUB, path) | {"image1.jpg": str(folder / "q1.png")}
    names |= {"image2.jpg": str(folder / "q3.png")}
    names |= {"https://upload.wikimedia.org/duck.jpg": f"{base}/q0.png"}
    names |= {"https://upload.wikimedia.org/lion.jpg": f"{base}/q2.png"}
    namespace = {}
    out = run_script(MULTI_IMAGE, names, namespace=namespace)
    image = tiny_qwen2_vl.IMAGE
    prompt = f"<|im_start|>user\n{image}{image}What is the content of each image?<|im_end|>\n<|im_start|>assistant\n"
    chat = f"user: What are the animals in these images?{image}{image}\nassistant:"
    requests = [(prompt, [load(folder, "q1.png"), load(folder, "q3.png")])]
    requests.append((chat, [load(folder, "q0.png"), load(folder, "q2.png")]))
    want = hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, requests)
    assert namespace["outputs"][0].prompt == chat
    assert namespace["outputs"][0].prompt_token_ids.count(tiny_qwen2_vl.IMAGE_TOKEN_ID) == 24
    assert out == printed(want)
    text_only = [(p.replace(image, ""), []) for p, _ in requests]
    assert out != printed(hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, text_only))  # the images steer it
    llm = namespace["llm"]
    with pytest.raises(ValueError, match=r"has 3 items, more than limit_mm_per_prompt\['image'\]=2"):
        llm.generate({"prompt": prompt + image, "multi_modal_data": {"image": [requests[0][1][0]] * 3}})


# the page's LLM.chat with an image URL, a PIL image and precomputed embeddings after a few turns
CHAT_PARTS = """
import PIL.Image
import torch
from vllm import LLM

llm = LLM(model="llava-hf/llava-1.5-7b-hf")
image_url = "https://picsum.photos/id/32/512/512"
image_pil = PIL.Image.open("cherry_blossom.jpg")
image_embeds = torch.load("image_embeds.pt")
conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "image_pil", "image_pil": image_pil},
            {"type": "image_embeds", "image_embeds": image_embeds},
            {"type": "text", "text": "What's in these images?"},
        ],
    },
]
if WITHOUT_EMBEDS:
    conversation[-1]["content"].pop(2)
outputs = llm.chat(conversation)
for o in outputs:
    print(o.outputs[0].text)
"""


def test_chat_with_image_parts(llava_docs, doc_media, tmp_path):
    hf, processor, path = llava_docs
    folder, base = doc_media
    torch.save(torch.zeros(1, tiny_llava.NUM_IMAGE_TOKENS, 64), tmp_path / "embeds.pt")
    names = dict.fromkeys(LLAVA_HUB, path) | {"https://picsum.photos/id/32/512/512": f"{base}/1.png"}
    names |= {"cherry_blossom.jpg": str(folder / "3.png"), "image_embeds.pt": str(tmp_path / "embeds.pt")}
    # the page's conversation as written: an image_embeds part needs enable_mm_embeds=True (in vLLM too)
    with pytest.raises(ValueError, match=r"image embeddings \(a tensor\) need the engine built with enable_mm_embeds"):
        run_script(CHAT_PARTS.replace("WITHOUT_EMBEDS", "False"), names)
    out = run_script(CHAT_PARTS.replace("WITHOUT_EMBEDS", "True"), names)
    rendered = (
        "system: You are a helpful assistant\nuser: Hello\nassistant: Hello! How can I assist you today?\n"
        "user: <image><image>What's in these images?\nassistant:"
    )
    images = [load(folder, "1.png"), load(folder, "3.png")]
    want = hf_texts(tiny_llava.hf_generate, hf, processor, [(rendered, images)])
    assert out == printed(want)
    assert want != hf_texts(tiny_llava.hf_generate, hf, processor, [(rendered.replace("<image>", ""), [])])


# the page's video captioning with Qwen2-VL: the frames as base64 JPEG image_url parts of one chat message
FRAMES_AS_IMAGES = """
import base64
import io
import numpy as np
import PIL.Image
from vllm import LLM

def encode_image(frame):
    buf = io.BytesIO()
    PIL.Image.fromarray(frame).save(buf, format="JPEG")
    return base64.b64encode(buf.getvalue()).decode("utf-8")

llm = LLM("Qwen/Qwen2-VL-2B-Instruct", limit_mm_per_prompt={"image": 4})
video_frames = np.load("frames.npy")
message = {
    "role": "user",
    "content": [
        {"type": "text", "text": "Describe this set of frames. Consider the frames to be a part of the same video."},
    ],
}
for i in range(len(video_frames)):
    base64_image = encode_image(video_frames[i])
    new_image = {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{base64_image}"}}
    message["content"].append(new_image)
outputs = llm.chat([message])
for o in outputs:
    print(o.outputs[0].text)
"""


@QWEN
def test_video_frames_as_images(qwen_docs, tmp_path):
    from PIL import Image

    hf, processor, path = qwen_docs
    frames = tiny_qwen2_vl.video(3, 3, (56, 84))
    np.save(tmp_path / "frames.npy", frames)
    namespace = {}
    out = run_script(FRAMES_AS_IMAGES, dict.fromkeys(QWEN_HUB, path) | {"frames.npy": str(tmp_path / "frames.npy")},
                     namespace=namespace)  # fmt: skip
    decoded = []  # the JPEG the script sent, decoded as the server side decodes it
    for part in namespace["message"]["content"][1:]:
        data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
        decoded.append(Image.open(io.BytesIO(data)).convert("RGB"))
    text = "Describe this set of frames. Consider the frames to be a part of the same video."
    rendered = f"user: {text}{tiny_qwen2_vl.IMAGE * 3}\nassistant:"
    want = hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, [(rendered, decoded)])
    assert out == printed(want)
    assert namespace["outputs"][0].prompt_token_ids.count(tiny_qwen2_vl.IMAGE_TOKEN_ID) == 18  # 3 frames of 6 tokens
    text_only = [(rendered.replace(tiny_qwen2_vl.IMAGE, ""), [])]
    assert out != printed(hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, text_only))


# the page's video input (Qwen2.5-VL): frames as a numpy array in the 'video' field, the prompt from the chat
# template with a video part (the page renders it with the model's processor; here its tokenizer's template)
VIDEO_INPUT = """
import numpy as np
from vllm import LLM, SamplingParams

model_path = "Qwen/Qwen2.5-VL-3B-Instruct"
llm = LLM(model=model_path, enforce_eager=True, limit_mm_per_prompt={"video": 1})
sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
video_messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "describe this video."}, {"type": "video"}]},
]
prompt = llm.get_tokenizer().apply_chat_template(video_messages, tokenize=False, add_generation_prompt=True)
llm_inputs = {"prompt": prompt, "multi_modal_data": {"video": [np.load("video.npy")]}}
outputs = llm.generate([llm_inputs], sampling_params=sampling_params)
for o in outputs:
    print(o.outputs[0].text)
"""


@QWEN
def test_video_input(qwen_docs, tmp_path):
    hf, processor, path = qwen_docs
    frames = tiny_qwen2_vl.video(5)
    np.save(tmp_path / "video.npy", frames)
    namespace = {}
    out = run_script(VIDEO_INPUT, dict.fromkeys(QWEN_HUB, path) | {"video.npy": str(tmp_path / "video.npy")},
                     namespace=namespace)  # fmt: skip
    prompt = f"system: You are a helpful assistant.\nuser: describe this video.{tiny_qwen2_vl.VIDEO}\nassistant:"
    assert namespace["prompt"] == prompt
    # HF's model gets the patches pagedllm's processor made (transformers' video processor needs torchvision)
    _, features = namespace["llm"].llm_engine.multimodal_processor().process(prompt, {"video": frames})
    videos = (features[0].data["pixel_values_videos"], features[0].data["video_grid_thw"])
    ids = until_eos(tiny_qwen2_vl.hf_generate(hf, processor, prompt, [], MAX_TOKENS, videos))
    assert out == printed([processor.tokenizer.decode(ids, skip_special_tokens=True)])
    text_only = hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, [(prompt.replace(tiny_qwen2_vl.VIDEO, ""), [])])
    assert out != printed(text_only)


# examples/offline_inference/vision_language.py, condensed: per-model EngineArgs (mm_processor_kwargs for
# Qwen2-VL), LLM(**asdict(engine_args) | {"seed": ...}), one image for every prompt
VISION_LANGUAGE = """
from dataclasses import asdict
from typing import NamedTuple, Optional

import PIL.Image
from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser


class ModelRequestData(NamedTuple):
    engine_args: EngineArgs
    prompts: list[str]
    stop_token_ids: Optional[list[int]] = None


def run_llava(questions: list[str], modality: str) -> ModelRequestData:
    assert modality == "image"
    prompts = [f"USER: <image>\\n{question}\\nASSISTANT:" for question in questions]
    engine_args = EngineArgs(
        model="llava-hf/llava-1.5-7b-hf",
        max_model_len=4096,
        disable_mm_preprocessor_cache=args.disable_mm_preprocessor_cache,
    )
    return ModelRequestData(engine_args=engine_args, prompts=prompts)


def run_qwen2_vl(questions: list[str], modality: str) -> ModelRequestData:
    engine_args = EngineArgs(
        model="Qwen/Qwen2-VL-2B-Instruct",
        max_model_len=4096,
        max_num_seqs=5,
        mm_processor_kwargs={"min_pixels": 28 * 28, "max_pixels": 1280 * 28 * 28},
        disable_mm_preprocessor_cache=args.disable_mm_preprocessor_cache,
    )
    placeholder = "<|image_pad|>" if modality == "image" else "<|video_pad|>"
    prompts = [
        (f"<|im_start|>user\\n<|vision_start|>{placeholder}<|vision_end|>{question}<|im_end|>\\n"
         "<|im_start|>assistant\\n")
        for question in questions
    ]
    return ModelRequestData(engine_args=engine_args, prompts=prompts)


model_example_map = {"llava": run_llava, "qwen2_vl": run_qwen2_vl}


def main(args):
    image = PIL.Image.open("cherry_blossom.jpg").convert("RGB")
    questions = ["What is the content of this image?", "Where is this image taken?"]
    req_data = model_example_map[args.model_type](questions, args.modality)
    engine_args = asdict(req_data.engine_args) | {"seed": args.seed}
    llm = LLM(**engine_args)
    sampling_params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=req_data.stop_token_ids)
    inputs = [
        {"prompt": req_data.prompts[i % len(req_data.prompts)], "multi_modal_data": {args.modality: image}}
        for i in range(args.num_prompts)
    ]
    outputs = llm.generate(inputs, sampling_params=sampling_params)
    for o in outputs:
        print(o.outputs[0].text)
    return outputs


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser.add_argument("--model-type", "-m", type=str, default="llava", choices=model_example_map.keys())
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--modality", type=str, default="image", choices=["image", "video"])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--disable-mm-preprocessor-cache", action="store_true")
    args = parser.parse_args()
    outputs = main(args)
"""


def test_vision_language_example_llava(llava_docs, doc_media):
    hf, processor, path = llava_docs
    folder, _ = doc_media
    names = dict.fromkeys(LLAVA_HUB, path) | {"cherry_blossom.jpg": str(folder / "2.png")}
    argv = ["--num-prompts", "2", "--seed", "0", "--disable-mm-preprocessor-cache"]
    out = run_script(VISION_LANGUAGE, names, argv)
    questions = ["What is the content of this image?", "Where is this image taken?"]
    requests = [(f"USER: <image>\n{q}\nASSISTANT:", [load(folder, "2.png")]) for q in questions]
    assert out == printed(hf_texts(tiny_llava.hf_generate, hf, processor, requests))


@QWEN
def test_vision_language_example_qwen2_vl_processor_kwargs(qwen_docs, doc_media):
    """The example's max_pixels (1280 patches of 28x28) lets the 224x224 image keep its size: 64 tokens where the
    checkpoint's processor (at most 12 tokens) would shrink it."""
    hf, processor, path = qwen_docs
    folder, _ = doc_media
    namespace = {}
    argv = ["-m", "qwen2_vl", "--num-prompts", "1"]
    out = run_script(VISION_LANGUAGE, dict.fromkeys(QWEN_HUB, path) | {"cherry_blossom.jpg": str(folder / "large.png")},
                     argv, namespace)  # fmt: skip
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is the content of this image?"
    prompt += "<|im_end|>\n<|im_start|>assistant\n"
    assert namespace["outputs"][0].prompt_token_ids.count(tiny_qwen2_vl.IMAGE_TOKEN_ID) == 64
    inputs = processor(text=[prompt], images=[load(folder, "large.png")], return_tensors="pt",
                       size={"shortest_edge": 28 * 28, "longest_edge": 1280 * 28 * 28})  # fmt: skip
    with torch.no_grad():
        ids = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    want = until_eos(ids[0, inputs["input_ids"].shape[1] :].tolist())
    assert out == printed([processor.tokenizer.decode(want, skip_special_tokens=True)])
    assert out != printed(hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, [(prompt, [load(folder, "large.png")])]))


def test_engine_seed(llava_docs):
    """The examples pass seed=None (their --seed default): a random seed, as vLLM; a seed that is no integer in
    range is a ValueError naming it."""
    from pagedllm import EngineArgs

    path = llava_docs[2]
    assert EngineArgs(model=path, seed=None).create_engine_config().model.seed >= 0
    for bad in (-1, 2**64, "7", 1.5):
        with pytest.raises(ValueError, match=r"seed=.* must be None or an integer in \[0, 2\*\*64\)"):
            EngineArgs(model=path, seed=bad).create_engine_config()
