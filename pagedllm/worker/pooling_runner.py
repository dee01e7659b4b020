"""PoolingRunner: one forward over a batch of whole sequences (no KV cache, no sampler), then pooling and the
task's head. Encoders attend bidirectionally, decoders used as embedders or classifiers causally.

With several ranks every rank runs the batch on its shard (tensor parallelism: the layers' all-reduces leave every
rank of a stage with the whole hidden states). With pipeline stages the batch goes through the stages in turn: each
stage before the last sends (hidden, residual) [2, num_tokens, hidden_size] to the next; the last stage pools, and
its first rank returns the results (the executor hands them to the engine); the other ranks return None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.attention import encoder_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import ParallelGroups
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.layers.pooler import classify_head, embed_head, pool
from pagedllm.lora.manager import make_lora_manager
from pagedllm.model_loader.loader import get_model
from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None  # BERT's segment ids of a text pair; None: all 0
    params: PoolingParams  # verified for the request's task (params.task is set)
    lora_request: Any = None  # its LoRARequest; None: the base model


class PoolingRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        self.device = config.device.device
        self.spec = config.model.pooler
        self.groups = groups if groups is not None else ParallelGroups.single(self.device)
        info = self.groups.info
        self.first_stage, self.last_stage = info.pp_rank == 0, info.pp_rank == info.pp_size - 1
        self.returns = self.last_stage and info.tp_rank == 0  # the rank whose results reach the engine
        self.hidden_size, self.dtype = int(config.model.hf_config.hidden_size), config.model.dtype
        context = self.groups.build_context()
        self.model = get_model(config.model, self.device, context)
        self.lora = make_lora_manager(config, self.model, self.device, context)  # None: LoRA is off
        for layer in self.model.modules():
            if isinstance(layer, Attention):
                if layer.extras or layer.alibi_slopes is not None:  # the encoder backend has plain SDPA only
                    raise ValueError(
                        f"{config.model.architecture} cannot run as a pooling model: its attention uses logits "
                        "soft-capping or ALiBi, which the pooling path does not compute"
                    )
                layer.backend, layer.kv_cache = encoder_backend, None
        # encoders say so; a decoder is causal unless its HF config has is_causal=False (bidirectional embedders)
        self.causal = getattr(self.model, "is_causal", getattr(config.model.hf_config, "is_causal", True))
        self.uses_token_type_ids = getattr(self.model, "uses_token_type_ids", False)

    def add_lora(self, request) -> bool:
        """Reads and checks a LoRA adapter (ValueError) and keeps its host copy; False if it was known."""
        if self.lora is None:
            raise ValueError("lora_request: LoRA is off; create the engine with enable_lora=True")
        return self.lora.add(request)

    def _inputs(self, reqs: list[PoolingRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lens = np.array([len(r.prompt_token_ids) for r in reqs], dtype=np.int64)  # [num_seqs]
        total = int(lens.sum())
        ids = np.fromiter((t for r in reqs for t in r.prompt_token_ids), dtype=np.int64, count=total)  # [num_tokens]
        starts = np.repeat(np.cumsum(lens) - lens, lens)  # [num_tokens] first row of each token's sequence
        positions = np.arange(total, dtype=np.int64) - starts  # [num_tokens]
        types = None
        if self.uses_token_type_ids and any(r.token_type_ids is not None for r in reqs):
            flat = (t for r in reqs for t in (r.token_type_ids or [0] * len(r.prompt_token_ids)))
            types = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=total)).to(self.device)  # [num_tokens]
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(positions).to(self.device), types

    @torch.inference_mode()
    def execute(self, reqs: list[PoolingRequest]) -> list[torch.Tensor] | None:
        """Runs the sequences of `reqs` (one task) in one forward; returns one float32 CPU tensor per request (None
        on a rank that does not return them)."""
        input_ids, positions, types = self._inputs(reqs)
        seq_lens = [len(r.prompt_token_ids) for r in reqs]
        meta = encoder_backend.build_metadata(seq_lens, self.causal, self.device)
        kwargs = {"token_type_ids": types} if self.uses_token_type_ids else {}
        lora = None
        if self.lora is not None:  # each token's adapter id (0: the base model)
            for r in reqs:  # (a rank other than the engine's reads an adapter when a request first brings it)
                if r.lora_request is not None:
                    self.lora.add(r.lora_request)
            ids = [r.lora_request.lora_int_id if r.lora_request is not None else 0 for r in reqs]
            lora = self.lora.mapping(np.repeat(np.array(ids, dtype=np.int64), seq_lens))
        with forward_context(meta, lora):
            hidden = self._forward(input_ids, positions, kwargs)  # [num_tokens, hidden]
        if not self.returns:
            return None
        lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=self.device)  # [num_seqs]
        task = reqs[0].params.task
        if task in ("classify", "score"):  # CLS (encoders) or last token (decoders), then the model's head
            pooled = pool(hidden, lens_t, self.spec.pooling_type).to(hidden.dtype)  # [num_seqs, hidden]
            logits = self.model.classify(pooled)  # [num_seqs, num_labels] float32
            return [classify_head(logits[i], self._activation(r)).cpu() for i, r in enumerate(reqs)]
        if task == "token_classify":
            rows = torch.split(self.model.classify(hidden), seq_lens)  # each [seq_len, num_labels] float32
            return [classify_head(x, self._activation(r)).cpu() for x, r in zip(rows, reqs)]
        if task == "token_embed":
            rows = torch.split(hidden.float(), seq_lens)  # each [seq_len, hidden]
            return [embed_head(x, r.params.dimensions, self._normalize(r)).cpu() for x, r in zip(rows, reqs)]
        return self._embed(pool(hidden, lens_t, self.spec.pooling_type), reqs)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """The model's forward on this rank: the whole model, or this stage's layers between the previous stage's
        receive and the next one's send (None before the last stage)."""
        if self.groups.info.pp_size == 1:
            return self.model(input_ids, positions, **kwargs)
        pp, n = self.groups.pp, input_ids.shape[0]
        if self.first_stage:
            out = self.model(input_ids, positions, **kwargs)
        else:
            pair = torch.empty((2, n, self.hidden_size), dtype=self.dtype, device=self.device)
            pp.recv(pair, pp.rank - 1)
            out = self.model(None, positions, (pair[0], pair[1]))
        if self.last_stage:
            return out
        pp.send(torch.stack(out), pp.rank + 1)
        return None

    def _activation(self, req: PoolingRequest) -> str:
        """The activation of a classifier request's logits: the model's for the task, none if use_activation=False."""
        if req.params.use_activation is False:
            return "identity"
        return self.spec.activations.get(req.params.task, "auto")

    def _normalize(self, req: PoolingRequest) -> bool:
        return self.spec.normalize if req.params.normalize is None else req.params.normalize

    def _embed(self, pooled: torch.Tensor, reqs: list[PoolingRequest]) -> list[torch.Tensor]:
        """pooled [num_seqs, hidden] -> each request's embedding; requests with the same options share one op."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault((r.params.dimensions, self._normalize(r)), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(reqs)
        for (dimensions, normalize), rows in groups.items():
            part = pooled if len(rows) == len(reqs) else pooled[torch.tensor(rows, device=pooled.device)]
            vectors = embed_head(part, dimensions, normalize).cpu()  # [len(rows), dimensions or hidden]
            for j, i in enumerate(rows):
                out[i] = vectors[j]
        return out  # type: ignore[return-value]
