"""The OpenAI-compatible HTTP server (`pagedllm serve`). Needs the `serve` extra: fastapi, uvicorn, pydantic."""
