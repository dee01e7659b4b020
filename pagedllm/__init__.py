"""pagedllm: an LLM inference engine with vLLM's offline API.

from pagedllm import LLM, SamplingParams
"""

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TextPrompt",
    "TokensPrompt",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "__version__",
]
