"""Speculative decoding: proposers of draft tokens, which the target model verifies in the next step."""

from pagedllm.spec_decode.proposer import Proposer, ReplayProposer

__all__ = ["Proposer", "ReplayProposer"]
