"""Images and videos from chat content parts: `image_url` / `video_url` with a data: URL (base64), an http(s) URL
(fetched within a time and size limit) or a file:// path under the allowed local media directory. A corrupt, huge,
unreachable or disallowed item is a ValueError naming the part. Videos are decoded with PyAV (the vision extra)."""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any
from urllib.parse import unquote, urlparse

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # width * height above this is refused before decoding
MAX_IMAGE_BYTES = 64 * 1024 * 1024  # (videos too)
MAX_VIDEO_FRAMES = 32  # a longer video is sampled evenly down to this many frames


WHITE = (255, 255, 255)


def decode_image(data: bytes, where: str, background: tuple[int, int, int] = WHITE) -> Any:
    """Encoded image bytes -> an RGB PIL image, fully decoded; transparent pixels are laid over `background`
    (media_io_kwargs' rgba_background_color, white by default, as vLLM)."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"{where}: images need Pillow (pip install 'pagedllm[vision]')") from None

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image has {len(data)} bytes, more than the allowed {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{where}: the image is {width}x{height} pixels, more than the allowed {MAX_IMAGE_PIXELS}")
        image.load()
    except ValueError:
        raise
    except Exception as e:  # PIL's errors for corrupt or truncated data
        raise ValueError(f"{where}: the image cannot be decoded: {e}") from None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, background)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def load_image_url(url: Any, where: str, allowed_local_media_path: str = "", background=WHITE) -> Any:
    return decode_image(_url_bytes(url, where, allowed_local_media_path, "image"), where, background)


def load_video_url(url: Any, where: str, allowed_local_media_path: str = "") -> Any:
    return decode_video(_url_bytes(url, where, allowed_local_media_path, "video"), where)


def decode_video(data: bytes, where: str, max_frames: int = MAX_VIDEO_FRAMES) -> Any:
    """Encoded video bytes -> RGB frames [T, H, W, 3] uint8: every frame, or max_frames spread evenly over them."""
    import numpy as np

    try:
        import av
    except ImportError:
        raise ValueError(f"{where}: videos need PyAV (pip install 'pagedllm[vision]')") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the video has {len(data)} bytes, more than the allowed {MAX_IMAGE_BYTES}")
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            if stream.width * stream.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: the video is {stream.width}x{stream.height} pixels, too large")
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    except av.error.FFmpegError as e:  # corrupt or truncated data (some of these are ValueErrors too)
        raise ValueError(f"{where}: the video cannot be decoded: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # no video stream, other decoder failures
        raise ValueError(f"{where}: the video cannot be decoded: {e}") from None
    if not frames:
        raise ValueError(f"{where}: the video has no frames")
    if len(frames) > max_frames:
        frames = [frames[i] for i in np.linspace(0, len(frames) - 1, max_frames).round().astype(int)]
    return np.stack(frames)


def _url_bytes(url: Any, where: str, allowed_local_media_path: str, kind: str) -> bytes:
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: 'url' must be a non-empty string")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64") or not header[5:].startswith(f"{kind}/"):
            raise ValueError(f"{where}: a data URL must be 'data:{kind}/<type>;base64,<data>'")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"{where}: the data URL's base64 is invalid: {e}") from None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _read_local(unquote(parsed.path), where, allowed_local_media_path)
    if parsed.scheme in ("http", "https"):
        return _fetch(url, where)
    raise ValueError(
        f"{where}: URL scheme {parsed.scheme!r} is not supported: use http(s)://, a data: URL or file:// (under "
        "--allowed-local-media-path)"
    )


def _fetch(url: str, where: str) -> bytes:
    """The URL's bytes, within VLLM_IMAGE_FETCH_TIMEOUT seconds (default 5) and MAX_IMAGE_BYTES."""
    import urllib.error
    import urllib.request

    raw = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5")
    try:
        timeout = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_IMAGE_FETCH_TIMEOUT={raw!r} must be a number of seconds") from None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"{where}: the image could not be fetched from {url!r}: {e}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image at {url!r} is larger than the allowed {MAX_IMAGE_BYTES} bytes")
    return data


def _read_local(path: str, where: str, allowed: str) -> bytes:
    if not allowed:
        raise ValueError(f"{where}: file:// URLs need an allowed local media directory (allowed_local_media_path)")
    real = os.path.realpath(path)
    if os.path.commonpath([real, allowed]) != allowed:
        raise ValueError(f"{where}: {path!r} is outside the allowed local media directory {allowed!r}")
    if not os.path.isfile(real):
        raise ValueError(f"{where}: {path!r} is not a file")
    with open(real, "rb") as f:
        return f.read(MAX_IMAGE_BYTES + 1)


class MediaPart:
    """Where a chat image or video part stands: `type` for templates that loop over parts, `text` (the model's
    placeholder) for string content."""

    def __init__(self, type: str, text: str) -> None:
        self.type = type
        self.text = text


class ChatMedia:
    """A conversation's images and videos, decoded in order as the chat renderer meets them; each part renders as
    the model's placeholder (string content) or an {"type": "image"} / {"type": "video"} part."""

    def __init__(
        self, placeholder: str, allowed_local_media_path: str = "", video_placeholder: str = "", background=WHITE
    ) -> None:
        self.placeholder = placeholder
        self.background = background  # under the transparent pixels of RGBA images
        self.video_placeholder = video_placeholder  # "": the model takes no videos
        self.allowed_local_media_path = allowed_local_media_path
        self.images: list = []
        self.videos: list = []

    def add(self, kind: str, part: dict, where: str) -> MediaPart:
        if kind == "image_url":
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            local = self.allowed_local_media_path
            self.images.append(load_image_url(url, f"{where}.image_url", local, self.background))
        elif kind == "image_embeds" and isinstance(part.get(kind), str | dict):
            if isinstance(part[kind], str) or any(isinstance(v, str) for v in part[kind].values()):
                raise ValueError(f"{where}: base64-encoded image embeddings are not supported; pass tensors")
            self.images.append(part[kind])  # Qwen2-VL's {image_embeds, image_grid_thw}
        elif kind in ("image_pil", "image_embeds") and part.get(kind) is not None:
            self.images.append(part[kind])  # embeddings: the processor checks them (enable_mm_embeds)
        elif kind == "video_url" and self.video_placeholder:
            value = part.get("video_url")
            url = value.get("url") if isinstance(value, dict) else value
            self.videos.append(load_video_url(url, f"{where}.video_url", self.allowed_local_media_path))
            return MediaPart("video", self.video_placeholder)
        else:
            takes = "'image_url' and 'video_url'" if self.video_placeholder else "'image_url'"
            raise ValueError(f"{where}: a {kind!r} part is not supported; media come as {takes} parts")
        return MediaPart("image", self.placeholder)

    def mm_data(self) -> dict:
        """The conversation's items as multi_modal_data ({} for none)."""
        return {k: v for k, v in (("image", self.images), ("video", self.videos)) if v}
