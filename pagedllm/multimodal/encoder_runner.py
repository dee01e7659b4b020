"""The runner's side of multimodal inputs: each request's items, the encoder cache (item hash -> encoder output,
least recently used evicted past its byte budget) and the embeddings of a step's placeholder tokens.

Chunked prefill may cut through an item's placeholder span: the encoder runs on the whole item in the first step
whose chunk reaches into the span, its output stays in the cache, and each chunk takes the rows of its own positions.
An output evicted before its last chunk ran is computed again (same result, more work), so any chunking is correct;
the same item in other requests (same hash) is not encoded again while its output is cached. A model whose image
tokens attend bidirectionally (Gemma 3) also gets each step's ImageSpans (multimodal/bidirectional.py); a pipeline
stage after the first gets only those (step_spans: no encoder there, its inputs are hidden states)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagedllm.multimodal.bidirectional import ImageSpan, step_spans
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.mrope import mrope_positions


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        out = self.entries.get(key)
        if out is not None:
            self.entries.move_to_end(key)
        return out

    def put(self, key: str, value: torch.Tensor) -> None:
        """Keeps value unless it alone is over the budget; evicts the least recently used past the budget."""
        size = value.numel() * value.element_size()
        if size > self.capacity_bytes or key in self.entries:
            return
        while self.entries and self.num_bytes + size > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self.entries[key] = value
        self.num_bytes += size


class MultiModalEmbeds(tuple):
    """(rows of the flat batch [n], their embeddings [n, hidden]) of a step's placeholder tokens, carrying `spans`:
    the ImageSpans of the step's bidirectional items (None: it has none). On a pipeline stage after the first
    (None, None) with the spans only."""

    def __new__(cls, rows, embeds, spans: list[ImageSpan] | None) -> MultiModalEmbeds:
        out = super().__new__(cls, (rows, embeds))
        out.spans = spans
        return out


class MultiModalRunner:
    def __init__(
        self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, cache_bytes: int, block_size: int = 16
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.cache = EncoderCache(cache_bytes)
        self.features: dict[str, list[MultiModalFeature]] = {}  # req_id -> its items, in prompt order
        self.num_encoder_runs = 0  # items encoded so far (a cache hit runs none)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))

    def update(self, so) -> None:
        """Applies the step's delta: requests that left drop their items, (re-)admitted ones bring them."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.features.pop(req_id, None)
        for new in so.new_reqs:
            self.features.pop(new.req_id, None)
            if new.mm_features:
                self.features[new.req_id] = new.mm_features

    def encode(self, feature: MultiModalFeature) -> torch.Tensor:
        """The item's encoder output [feature.length, hidden], from the cache or computed now."""
        out = self.cache.get(feature.identifier)
        if out is None:
            data = {
                k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype) for k, v in feature.data.items()
            }
            if "image_embeds" in data:  # precomputed by the user (enable_mm_embeds): no encoder run, nothing cached
                return data["image_embeds"]
            out = self.model.embed_multimodal(feature.modality, data)  # [length, hidden]
            if out.shape[0] != feature.length:
                raise RuntimeError(f"the encoder gave {out.shape[0]} rows for {feature.length} placeholder tokens")
            self.num_encoder_runs += 1
            self.cache.put(feature.identifier, out)
        return out

    @torch.inference_mode()
    def profile_encoder(self) -> None:
        """One encoder run on the largest item the model takes (the GPU memory profile measures its peak)."""
        data = self.model.dummy_multimodal_data()
        data = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype) for k, v in data.items()}
        self.model.embed_multimodal("image", data)

    def step_positions(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray):
        """M-RoPE positions of the step (positions: the flat batch's [num_tokens]): [3, num_tokens], or
        [num_tokens] where every token has one position on all axes (text, decodes: CUDA graphs can take them);
        None for a model without M-RoPE or a step whose requests have no items (the plain positions hold)."""
        if not self.uses_mrope or not any(self.features.get(r) for r in req_ids):
            return None
        out = np.repeat(positions[None].astype(np.int64), 3, axis=0)  # [3, num_tokens]
        for i, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if features:
                lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
                out[:, lo:hi] = mrope_positions(positions[lo:hi], features)
        return out[0] if (out[0] == out[1]).all() and (out[0] == out[2]).all() else out

    def step_embeddings(
        self,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray | None = None,
    ) -> MultiModalEmbeds | None:
        """(rows of the flat batch [n], their embeddings [n, hidden]) for the step's placeholder tokens; None when
        the step has none. Request i computes positions [seq_lens[i] - its token count, seq_lens[i]).
        block_table [num_reqs, max_blocks]: the requests' blocks (the key slots of bidirectional items)."""
        rows, embeds = [], []
        for i, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if not features:
                continue
            first_row, start, end = _request_span(query_start_loc, seq_lens, i)
            for f in features:
                lo, hi = max(start, f.offset), min(end, f.end)
                if lo >= hi:
                    continue
                rows.append(np.arange(lo - start, hi - start) + first_row)
                embeds.append(self.encode(f)[lo - f.offset : hi - f.offset])
        if not rows:
            return None
        index = torch.from_numpy(np.concatenate(rows)).to(self.device)
        spans = None if block_table is None else self._spans(req_ids, query_start_loc, seq_lens, block_table)
        return MultiModalEmbeds(index, torch.cat(embeds), spans)

    def step_spans(
        self, req_ids: list[str], query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray
    ) -> MultiModalEmbeds | None:
        """What a pipeline stage after the first needs of the step's items: (None, None) carrying the ImageSpans of
        its bidirectional items (Gemma 3); None when it has none (or the model's images attend causally)."""
        spans = self._spans(req_ids, query_start_loc, seq_lens, block_table)
        return None if spans is None else MultiModalEmbeds(None, None, spans)

    def _spans(
        self, req_ids: list[str], query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray
    ) -> list[ImageSpan] | None:
        """The ImageSpans of the step's bidirectional items, None if none (or the model has none)."""
        if not getattr(self.model, "bidirectional_images", False):
            return None
        spans = []
        for i, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if features:
                first_row, start, end = _request_span(query_start_loc, seq_lens, i)
                spans += step_spans(features, first_row, start, end, block_table[i], self.block_size)
        dev = self.device
        return [ImageSpan(r, torch.from_numpy(p).to(dev), torch.from_numpy(k).to(dev)) for r, p, k in spans] or None


def _request_span(query_start_loc: np.ndarray, seq_lens: np.ndarray, i: int) -> tuple[int, int, int]:
    """(its first row in the flat batch, first position, end position) of request i's tokens in the step."""
    first_row, end = int(query_start_loc[i]), int(seq_lens[i])
    return first_row, end - (int(query_start_loc[i + 1]) - first_row), end


def make_multimodal_runner(model: torch.nn.Module, config) -> MultiModalRunner | None:
    """The runner's multimodal part for a model that takes images (None for a text-only model)."""
    if not getattr(model, "supports_multimodal", False):
        return None
    mm_config = getattr(config, "multimodal", None) or MultiModalConfig()
    return MultiModalRunner(
        model, config.device.device, config.model.dtype, mm_config.encoder_cache_bytes, config.cache.block_size
    )
