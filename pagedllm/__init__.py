"""pagedllm: an LLM inference engine with vLLM's offline API.

from pagedllm import LLM, SamplingParams
"""

from pagedllm import startup  # first: it times the import
from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import EmbedsPrompt, TextPrompt, TokensPrompt
from pagedllm.logger import configure_logging
from pagedllm.lora.request import LoRARequest
from pagedllm.models.registry import ModelRegistry
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

startup.mark_imported()
configure_logging()  # vLLM's log handler and level (VLLM_CONFIGURE_LOGGING=0: left to the application)

__all__ = [
    "LLM",
    "LoRARequest",
    "EngineArgs",
    "LLMEngine",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "ModelRegistry",
    "SamplingParams",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "TextPrompt",
    "TokensPrompt",
    "EmbedsPrompt",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingParams",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "__version__",
]
