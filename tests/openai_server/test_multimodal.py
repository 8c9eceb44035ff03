"""Image requests against the real server on the tiny LLaVA checkpoint (the session's ``llava_server``):
malformed ones are 400s naming the field, decided before any engine work (the engine's step counter does
not move), and image URLs are fetched only from allowed hosts (a local server records what it receives)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest

from quire.core.testing.multimodal_checkpoints import sample_image as make_image
from tests.media_server import RecordingServer, png_bytes

CHAT = "/v1/chat/completions"
NUM_IMAGE_TOKENS = 16
URL_PARAM = "messages[0].content[0].image_url.url"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in it?"}]}]


def encoded(image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# a valid PNG header announcing 9000 x 9000 pixels (more than the default 8192 x 8192), and a few bytes of data
PIXEL_BOMB = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0))
              + png_chunk(b"IDAT", zlib.compress(b"\0" * 100)))
OVER_ONE_MIB = encoded(make_image(700, 700, seed=1), "PNG")  # noise compresses badly: about 1.4 MB
SMALL = data_url(png_bytes())


@pytest.fixture(scope="module")
def media_server():
    server = RecordingServer()
    yield server
    server.close()


def cases(server, media_server):
    """(messages or extra body fields, param, words of the message)."""
    folder = server.media_folder
    return [
        (user(image_part("data:image/png;base64,iVBORw0KGgo@@@")), URL_PARAM, "base64"),
        (user(image_part(data_url(encoded(make_image(8, 8), "TIFF"), "image/tiff"))), URL_PARAM, "supported format"),
        (user(image_part(data_url(b"just some text"))), URL_PARAM, "supported format"),
        (user(image_part(data_url(png_bytes(), "text/plain"))), URL_PARAM, "media type"),
        (user(image_part("data:image/png," + "abc")), URL_PARAM, "base64"),
        (user(image_part(data_url(png_bytes()[:70]))), URL_PARAM, "corrupt"),
        (user(image_part(data_url(OVER_ONE_MIB))), URL_PARAM, "larger than 1048576 bytes"),
        (user(image_part(data_url(PIXEL_BOMB))), URL_PARAM, "81000000 pixels"),
        (user(image_part(media_server.url("/image.png", "127.0.0.1"))), URL_PARAM, "allowed media domains"),
        (user(image_part(media_server.url("/missing", "localhost"))), URL_PARAM, "HTTP 404"),
        (user(image_part(media_server.url("/big", "localhost"))), URL_PARAM, "larger than"),
        (user(image_part(media_server.url("/endless", "localhost"))), URL_PARAM, "larger than"),
        (user(image_part("ftp://localhost/cat.png")), URL_PARAM, "http(s)"),
        (user(image_part(f"file://{folder}/../secret.png")), URL_PARAM, "outside"),
        (user(image_part(f"file://{folder}/absent.png")), URL_PARAM, "no file"),
        (user({"type": "image_url", "image_url": {}}), URL_PARAM, "non-empty"),
        (user({"type": "image_url", "image_url": {"url": 5}}), URL_PARAM, "non-empty"),
        (user(*[image_part(SMALL)] * 5), "messages", "At most 4 image(s)"),
        (user(image_part(SMALL), {"type": "video_url", "video_url": {"url": SMALL}}), "messages[0].content[1]",
         "text or image"),
        ([{"role": "user", "content": [image_part(SMALL), {"type": "text", "text": "and <image>?"}]}], "messages",
         "2 <image> placeholder(s) for 1 image"),
        ([{"role": "user", "content": "a hand-typed <image> without an image"}], "messages", "no image"),
        ({"messages": user(image_part(SMALL)), "truncate_prompt_tokens": 8}, "truncate_prompt_tokens",
         "placeholder"),
    ]


def engine_activity(server) -> tuple:
    """Engine steps run so far, and the requests the front end tracks: a request reaching the engine moves
    the first, an accepted one the second."""
    state = httpx.get(server.url("/debug/state"), timeout=30).json()
    return state["engine"]["num_steps"], state["front_end"]["tracked_requests"]


def test_malformed_image_requests_are_400s_naming_the_field_before_any_engine_work(llava_server, media_server):
    table = cases(llava_server, media_server)
    assert len(table) >= 12
    before = engine_activity(llava_server)
    for messages_or_body, param, words in table:
        body = messages_or_body if isinstance(messages_or_body, dict) else {"messages": messages_or_body}
        response = httpx.post(llava_server.url(CHAT), json={"max_tokens": 4, **body}, timeout=60)
        assert response.status_code == 400, (param, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (words, error)
        assert words.lower() in error["message"].lower(), error
        assert str(llava_server.media_folder) not in error["message"]
    assert engine_activity(llava_server) == before, "a refused request reached the engine"
    assert httpx.get(llava_server.url("/health"), timeout=10).status_code == 200


def test_image_urls_are_fetched_from_allowed_hosts_only(llava_server, media_server):
    before = len(media_server.requests)
    refused = httpx.post(llava_server.url("/tokenize"), timeout=60,
                         json={"messages": user(image_part(media_server.url("/image.png", "127.0.0.1")))})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == URL_PARAM
    assert media_server.requests[before:] == []  # 127.0.0.1 is not allowed: nothing was requested
    fetched = httpx.post(llava_server.url("/tokenize"), timeout=60,
                         json={"messages": user(image_part(media_server.url("/image.png", "localhost")))})
    assert fetched.status_code == 200, fetched.text
    assert media_server.requests[before:] == ["/image.png"]
    inline = httpx.post(llava_server.url("/tokenize"), json={"messages": user(image_part(SMALL))}, timeout=60)
    assert fetched.json()["tokens"] == inline.json()["tokens"]  # the same image, however it arrived


def test_a_redirect_to_a_host_that_is_not_allowed_is_not_followed(llava_server, media_server):
    before = len(media_server.requests)
    away = media_server.url("/redirect?to=" + media_server.url("/image.png", "127.0.0.1"), "localhost")
    response = httpx.post(llava_server.url(CHAT), json={"messages": user(image_part(away)), "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 400 and "not among" in response.json()["error"]["message"]
    assert media_server.requests[before:] == ["/redirect?to=" + media_server.url("/image.png")]


def test_images_expand_into_placeholder_tokens(llava_server, llava_checkpoint):
    from transformers import AutoTokenizer

    image_token_id = AutoTokenizer.from_pretrained(llava_checkpoint).convert_tokens_to_ids("<image>")
    two_images = [image_part(SMALL), image_part(f"file://{llava_server.media_folder}/cat.png")]
    with_images = httpx.post(llava_server.url("/tokenize"), json={"messages": user(*two_images)}, timeout=60)
    assert with_images.status_code == 200, with_images.text
    assert with_images.json()["tokens"].count(image_token_id) == 2 * NUM_IMAGE_TOKENS


def test_a_text_only_model_refuses_images(demo_server):
    response = httpx.post(demo_server.url(CHAT), json={"messages": user(image_part(SMALL)), "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0]" and "text only" in error["message"]


def test_the_readme_request_with_the_openai_sdk_reaches_the_engine(llava_server):
    from openai import OpenAI

    client = OpenAI(base_url=llava_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    before = engine_activity(llava_server)
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                           messages=user(image_part(SMALL)))
    assert reply.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(llava_server.url("/tokenize"), json={"messages": user(image_part(SMALL))}, timeout=60)
    assert reply.usage.prompt_tokens == rendered.json()["count"]  # the image's placeholder tokens included
    assert engine_activity(llava_server)[0] > before[0]
