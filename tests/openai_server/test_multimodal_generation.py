"""Images through ``/v1/chat/completions`` with the ``openai`` SDK, streaming and not, give the same output as
``LLM.chat`` on the same messages (the session's ``llava_server``, float32, greedy)."""

from __future__ import annotations

import base64
import io

import pytest

from quire.core.testing.multimodal_checkpoints import sample_image

MAX_TOKENS = 12


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


MESSAGES = [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(sample_image(40, 28, 1))}},
                                  {"type": "text", "text": "def describe(self):"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "class Point:"},
                                  {"type": "image_url", "image_url": {"url": data_url(sample_image(64, 48, 2))}},
                                  {"type": "image_url", "image_url": {"url": data_url(sample_image(20, 30, 3))}},
                                  {"type": "text", "text": " return"}]}],
]


@pytest.fixture(scope="module")
def offline_outputs(llava_checkpoint):
    from quire.offline import LLM, SamplingParams

    llm = LLM(str(llava_checkpoint), dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [llm.chat(messages, params, use_tqdm=False)[0].outputs[0] for messages in MESSAGES]
    llm.shutdown()
    return [(o.text, len(o.token_ids)) for o in outputs]


@pytest.fixture(scope="module")
def client(llava_server):
    from openai import OpenAI

    return OpenAI(base_url=llava_server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("index", range(len(MESSAGES)))
def test_chat_completions_equal_llm_chat(client, offline_outputs, index):
    response = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES[index],
                                              temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    text, num_tokens = offline_outputs[index]
    assert response.choices[0].message.content == text
    assert response.usage.completion_tokens == num_tokens == MAX_TOKENS
    assert response.usage.prompt_tokens > 16 * (index + 1)  # the image placeholders were expanded


@pytest.mark.parametrize("index", range(len(MESSAGES)))
def test_streamed_chat_completions_equal_llm_chat(client, offline_outputs, index):
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES[index],
                                            temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"ignore_eos": True})
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == offline_outputs[index][0]
