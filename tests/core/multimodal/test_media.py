"""Loading images in the front end: data URLs, local files, downloads from allowed hosts only (a local server
records every request it receives), and the byte and pixel limits. Every refusal names the field."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import pytest
from PIL import Image

from quire.core.config import MultiModalConfig
from quire.core.errors import ValidationError
from quire.core.multimodal.media import MediaLoader
from quire.core.multimodal.parts import ImageInput
from quire.core.testing.multimodal_checkpoints import sample_image as make_image
from tests.media_server import RecordingServer, png_bytes

PARAM = "messages[0].content[1].image_url.url"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def load(source, **config):
    return MediaLoader(MultiModalConfig(**config)).load(ImageInput(source, PARAM))


def refused(source, words: str, **config) -> ValidationError:
    with pytest.raises(ValidationError) as error:
        load(source, **config)
    assert error.value.param == PARAM, error.value.param
    assert words.lower() in error.value.message.lower(), error.value.message
    return error.value


@pytest.fixture(scope="module")
def media_server():
    server = RecordingServer(slow_seconds=3.0)
    yield server
    server.close()


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_data_urls_of_each_supported_format_decode(image_format):
    original = make_image(20, 12, seed=3)
    image = load(data_url(encoded(original, image_format), f"image/{image_format.lower()}"))
    assert image.size == (20, 12) and image.format == image_format
    if image_format in ("PNG", "BMP"):  # lossless
        assert image.tobytes() == original.tobytes()


def test_in_memory_images_pass_through_and_odd_modes_become_rgb():
    original = make_image(10, 10)
    assert load(original) is original
    assert load(original.convert("RGBA")).mode == "RGBA"  # the processor composites alpha itself
    assert load(original.convert("CMYK")).mode == "RGB"


def test_base64_wrapped_over_lines_is_read():
    text = base64.b64encode(png_bytes()).decode()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert load(f"data:image/png;base64,{wrapped}").size == (20, 12)


@pytest.mark.parametrize("source,words", [
    ("data:image/png;base64,iVBORw0KGgo!!!not-base64", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, not an image").decode(), "supported format"),
    (data_url(encoded(make_image(8, 8), "TIFF"), "image/tiff"), "supported format"),
    (data_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), "supported format"),
    (data_url(png_bytes()[:60]), "corrupt"),
    (data_url(png_bytes(), "text/plain"), "media type"),
    ("data:image/png," + "abc", "data:image/png;base64"),
    ("ftp://example.com/cat.png", "data: url"),
    ("cat.png", "data: url"),
    (12345, "must be an image"),
])
def test_bad_images_are_refused_naming_the_field(source, words):
    refused(source, words)


def test_byte_and_pixel_limits():
    png = png_bytes(20, 12)
    assert load(data_url(png), max_image_bytes=len(png)).size == (20, 12)
    refused(data_url(png), "larger than", max_image_bytes=len(png) - 1)
    refused(data_url(png * 50), "larger than", max_image_bytes=len(png))  # refused before decoding the base64
    assert load(data_url(png), max_image_pixels=240).size == (20, 12)
    refused(data_url(png), "240 pixels", max_image_pixels=239)
    refused(make_image(20, 12), "240 pixels", max_image_pixels=239)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_the_pixel_limit_is_checked_before_the_pixels_are_decoded():
    # a valid PNG header announcing 3000 x 3000 pixels, then a few bytes of pixel data
    header = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 3000, 3000, 8, 2, 0, 0, 0))
    bomb = header + png_chunk(b"IDAT", zlib.compress(b"\0" * 100))
    refused(data_url(bomb), "9000000 pixels", max_image_pixels=3000 * 3000 - 1)
    refused(data_url(bomb), "corrupt")  # what decoding it says, under the default limit


def test_local_files_only_under_the_allowed_folder(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    inside = f"file://{allowed / 'cat.png'}"
    refused(inside, "--allowed-local-media-path")  # the default: no local files at all
    folder = str(allowed.resolve())
    assert load(inside, allowed_local_media_path=folder).size == (20, 12)
    refused(f"file://{allowed}/../secret.png", "outside", allowed_local_media_path=folder)
    refused(f"file://{allowed / 'escape.png'}", "outside", allowed_local_media_path=folder)
    refused(f"file://{allowed / 'absent.png'}", "no file", allowed_local_media_path=folder)
    refused(inside, "larger than", allowed_local_media_path=folder, max_image_bytes=100)


def test_by_default_no_url_is_requested(media_server):
    before = len(media_server.requests)
    for host in ("127.0.0.1", "localhost"):
        refused(media_server.url("/image.png", host), "--allowed-media-domains")
    refused(media_server.url("/image.png"), "not among", allowed_media_domains=("localhost",))
    assert len(media_server.requests) == before


def test_an_allowed_host_is_fetched_within_the_limits(media_server):
    allowed = {"allowed_media_domains": ("localhost",)}
    before = len(media_server.requests)
    image = load(media_server.url("/image.png", "localhost"), **allowed)
    assert image.size == (20, 12) and image.tobytes() == make_image(20, 12).tobytes()
    assert media_server.requests[before:] == ["/image.png"]
    refused(media_server.url("/missing", "localhost"), "HTTP 404", **allowed)
    refused(media_server.url("/big", "localhost"), "larger than", **allowed, max_image_bytes=2**20)
    refused(media_server.url("/endless", "localhost"), "larger than", **allowed, max_image_bytes=2**20)
    assert media_server.requests[before:] == ["/image.png", "/missing", "/big", "/endless"]


def test_redirects_are_followed_only_to_allowed_hosts(media_server):
    allowed = {"allowed_media_domains": ("localhost",)}
    before = len(media_server.requests)
    home = media_server.url("/redirect?to=/image.png", "localhost")
    assert load(home, **allowed).size == (20, 12)
    away = media_server.url("/redirect?to=" + media_server.url("/image.png", "127.0.0.1"), "localhost")
    refused(away, "not among", **allowed)
    assert media_server.requests[before:] == ["/redirect?to=/image.png", "/image.png",
                                              "/redirect?to=" + media_server.url("/image.png")]


def test_a_slow_download_is_given_up_at_the_time_limit(media_server):
    started = time.monotonic()
    refused(media_server.url("/slow", "localhost"), "longer than 0.5 s", allowed_media_domains=("localhost",),
            media_fetch_timeout=0.5)
    assert time.monotonic() - started < 2.5
