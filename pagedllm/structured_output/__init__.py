"""Structured outputs: a request's output constrained by a JSON schema, a regex, choices or a grammar, through
xgrammar (the `structured` extra) or llguidance (the `guidance` extra); each is imported only when a constrained
request needs it."""

from pagedllm.structured_output.manager import RequestGrammar, StructuredOutputManager, fill_bitmasks, validate_drafts

__all__ = ["RequestGrammar", "StructuredOutputManager", "fill_bitmasks", "validate_drafts"]
