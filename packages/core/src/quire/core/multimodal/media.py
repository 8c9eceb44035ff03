"""Loading one image for the front end: inline ``data:`` URLs, ``file://`` URLs under the allowed folder,
http(s) URLs of allowed hosts (``fetch``) and in-memory images, within the byte and pixel limits. Every
refusal is a ``ValidationError`` naming the field the image came from."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path

from PIL import Image

from quire.core.config import MultiModalConfig
from quire.core.errors import ValidationError
from quire.core.multimodal.fetch import ImageFetcher
from quire.core.multimodal.parts import ImageInput

# Only these decoders run: Pillow would otherwise try every plug-in it has (some parse rarely used formats,
# one runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Modes every image processor converts itself; others (CMYK, 16-bit, float…) become RGB here.
_PROCESSOR_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA"}


class MediaLoader:
    """Turns an ``ImageInput`` into a decoded ``PIL.Image.Image``, or refuses it (HTTP 400)."""

    def __init__(self, config: MultiModalConfig):
        self.config = config
        self.fetcher = ImageFetcher(config.allowed_media_domains, config.max_image_bytes, config.media_fetch_timeout)

    def load(self, item: ImageInput) -> Image.Image:
        source, param = item.source, item.param
        if isinstance(source, Image.Image):
            self._check_pixels(source.width, source.height, param)
            return _processor_mode(source, param)
        if not isinstance(source, str):
            raise ValidationError(f"{param} must be an image (PIL.Image) or a URL, got {type(source).__name__}",
                                  param=param)
        scheme = source.partition(":")[0].lower() if ":" in source else ""
        if scheme == "data":
            data = self._data_url(source, param)
        elif scheme == "file":
            data = self._local_file(source, param)
        elif scheme in ("http", "https"):
            data = self.fetcher.fetch(source, param)
        else:
            raise ValidationError(f"{param} must be a data: URL (base64), an http(s) URL or a file:// URL",
                                  param=param)
        return self._decode(data, param)

    def _data_url(self, url: str, param: str) -> bytes:
        header, comma, payload = url[len("data:"):].partition(",")
        media_type, *options = header.split(";")
        if not comma or "base64" not in options:
            raise ValidationError(f"{param} must be a data URL of the form data:image/png;base64,<data>", param=param)
        if media_type and not media_type.lower().startswith("image/"):
            raise ValidationError(f"{param} has media type {media_type!r}; only images are supported", param=param)
        payload = "".join(payload.split())
        if len(payload) // 4 * 3 > self.config.max_image_bytes + 2:
            raise self._too_large(param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError(f"{param} is not valid base64", param=param) from None
        if len(data) > self.config.max_image_bytes:
            raise self._too_large(param)
        return data

    def _local_file(self, url: str, param: str) -> bytes:
        folder = self.config.allowed_local_media_path
        if folder is None:
            raise ValidationError(f"{param}: this server reads no local files (it was started without "
                                  "--allowed-local-media-path)", param=param)
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValidationError(f"{param} must be a file:///absolute/path URL", param=param)
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(folder):
            raise ValidationError(f"{param} names a file outside the allowed local media folder", param=param)
        if not path.is_file():
            raise ValidationError(f"{param} names no file in the allowed local media folder", param=param)
        if path.stat().st_size > self.config.max_image_bytes:
            raise self._too_large(param)
        with path.open("rb") as file:
            data = file.read(self.config.max_image_bytes + 1)
        if len(data) > self.config.max_image_bytes:
            raise self._too_large(param)
        return data

    def _decode(self, data: bytes, param: str) -> Image.Image:
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Exception:  # noqa: BLE001 - whatever the decoders raise, the bytes are not an image we read
            raise ValidationError(f"{param} is not an image in a supported format "
                                  f"({', '.join(IMAGE_FORMATS)})", param=param) from None
        self._check_pixels(image.width, image.height, param)  # from the header, before decoding the pixels
        try:
            image.load()
        except Exception:  # noqa: BLE001 - a truncated or corrupt file
            raise ValidationError(f"{param} could not be decoded (a truncated or corrupt "
                                  f"{image.format} file)", param=param) from None
        return _processor_mode(image, param)

    def _check_pixels(self, width: int, height: int, param: str) -> None:
        if width < 1 or height < 1:
            raise ValidationError(f"{param} is an empty image ({width}x{height})", param=param)
        if width * height > self.config.max_image_pixels:
            raise ValidationError(f"{param} is {width}x{height} = {width * height} pixels; the limit is "
                                  f"{self.config.max_image_pixels}", param=param)

    def _too_large(self, param: str) -> ValidationError:
        return ValidationError(f"{param} is larger than {self.config.max_image_bytes} bytes", param=param)


def _processor_mode(image: Image.Image, param: str) -> Image.Image:
    if image.mode in _PROCESSOR_MODES:
        return image
    try:
        return image.convert("RGB")
    except (ValueError, OSError):
        raise ValidationError(f"{param} has pixel mode {image.mode}, which cannot be read as RGB",
                              param=param) from None
