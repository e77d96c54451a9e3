"""Images from bytes to the pixel tensor the vision tower takes, as the checkpoint's
`preprocessor_config.json` says: the steps of Hugging Face's CLIP image processor (convert to RGB,
resize the shortest edge with Pillow, centre crop, rescale, normalize), in that order.

Decoding checks the byte and pixel limits before Pillow decodes any pixel data, so a small file that
claims a huge canvas (a decompression bomb) costs only its header.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from engine.errors import InvalidRequestError, ModelLoadError

# OpenAI CLIP's statistics: transformers' defaults for a CLIP processor config that omits them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one image, so one request cannot make a worker decode something huge."""

    max_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 4096 * 4096


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image: what the engine's requests carry."""

    pixel_values: torch.Tensor  # [channels, height, width], float32, normalized
    # xxh3-128 of the normalized pixels: it enters the prefix-cache hash of every block the image's
    # positions touch, so two prompts that differ only in the image never share KV.
    content_hash: bytes


@dataclass(frozen=True)
class ImageProcessor:
    shortest_edge: int | None  # resize so the shorter side has this length, or else to (height, width)
    size: tuple[int, int] | None
    resample: int  # a PIL.Image.Resampling value
    crop: tuple[int, int] | None  # (height, width) of the centre crop; None: no crop
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    convert_rgb: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessor:
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if raw.get("do_resize", True) and "shortest_edge" not in size and not {"height", "width"} <= set(size):
            raise ModelLoadError(f"unsupported image size {size!r}: need shortest_edge, or height and width")
        return cls(
            shortest_edge=int(size["shortest_edge"]) if raw.get("do_resize", True) and "shortest_edge" in size else None,
            size=(int(size["height"]), int(size["width"]))
            if raw.get("do_resize", True) and "shortest_edge" not in size else None,
            resample=int(raw.get("resample", 3)),
            crop=(int(crop["height"]), int(crop["width"])) if raw.get("do_center_crop", True) else None,
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
            mean=tuple(raw.get("image_mean", CLIP_MEAN)) if raw.get("do_normalize", True) else None,
            std=tuple(raw.get("image_std", CLIP_STD)) if raw.get("do_normalize", True) else None,
            convert_rgb=bool(raw.get("do_convert_rgb", True)),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ImageProcessor:
        path = Path(folder) / PREPROCESSOR_FILE
        if not path.is_file():
            raise ModelLoadError(f"{folder} holds a vision model but no {PREPROCESSOR_FILE}")
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, when the config fixes it."""
        return self.crop or self.size

    def load(self, data: bytes, limits: ImageLimits = ImageLimits(), name: str = "image") -> ImageInput:
        """Decode and preprocess one image; InvalidRequestError, naming `name`, if it is unusable."""
        return self.process(decode_image(data, limits, name))

    def process(self, image) -> ImageInput:
        """A decoded PIL image to an ImageInput."""
        from PIL import Image

        if self.convert_rgb and image.mode != "RGB":
            image = _to_rgb(image)
        if self.shortest_edge is not None:
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
            image = image.resize((new_w, new_h), resample=Image.Resampling(self.resample))
        elif self.size is not None:
            image = image.resize((self.size[1], self.size[0]), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        array = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            array = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None:
            mean = np.asarray(self.mean, dtype=np.float32)
            std = np.asarray(self.std, dtype=np.float32)
            array = ((array - mean) / std).astype(np.float32)
        chw = np.ascontiguousarray(array.transpose(2, 0, 1))
        return ImageInput(torch.from_numpy(chw), xxhash.xxh3_128(chw.tobytes()).digest())


def decode_image(data: bytes, limits: ImageLimits, name: str = "image"):
    """Bytes to a loaded PIL image, within `limits`."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequestError(f"{name} is empty")
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"{name} has {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if w * h > limits.max_pixels:
                raise InvalidRequestError(f"{name} is {w}x{h} = {w * h} pixels; the limit is {limits.max_pixels}")
            image.load()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise InvalidRequestError(f"{name} is not a readable image: {exc}") from exc
    if w < 1 or h < 1:
        raise InvalidRequestError(f"{name} has no pixels")
    return image


def _to_rgb(image):
    """As transformers does: transparent pixels are laid over white, not black."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre crop of an HWC array; an image smaller than the crop is padded with zeros around it."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        top_pad, left_pad = max(0, (height - h) // 2), max(0, (width - w) // 2)
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        padded[top_pad:top_pad + h, left_pad:left_pad + w] = pixels
        pixels, h, w = padded, *padded.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]
