"""The sampler's inputs for one step (SamplingMetadata), built on the host from the persistent batch's numpy arrays
in the form the sampler's path reads: the GPU kernel's (every input in one int32 array, one host-to-device copy),
the C kernels' (every row's parameters), or the torch path's (the rows of each kind, one copy per dtype). Seeded rows'
numbers are hashes of (seed, position), so a seeded request draws the same whatever shares its batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import to_device
from pagedllm.kernels import cpu_kernels, triton_available
from pagedllm.kernels.sampling_inputs import GREEDY_BELOW, input_words, pack_params, program_order
from pagedllm.sample.logits_processors import Penalties


@dataclass
class LogprobRequest:
    """The rows whose sampled tokens want logprobs, for the GPU sampling kernel, and where it writes them."""

    out: torch.Tensor  # [wanted, 4 + 2 k_max] int32 on the device: the kernel's output
    k_max: int  # the most top logprobs a row wants


@dataclass
class SamplingMetadata:
    """The sampler's inputs for one step. Which rows sample and which filter is decided on the host, so the
    sampler needs no device sync for it. Build it with `SamplingMetadata.build`: for the kernels (a GPU with Triton, a
    CPU with the C kernels) it holds every row's parameters (params; on the CPU also seed_uniforms)
    and none of the torch path's fields (None), elsewhere the reverse. A GPU step whose every row takes the argmax
    (no penalties, no logprobs) holds none of either: torch's argmax needs no inputs."""

    all_greedy: bool
    params: torch.Tensor | None  # kernels: [batch, 4] float32: temperature (0: greedy), top_k, top_p, min_p (GPU:
    # every input of the kernel, int32 words: pagedllm/kernels/sampling_inputs.py's pack_inputs)
    greedy_rows: torch.Tensor | None  # [num_greedy] int64: batch rows that take the argmax
    sample_rows: torch.Tensor | None  # [num_sample] int64: batch rows that sample
    plain: torch.Tensor | None  # [num_plain] int64: positions in sample_rows without top-k / top-p
    filtered: torch.Tensor | None  # [num_filtered] int64: positions in sample_rows with top-k or top-p
    temperature: torch.Tensor | None  # [num_sample] float32
    top_k: torch.Tensor | None  # [num_filtered] int64, 0 = off
    top_p: torch.Tensor | None  # [num_filtered] float32, 1 = off
    max_top_k: int
    min_p: torch.Tensor | None  # [num_sample] float32; None when no row uses it
    seeded: torch.Tensor | None  # [num_sample] bool; None when no row has a seed
    seed_uniforms: torch.Tensor | None  # [num_sample] float32: seeded_uniform of (seed, position) where seeded (C
    # kernels: [batch], -1 where not seeded)
    penalties: Penalties | None = None  # applied to the logits in place before sampling (not on the GPU kernel)
    num_penalized: int = 0  # GPU kernel: rows whose penalties are in params (the kernel samples from penalized
    # copies of them, the logits stay as they are)
    penalty_stride: int = 0  # their words each
    logprobs: LogprobRequest | None = None  # GPU kernel: the rows that want logprobs, computed by the sampling kernel

    @property
    def penalizes_in_place(self) -> bool:
        """Whether the sampler changes the penalized rows of the logits it is given."""
        return self.penalties is not None

    @classmethod
    def build(
        cls,
        temperature: np.ndarray,  # [batch] float32
        top_k: np.ndarray,  # [batch] int64, 0 = off
        top_p: np.ndarray,  # [batch] float32, 1 = off
        min_p: np.ndarray,  # [batch] float32, 0 = off
        seeds: np.ndarray | None = None,  # [batch] int64
        seeded: np.ndarray | None = None,  # [batch] bool
        positions: np.ndarray | None = None,  # [batch] int64: tokens each request has generated (the draw's counter)
        device: torch.device | str = "cpu",
        penalties: Penalties | None = None,  # the repetition / presence / frequency penalties of some rows
        num_top: np.ndarray | None = None,  # [batch] int64: top logprobs each row wants (-1: none); the GPU kernel's
        # sampling computes them (SamplingMetadata.logprobs), elsewhere the caller does (logprob_tensors)
    ) -> SamplingMetadata:
        device = torch.device(device)
        sampling = temperature >= GREEDY_BELOW
        if device.type == "cuda" and triton_available():
            return cls._for_kernel(
                temperature, top_k, top_p, min_p, seeds, seeded, positions, device, penalties, num_top
            )  # fmt: skip
        if device.type == "cpu" and cpu_kernels.compiled() is not None:
            meta = cls._for_c_kernels(temperature, top_k, top_p, min_p, seeds, seeded, positions)
            meta.penalties = penalties
            return meta
        rows = np.nonzero(sampling)[0]
        k, p = top_k[rows], top_p[rows]
        is_filtered = (k > 0) | (p < 1.0)
        filtered = np.nonzero(is_filtered)[0]
        any_seed = seeded is not None and bool(seeded[rows].any())
        any_min_p = bool((min_p[rows] > 0).any())
        if any_seed:  # hashed here, on the host: a few small numpy ops instead of dozens of device kernels
            seeds, positions = seeds[rows].astype(np.int64), positions[rows].astype(np.int64)
        ints = {"greedy_rows": np.nonzero(~sampling)[0], "sample_rows": rows, "plain": np.nonzero(~is_filtered)[0]}
        ints |= {"filtered": filtered, "top_k": k[filtered], "seeded": seeded[rows] if any_seed else None}
        floats = {"temperature": temperature[rows], "top_p": p[filtered], "min_p": min_p[rows] if any_min_p else None}
        floats["seed_uniforms"] = seeded_uniform(seeds, positions) if any_seed else None
        tensors = _to_device_packed(ints, np.int64, device) | _to_device_packed(floats, np.float32, device)
        tensors["seeded"] = None if tensors["seeded"] is None else tensors["seeded"].bool()
        return cls(
            all_greedy=not bool(sampling.any()),
            params=None,
            max_top_k=int(k[filtered].max()) if len(filtered) else 0,
            penalties=penalties,
            **tensors,
        )

    @classmethod
    def _for_kernel(
        cls, temperature, top_k, top_p, min_p, seeds, seeded, positions, device, penalties, num_top
    ) -> SamplingMetadata:
        """The GPU kernel's form: every row's parameters as they are, the penalized rows' tokens and penalties and
        the rows that want logprobs, in one host-to-device copy (the kernel hashes a seeded row's key from its seed
        and position). A step where every row takes the argmax, with no penalties or logprobs, gets none of it
        (params None): the sampler takes torch's argmax."""
        from pagedllm.kernels.penalties import EXTRA, pack_rows

        n = len(temperature)
        sampling = temperature >= GREEDY_BELOW
        listed = np.flatnonzero(num_top >= 0) if num_top is not None else ()  # the rows that want logprobs
        if not sampling.any() and penalties is None and not len(listed):
            return cls._every_row(sampling, None)  # torch's argmax takes every row: the kernel's inputs go unread
        if seeded is not None:
            seeded = seeded & sampling  # greedy rows draw nothing
        num_pen, max_len = (0, 0) if penalties is None else penalties.token_ids.shape
        pen_stride = max_len + EXTRA.value
        words, params, order, pen_words, wanted_words = input_words(n, num_pen, pen_stride, len(listed))
        penalized = wanted = None
        if num_pen:
            penalized = np.full(n, -1, dtype=np.int32)
            penalized[penalties.rows] = np.arange(num_pen)
            pack_rows(*penalties[1:], out=pen_words)
        if len(listed):
            wanted = np.full(n, -1, dtype=np.int32)
            wanted[listed] = np.arange(len(listed))
            wanted_words[:] = listed
        pack_params(temperature, top_k, top_p, min_p, seeds, seeded, positions, penalized, wanted, out=params)
        order[:] = program_order(params)
        inputs = to_device(words, device)
        meta = cls._every_row(sampling, inputs)
        if num_pen:
            meta.num_penalized, meta.penalty_stride = num_pen, pen_stride
            meta.all_greedy = False  # the kernel applies them
        if len(listed):
            k_max = int(num_top[listed].max())
            out = torch.empty(len(listed), 4 + 2 * k_max, dtype=torch.int32, device=device)
            meta.logprobs = LogprobRequest(out, k_max)
            meta.all_greedy = False
        return meta

    @classmethod
    def _for_c_kernels(cls, temperature, top_k, top_p, min_p, seeds, seeded, positions) -> SamplingMetadata:
        """The CPU kernels' form: every row's parameters as they are, and the uniform of each seeded row."""
        params = np.stack([temperature, top_k, top_p, min_p], axis=1).astype(np.float32)
        sampling = temperature >= GREEDY_BELOW
        rows = np.nonzero(seeded & sampling)[0] if seeded is not None else []
        if not len(rows):
            return cls._every_row(sampling, torch.from_numpy(params))
        uniforms = np.full(len(temperature), -1.0, dtype=np.float32)
        uniforms[rows] = seeded_uniform(seeds[rows].astype(np.int64), positions[rows].astype(np.int64))
        return cls._every_row(sampling, torch.from_numpy(params), torch.from_numpy(uniforms))

    @classmethod
    def _every_row(cls, sampling: np.ndarray, params: torch.Tensor | None, seed_uniforms=None) -> SamplingMetadata:
        """The kernels' form (params of every row; None for a GPU step that takes torch's argmax), none of the torch
        path's fields."""
        none = dict.fromkeys(["greedy_rows", "sample_rows", "plain", "filtered", "temperature", "top_k", "top_p"])
        return cls(
            all_greedy=not bool(sampling.any()),
            params=params,
            max_top_k=0,
            min_p=None,
            seeded=None,
            seed_uniforms=seed_uniforms,
            **none,
        )


