"""Structured outputs: a request's output constrained by a JSON schema, a regex, choices or a grammar (xgrammar).
xgrammar is imported only when a constrained request arrives (the `structured` extra)."""

from pagedllm.structured_output.manager import RequestGrammar, StructuredOutputManager, fill_bitmasks

__all__ = ["RequestGrammar", "StructuredOutputManager", "fill_bitmasks"]
