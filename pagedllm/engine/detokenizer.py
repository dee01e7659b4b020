"""Incremental detokenization: each new token's text, decoded from a small window of recent tokens."""

from __future__ import annotations

_CONTEXT = 5  # tokens of earlier context decoded together with new ones (so merges and spaces come out right)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token_id: int) -> str:
        """Appends a token; returns the new text it completes (empty while a multi-byte character is partial)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""
