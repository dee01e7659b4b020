"""POST /classify on a server started with a sequence-classification model: vLLM's ClassificationRequest (`input`:
one text or a list, or `messages`) answered with each input's class probabilities through `LLM.classify`, the same
pooling path as offline, and the most likely class's label (the model config's id2label)."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import Field

from pagedllm.entrypoints.openai.protocol import ChatInputFields, PoolingInput, from_value_error, now, random_id
from pagedllm.entrypoints.openai.serving_embeddings import pooling_prompts
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad


class ClassificationRequest(ChatInputFields):
    model: str | None = None
    input: PoolingInput | None = Field(default=None, examples=["A sentence to classify."])  # or messages
    truncate_prompt_tokens: int | None = None
    user: str | None = None


def _labels(state: ServerState) -> dict[int, str]:
    labels = getattr(state.engine.engine.config.model.hf_config, "id2label", None) or {}
    return {int(k): str(v) for k, v in labels.items()}


async def create_classify(state: ServerState, req: ClassificationRequest) -> JSONResponse:
    model = state.check_model(req.model)
    engine = state.engine.engine
    if state.engine.generates or "classify" not in engine.spec.tasks:
        what = "a generative model" if state.engine.generates else f"a model for {engine.spec.default_task!r}"
        raise bad(f"/classify: this server runs {what}; start `pagedllm serve` with a sequence-classification model")
    prompts = await pooling_prompts(state, req)
    try:
        outputs = await state.engine.call(
            state.llm.classify, prompts, truncate_prompt_tokens=req.truncate_prompt_tokens, use_tqdm=False
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "input") from None
    labels = _labels(state)
    data = []
    for i, out in enumerate(outputs):
        probs = [float(p) for p in out.outputs.probs]
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels.get(best), "probs": probs, "num_classes": len(probs)})
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
    body = {"id": random_id("classify"), "object": "list", "created": now(), "model": model, "data": data}
    return JSONResponse({**body, "usage": usage})
