"""The official openai client against the real server (quire-demo, float32)."""

import itertools

import httpx
import pytest

from quire.offline import LLM, SamplingParams

PROMPTS = ["The json module", "Return the", "This function returns a new"]


def chat(client, content, **kwargs):
    return client.chat.completions.create(model="quire-demo", messages=[{"role": "user", "content": content}],
                                          **kwargs)


def test_models_list_and_retrieve(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["quire-demo"]
    assert openai_client.models.retrieve("quire-demo").id == "quire-demo"
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_greedy_over_http_equals_offline_generation(openai_client):
    llm = LLM(dtype="float32", multiprocess=False)
    params = SamplingParams(temperature=0, max_tokens=20)
    for prompt in PROMPTS:
        expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = openai_client.completions.create(model="quire-demo", prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == expected.text
        assert got.choices[0].finish_reason == expected.finish_reason
    llm.shutdown()


def test_completion_shape_and_usage(openai_client):
    out = openai_client.completions.create(model="quire-demo", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.created > 0
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_completion_equals_the_non_streamed_text(openai_client):
    kwargs = dict(model="quire-demo", prompt=PROMPTS[1], max_tokens=24, temperature=0)
    response = openai_client.completions.create(**kwargs)
    full = response.choices[0]
    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_stream_interval_sends_fewer_larger_chunks_with_the_same_text(openai_client):
    # Chunk sizes are read from each chunk's logprobs (one entry per token). A consumer that falls a step
    # behind gets the outputs it missed merged into one chunk (by design), so the test checks where chunks
    # may end, not how many arrive: with an interval of 8 only after tokens 1, 9, 17 and 25.
    kwargs = dict(model="quire-demo", prompt=PROMPTS[2], max_tokens=25, temperature=0, stream=True, logprobs=0,
                  extra_body={"ignore_eos": True})

    def chunks(**extra_body):
        received = list(openai_client.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                                                      **extra_body}}))
        texts = [c.choices[0].text for c in received]
        ends = list(itertools.accumulate(len(c.choices[0].logprobs.tokens) for c in received))
        return texts, ends

    every, every_ends = chunks()
    grouped, grouped_ends = chunks(stream_interval=8)
    assert "".join(grouped) == "".join(every)
    assert every_ends[-1] == grouped_ends[-1] == 25
    assert set(grouped_ends) <= {1, 9, 17, 25}  # the first token at once, then every 8
    assert len(every) > len(grouped)
    with pytest.raises(Exception, match="stream_interval"):
        openai_client.completions.create(**{**kwargs, "extra_body": {"stream_interval": 0}})


def test_chat_streaming_first_chunk_has_the_role(openai_client):
    full = chat(openai_client, "What does `os.getcwd` do?", max_tokens=40, temperature=0)
    assert full.id.startswith("chatcmpl-") and full.choices[0].message.role == "assistant"
    chunks = list(chat(openai_client, "What does `os.getcwd` do?", max_tokens=40, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices_with_a_seed_are_reproducible(openai_client):
    kwargs = dict(model="quire-demo", prompt=PROMPTS[2], max_tokens=12, n=3, temperature=1.0, seed=11)
    first = openai_client.completions.create(**kwargs)
    again = openai_client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    chat_out = chat(openai_client, "Hi", n=3, temperature=1.0, seed=3, max_tokens=8)
    assert [c.index for c in chat_out.choices] == [0, 1, 2]


def test_completion_logprobs(openai_client):
    out = openai_client.completions.create(model="quire-demo", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                           logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and len(top) in (3, 4) and max(top.values()) == pytest.approx(value)


def test_echo_with_logprobs_on_token_ids_as_lm_evaluation_harness_sends_it(openai_client, demo_server):
    tokens = httpx.post(demo_server.url("/tokenize"), json={"prompt": "The json module provides",
                                                            "add_special_tokens": False}).json()["tokens"]
    out = openai_client.completions.create(model="quire-demo", prompt=[tokens], max_tokens=1, temperature=0,
                                           logprobs=1, echo=True)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(tokens) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert out.choices[0].text.startswith("The json module provides")
    assert logprobs.text_offset[0] == 0


def test_chat_logprobs(openai_client):
    out = chat(openai_client, "Hello", max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) >= 1
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode(errors="replace") == item.token or "\ufffd" in item.token


def test_stop_strings(openai_client):
    full = openai_client.completions.create(model="quire-demo", prompt=PROMPTS[0], max_tokens=30,
                                            temperature=0).choices[0].text
    stop = full[10:13]
    out = openai_client.completions.create(model="quire-demo", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                           stop=[stop]).choices[0]
    assert out.text == full[:full.find(stop)] and out.finish_reason == "stop"
    streamed = openai_client.completions.create(model="quire-demo", prompt=PROMPTS[0], max_tokens=30,
                                                temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_tokenize_detokenize_and_tokenizer_info(demo_server):
    tokenized = httpx.post(demo_server.url("/tokenize"), json={"prompt": "hello world"}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 1024
    text = httpx.post(demo_server.url("/detokenize"), json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text == "hello world"
    chat_tokens = httpx.post(demo_server.url("/tokenize"), json={
        "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}).json()
    assert chat_tokens["token_strs"][0] == "<|im_start|>"
    info = httpx.get(demo_server.url("/tokenizer_info")).json()
    assert info["eos_token"] == "<|im_end|>"


def test_request_id_header_is_echoed_and_openapi_describes_the_bodies(demo_server):
    response = httpx.get(demo_server.url("/version"), headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123" and response.json()["version"]
    assert httpx.get(demo_server.url("/ping")).status_code == 200
    schema = httpx.get(demo_server.url("/openapi.json")).json()
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "CompletionResponse", "ChatCompletionRequest", "ChatCompletionResponse",
                 "ErrorResponse"):
        assert name in components
    assert "/v1/chat/completions" in schema["paths"]


def test_prompt_logprobs_are_returned(demo_server):
    response = httpx.post(demo_server.url("/v1/completions"), timeout=30, json={
        "prompt": "The json module", "max_tokens": 2, "prompt_logprobs": 1}).json()
    prompt_logprobs = response["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == response["usage"]["prompt_tokens"]
    assert all(isinstance(next(iter(p.values()))["logprob"], float) for p in prompt_logprobs[1:])


def test_the_console_script_is_installed():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "quire-openai-server"  # installed next to this interpreter
    assert script.is_file()
    assert "--served-model-name" in subprocess.run([str(script), "--help"], capture_output=True, text=True,
                                                   timeout=60).stdout


def test_continuous_usage_stats_put_usage_on_every_chunk(openai_client):
    chunks = list(chat(openai_client, "Hi", max_tokens=6, temperature=0, stream=True, user="someone",
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and chunks[-1].choices == []
