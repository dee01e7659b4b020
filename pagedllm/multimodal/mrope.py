"""M-RoPE positions (Qwen2-VL): a [3, n] (temporal, height, width) position for each token a step computes.

Text tokens carry one position on all three axes, counting up by one. An item whose LM tokens form a (t, h, w)
grid starts at the position `s` where it stands and gives token (i, j, k) the positions
(s + floor(i * time_interval), s + j, s + k); the text after it continues at s + max(h, w). So every token after
an item is shifted by max(h, w) - t * h * w from its plain position, generated tokens included."""

from __future__ import annotations

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature


def mrope_positions(positions: np.ndarray, features: list[MultiModalFeature]) -> np.ndarray:
    """positions [n] (token indices in the request) -> M-RoPE positions [3, n] (int64)."""
    out = np.repeat(positions[None].astype(np.int64), 3, axis=0)  # [3, n]
    shift = 0  # the shift of text at the current point: sum over items before it
    for f in sorted(features, key=lambda f: f.offset):
        t, h, w = f.grid
        start = f.offset + shift  # the item's first M-RoPE position
        inside = (positions >= f.offset) & (positions < f.end)
        if inside.any():
            idx = positions[inside] - f.offset
            out[0, inside] = start + np.floor(idx // (h * w) * f.time_interval).astype(np.int64)
            out[1, inside] = start + idx // w % h
            out[2, inside] = start + idx % w
        shift += max(h, w) - f.length
        out[:, positions >= f.end] += max(h, w) - f.length
    return out
