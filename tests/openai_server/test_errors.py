"""A table of malformed and out-of-range requests: each gets the right status and error body, and the
server keeps answering afterwards."""

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body or raw bytes, status, code, param)
    (C, b"{not json", 400, "invalid_json", None),
    (C, b"[1, 2, 3]", 400, None, None),
    (C, b"", 400, None, None),
    (C, {}, 400, "missing_required_parameter", "prompt"),
    (C, {"prompt": ""}, 400, "invalid_value", "prompt"),
    (C, {"prompt": []}, 400, "invalid_value", "prompt"),
    (C, {"prompt": [[]]}, 400, "invalid_value", "prompt"),
    (C, {"prompt": [-1]}, 400, "invalid_value", "prompt"),
    (C, {"prompt": [999999]}, 400, "invalid_value", "prompt"),
    (C, {"prompt": 12}, 400, None, "prompt"),
    (C, b'{"prompt": "a \\ud800 b"}', 400, "invalid_value", "prompt"),  # an unpaired surrogate, escaped
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "invalid_value", "messages"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 100000}, 400, "context_length_exceeded", "max_tokens"),
    (C, {"prompt": "word " * 3000}, 400, "context_length_exceeded", "prompt"),
    (C, {"prompt": "x", "max_tokens": "many"}, 400, "invalid_type", "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "invalid_value", "temperature"),
    (C, {"prompt": "x", "temperature": 2.5}, 400, "invalid_value", "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "invalid_value", "top_p"),
    (C, {"prompt": "x", "top_k": -7}, 400, "invalid_value", "top_k"),
    (C, {"prompt": "x", "min_p": 2}, 400, "invalid_value", "min_p"),
    (C, {"prompt": "x", "n": 0}, 400, "invalid_value", "n"),
    (C, {"prompt": "x", "n": 1000}, 400, "invalid_value", "n"),
    (C, {"prompt": "x", "n": 2, "temperature": 0}, 400, "invalid_value", "n"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "invalid_value", "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "invalid_value", "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_value", "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    (C, {"prompt": "x", "logprobs": -3}, 400, "invalid_value", "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "invalid_value", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "invalid_value", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "invalid_value", "logit_bias"),
    (C, {"prompt": "x", "stop": [""]}, 400, "invalid_value", "stop"),
    (C, {"prompt": "x", "stop_token_ids": [999999]}, 400, "invalid_value", "stop_token_ids"),
    (C, {"prompt": "x", "min_tokens": 50, "max_tokens": 10}, 400, "invalid_value", "min_tokens"),
    (C, {"prompt": "x", "seed": "abc"}, 400, "invalid_type", "seed"),
    (C, {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, 400, "invalid_value",
     "stream_options"),
    (C, {"prompt": "x", "best_of": 3}, 400, "unsupported_value", "best_of"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "unsupported_value", "suffix"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found", "model"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "invalid_value", "truncate_prompt_tokens"),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "invalid_value", "allowed_token_ids"),
    (C, {"prompt": "x", "priority": "high"}, 400, "invalid_type", "priority"),
    (C, {"prompt": "x", "cache_salt": ""}, 400, "invalid_value", "cache_salt"),
    (CHAT, {}, 400, "missing_required_parameter", "messages"),
    (CHAT, {"messages": []}, 400, "invalid_value", "messages"),
    (CHAT, {"messages": "hello"}, 400, "invalid_type", "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "missing_required_parameter", "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None, None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "invalid_value", "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 100000}, 400, "context_length_exceeded", "max_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "invalid_value", "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 30}, 400, "invalid_value", "top_logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "invalid_value", "tool_choice"),  # auto needs --tool-call-parser, which the demo server lacks
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400, "unsupported_value",
     "response_format.type"),
    (CHAT, {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "invalid_value", "continue_final_message"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400, "invalid_value",
     "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model_not_found", "model"),
    ("/tokenize", {}, 400, "invalid_value", "prompt"),
    ("/detokenize", {"tokens": [-4]}, 400, "invalid_value", "tokens"),
    ("/v1/models/unknown", None, 404, "model_not_found", "model"),
    ("/no/such/route", None, 404, "not_found", None),
]


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("path,body,status,code,param", CASES)
def test_bad_request_gets_a_clean_error(demo_server, path, body, status, code, param):
    url = demo_server.url(path)
    if body is None:
        response = httpx.get(url, timeout=30)
    elif isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in error["message"] and "/work/" not in error["message"]
    assert httpx.get(demo_server.url("/health"), timeout=10).status_code == 200


def test_oversized_bodies_are_refused_before_parsing(demo_server):
    huge = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    response = httpx.post(demo_server.url(C), content=huge, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"y" * (1024 * 1024)
        yield b'"}'

    streamed = httpx.post(demo_server.url(C), content=chunks(), headers={"content-type": "application/json"},
                          timeout=60)
    assert streamed.status_code == 413


def test_the_server_and_llm_word_an_over_long_prompt_the_same(demo_server):
    """One input path: the server's 400 and the offline ``LLM``'s ValidationError carry the same text."""
    from quire.core.errors import ValidationError
    from quire.offline import LLM

    prompt, messages = "word " * 3000, [{"role": "user", "content": "word " * 3000}]
    served = httpx.post(demo_server.url(C), json={"prompt": prompt}, timeout=60).json()["error"]
    served_chat = httpx.post(demo_server.url(CHAT), json={"messages": messages}, timeout=60).json()["error"]
    llm = LLM(dtype="float32", multiprocess=False)
    with pytest.raises(ValidationError) as offline:
        llm.generate(prompt, use_tqdm=False)
    with pytest.raises(ValidationError) as offline_chat:
        llm.chat(messages, use_tqdm=False)
    llm.shutdown()
    assert served["message"] == offline.value.message and served["param"] == offline.value.param == "prompt"
    assert served_chat["message"] == offline_chat.value.message
    assert served_chat["param"] == offline_chat.value.param == "messages"
    assert "maximum context length" in served["message"] and served["code"] == "context_length_exceeded"