def _to_device_packed(arrays: dict[str, np.ndarray | None], dtype, device) -> dict[str, torch.Tensor | None]:
    """The arrays (as dtype) in one host-to-device copy, through pinned memory on CUDA (no wait for the device's
    queue), as views of it; None stays None. One copy instead of one per array: each costs host time."""
    kept = {name: a for name, a in arrays.items() if a is not None}
    whole = to_device(np.concatenate([a.astype(dtype, copy=False) for a in kept.values()]), torch.device(device))
    out: dict[str, torch.Tensor | None] = dict.fromkeys(arrays)
    start = 0
    for name, a in kept.items():
        out[name] = whole[start : start + len(a)]
        start += len(a)
    return out


def _hash32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer mix (int64 arrays holding values < 2**32; every product stays below 2**63)."""
    mask = 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    return (x >> 16) ^ x


def _seeded_bits(seeds: np.ndarray, positions: np.ndarray, salt: int) -> np.ndarray:
    """32 random bits per (seed, position), one stream per salt. [rows] int64 in [0, 2**32)"""
    lo, hi = seeds & 0xFFFFFFFF, (seeds >> 32) & 0xFFFFFFFF
    key = _hash32(lo ^ _hash32(hi + 0x9E3779B9))
    return _hash32(key ^ _hash32((positions & 0xFFFFFFFF) + salt))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per (seed, position) (int64 arrays), whatever else is in the batch. [rows] float32"""
    return ((_seeded_bits(seeds, positions, 0x7F4A7C15) >> 8) * (1.0 / (1 << 24))).astype(np.float32)
