"""The sampler's inputs for one step (SamplingMetadata), built on the host from the persistent batch's numpy arrays
in the form the sampler's path reads: the GPU kernel's (every input in one int32 array, one host-to-device copy),
the C kernels' (every row's parameters), or the torch path's (the rows of each kind, one copy per dtype). Seeded rows'
numbers are hashes of (seed, position), so a seeded request draws the same whatever shares its batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import to_device
from pagedllm.kernels.sampling_inputs import GREEDY_BELOW, DeviceInputs, pack_inputs, pack_params
from pagedllm.sample.impl import TRITON, C, choose_impl
from pagedllm.sample.logits_processors import Penalties


@dataclass
class LogprobRequest:
    """The rows whose sampled tokens want logprobs, for the GPU sampling kernel, and where it writes them."""

    out: torch.Tensor  # [wanted, 4 + 2 k_max] int32 on the device: the kernel's output
    k_max: int  # the most top logprobs a row wants


@dataclass
class SamplingMetadata:
    """The sampler's inputs for one step. Which rows sample and which filter is decided on the host, so the
    sampler needs no device sync for it. Build it with `SamplingMetadata.build` (the engine's GPU steps: with
    ResidentInputs.update): for the GPU kernel it holds the kernel's inputs on the device (device_inputs), for the C
    kernels every row's parameters (params, seed_uniforms), and none of the torch path's fields (None); elsewhere the
    reverse. A GPU step whose every row takes the argmax (no penalties, no logprobs) holds none of them: torch's
    argmax needs no inputs."""

    all_greedy: bool
    params: torch.Tensor | None  # C kernels: [batch, 4] float32: temperature (0: greedy), top_k, top_p, min_p
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
    device_inputs: DeviceInputs | None = None  # GPU kernel: its inputs on the device (it samples from penalized
    # copies of the penalized rows, the logits stay as they are)
    logprobs: LogprobRequest | None = None  # GPU kernel: the rows that want logprobs, computed by the sampling kernel
    sampled: torch.Tensor | None = None  # GPU kernel: [batch] int64, where it writes the tokens (logprobs.out and it
    # are views of one buffer: one copy to the host)

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
        impl: str | None = None,  # the sampler's implementation (pagedllm/sample/impl.py; None: the device's)
    ) -> SamplingMetadata:
        device = torch.device(device)
        sampling = temperature >= GREEDY_BELOW
        impl = impl or choose_impl(device)
        if impl == TRITON:
            return cls._upload_for_kernel(
                temperature, top_k, top_p, min_p, seeds, seeded, positions, device, penalties, num_top
            )  # fmt: skip
        if impl == C:
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
    def _upload_for_kernel(
        cls, temperature, top_k, top_p, min_p, seeds, seeded, positions, device, penalties, num_top
    ) -> SamplingMetadata:
        """The GPU kernel's form, built anew (nothing kept on the device from an earlier step: the engine keeps it,
        pagedllm/sample/resident_inputs.py): every row's parameters as they are, the penalized rows' tokens and
        penalties and the rows that want logprobs, in one host-to-device copy (the kernel hashes a seeded row's key
        from its seed and position). A step where every row takes the argmax, with no penalties or logprobs, gets
        none of it: the sampler takes torch's argmax."""
        n = len(temperature)
        sampling = temperature >= GREEDY_BELOW
        wanted = num_top is not None and (num_top >= 0).any()
        if not sampling.any() and penalties is None and not wanted:
            return cls.over_device_inputs(sampling, None, None, device)  # torch's argmax: the kernel's inputs go unread
        if seeded is not None:
            seeded = seeded & sampling  # greedy rows draw nothing
        pen = {}
        if penalties is not None:
            rows = penalties.rows
            pen = {name: np.zeros(n, dtype=dtype) for name, dtype in _PENALTY_FIELDS.items()}
            for name, values in zip(_PENALTY_FIELDS, penalties[2:]):
                pen[name][rows] = values
        params = pack_params(temperature, top_k, top_p, min_p, seeds, seeded, positions, **pen)
        listed = np.flatnonzero(num_top >= 0) if wanted else None
        tokens = penalties.token_ids if penalties is not None else None
        state, step, token_cap = pack_inputs(params, None if penalties is None else penalties.rows, tokens, listed)
        words = to_device(np.concatenate([state, step]), device)
        num_pen = 0 if penalties is None else len(penalties.rows)
        inputs = DeviceInputs(words[: len(state)], words[len(state) :], n, token_cap, num_pen, advance=False)
        return cls.over_device_inputs(sampling, inputs, num_top, device)

    @classmethod
    def over_device_inputs(
        cls,
        sampling: np.ndarray,
        inputs: DeviceInputs | None,
        num_top: np.ndarray | None,
        device,
        outputs: OutputBuffers | None = None,
    ):
        """The GPU kernel's metadata over its inputs (sampling [batch] bool: the rows that draw; num_top [batch]: the
        top logprobs each row wants, -1: none), with the buffer the kernel writes the tokens and logprobs into (from
        outputs where given, else new). inputs None: every row takes torch's argmax."""
        meta = cls._every_row(sampling, None)
        meta.device_inputs = inputs
        if inputs is None:
            return meta
        if inputs.num_pen:
            meta.all_greedy = False  # the kernel applies them
        n, listed = len(sampling), np.flatnonzero(num_top >= 0) if num_top is not None else ()
        k_max = int(num_top[listed].max()) if len(listed) else 0
        shape = (n, len(listed), k_max)
        meta.sampled, lp_out = outputs.take(*shape) if outputs is not None else _output_views(*shape, device)
        if len(listed):
            meta.logprobs = LogprobRequest(lp_out, k_max)
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


