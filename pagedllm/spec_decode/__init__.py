"""Speculative decoding: proposers of draft tokens, which the target model verifies in the next step."""

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import Proposer, ReplayProposer

__all__ = ["NgramProposer", "Proposer", "ReplayProposer", "SpeculativeConfig"]
