"""LoRA through the server with the ``openai`` SDK: ``model=<adapter>`` (streaming or not), ``/v1/models``,
unknown adapters, and loading/unloading at run time behind its flag and the API key."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from quire.offline import LLM, LoRARequest, SamplingParams
from tests.servers import ServerProcess

PROMPT = "def parse_args(argv):\n    parser = "
NUM_TOKENS = 12
KEY = "lora-test-key"


@pytest.fixture(scope="module")
def base_path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def offline_texts(base_path, lora_adapters):
    """Greedy texts of the base model and of each adapter, from the offline engine."""
    llm = LLM(base_path, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8, multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    try:
        texts = {name: llm.generate([PROMPT], params, use_tqdm=False,
                                    lora_request=None if name == "base" else
                                    LoRARequest(name, i + 1, str(lora_adapters(name))))[0].outputs[0].text
                 for i, name in enumerate(["base", "qv", "qv2"])}
    finally:
        llm.shutdown()
    assert len(set(texts.values())) == 3
    return texts


@pytest.fixture(scope="module")
def lora_server(base_path, lora_adapters):
    server = ServerProcess("--model", base_path, "--served-model-name", "tiny", "--dtype", "float32",
                           "--max-model-len", "128", "--enable-lora", "--max-lora-rank", "8",
                           "--lora-modules", f"qv={lora_adapters('qv')}", f"qv2={lora_adapters('qv2')}")
    yield server
    server.stop()


def client_of(server, key="unused") -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0, timeout=60)


def complete(client, model, stream=False) -> str:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                   if chunk.choices)


def test_a_request_names_its_adapter_in_model(lora_server, offline_texts):
    client = client_of(lora_server)
    for model, expected in (("tiny", offline_texts["base"]), ("qv", offline_texts["qv"]),
                            ("qv2", offline_texts["qv2"])):
        assert complete(client, model) == expected
        assert complete(client, model, stream=True) == expected
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None


def test_models_lists_the_adapters_with_their_base(lora_server, lora_adapters):
    cards = {card.id: card for card in client_of(lora_server).models.list().data}
    assert set(cards) == {"tiny", "qv", "qv2"}
    assert cards["qv"].parent == "tiny" and cards["qv"].root == str(lora_adapters("qv"))
    assert cards["tiny"].parent is None


def test_an_unknown_adapter_is_a_404(lora_server):
    with pytest.raises(openai.NotFoundError, match="qv3"):
        complete(client_of(lora_server), "qv3")


def test_runtime_updates_are_off_without_their_flag(lora_server, lora_adapters):
    response = httpx.post(lora_server.url("/v1/load_lora_adapter"),
                          json={"lora_name": "x", "lora_path": str(lora_adapters("qv"))}, timeout=30)
    assert response.status_code == 404


def test_adapters_load_and_unload_at_run_time_with_the_key(base_path, lora_adapters, offline_texts):
    server = ServerProcess("--model", base_path, "--served-model-name", "tiny", "--dtype", "float32",
                           "--max-model-len", "128", "--enable-lora", "--max-lora-rank", "8",
                           "--enable-lora-runtime-updates", "--api-key", KEY)
    try:
        load = {"lora_name": "late", "lora_path": str(lora_adapters("qv2"))}
        assert httpx.post(server.url("/v1/load_lora_adapter"), json=load, timeout=30).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        response = httpx.post(server.url("/v1/load_lora_adapter"), json=load, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        client = client_of(server, KEY)
        assert complete(client, "late") == offline_texts["qv2"]
        again = httpx.post(server.url("/v1/load_lora_adapter"), json=load, headers=headers, timeout=30)
        assert again.status_code == 400 and "already in use" in again.text
        bad = httpx.post(server.url("/v1/load_lora_adapter"), headers=headers, timeout=30,
                         json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        unload = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "late"}, headers=headers,
                            timeout=30)
        assert unload.status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete(client, "late")
        missing = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "late"}, headers=headers,
                             timeout=30)
        assert missing.status_code == 404
    finally:
        server.stop()


def test_metrics_name_the_running_adapters(lora_server):
    client = client_of(lora_server)
    stream = client.completions.create(model="qv2", prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the request runs now
        metrics_text = httpx.get(lora_server.url("/metrics"), timeout=30).text
    finally:
        stream.close()
    lines = [line for line in metrics_text.splitlines() if line.startswith("quire:lora_requests_info{")]
    assert lines and 'max_lora="1"' in lines[0] and 'running_lora_adapters="qv2"' in lines[0], lines