def _output_views(n: int, wanted: int, k_max: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the sampling kernel writes a step's tokens [n] int64 and logprobs [wanted, 4 + 2 k_max] int32: views of
    one buffer, so that both come back in one copy."""
    at = -(-2 * n // 4) * 4  # the logprobs start 16-byte aligned (as every buffer the kernel is compiled for)
    words = torch.empty(at + wanted * (4 + 2 * k_max), dtype=torch.int32, device=device)
    return words[: 2 * n].view(torch.int64), words[at:].view(wanted, 4 + 2 * k_max)


class OutputBuffers:
    """The sampling kernel's output buffers kept from step to step, two in turn (_output_views): a step whose shape is
    the last but one's gets its buffer and views again, with no allocation or view made on the host. A buffer is
    written again two steps later, by a kernel queued on the same stream behind every read of it (the copy to the
    host, the next step's inputs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[tuple[tuple, tuple] | None] = [None, None]  # (shape, views)
        self.next = 0

    def take(self, n: int, wanted: int, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        i, self.next = self.next, 1 - self.next
        slot = self.slots[i]
        if slot is None or slot[0] != (n, wanted, k_max):
            slot = self.slots[i] = ((n, wanted, k_max), _output_views(n, wanted, k_max, self.device))
        return slot[1]


_PENALTY_FIELDS = {  # pack_params' penalty fields: Penalties from num_prompt on
    "num_prompt": np.int64,
    "num_tokens": np.int64,
    "repetition": np.float32,
    "presence": np.float32,
    "frequency": np.float32,
}


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


def seeded_key(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The GPU sampling kernel's 63-bit Philox key of a seeded row (kernels/sampling.py's _seeded_key), per (seed,
    position) (int64 arrays). [rows] int64"""
    top = _seeded_bits(seeds, positions, 0x2545F491) & 0x7FFFFFFF
    return (top << 32) | _seeded_bits(seeds, positions, 0x7F4A7C15)


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per (seed, position) (int64 arrays), whatever else is in the batch. [rows] float32"""
    return ((_seeded_bits(seeds, positions, 0x7F4A7C15) >> 8) * (1.0 / (1 << 24))).astype(np.float32)
