"""Stop strings, stop token ids, max_tokens, min_tokens and ignore_eos through the whole engine:
text, token ids and finish reason, against the plain greedy continuation and transformers."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.offline import LLM, SamplingParams

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def prompt(corpus_token_ids):
    return corpus_token_ids[:20]


@pytest.fixture(scope="module")
def greedy(llm, prompt):
    """The unconstrained greedy continuation: (token ids, text)."""
    out = generate(llm, prompt)
    assert out.finish_reason == "length" and len(out.token_ids) == NUM_TOKENS
    return out.token_ids, out.text


def generate(llm, prompt, **params):
    params = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True, **params}
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def decode(llm, ids):
    return llm.get_tokenizer().decode(ids)


def first_tokens_containing(llm, ids, needle):
    return next(k for k in range(1, len(ids) + 1) if needle in decode(llm, ids[:k]))


def test_stop_string_excluded(llm, prompt, greedy):
    ids, text = greedy
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = generate(llm, prompt, stop=[stop])
    assert out.text == text[:text.find(stop)]
    assert out.token_ids == ids[:first_tokens_containing(llm, ids, stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_string_included(llm, prompt, greedy):
    ids, text = greedy
    stop = text[len(text) // 3:len(text) // 3 + 2]
    out = generate(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert out.text == text[:text.find(stop) + len(stop)]
    assert out.token_ids == ids[:first_tokens_containing(llm, ids, stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_string_frees_the_engine_request(llm, prompt, greedy):
    _, text = greedy
    out = generate(llm, prompt, stop=[text[5:8]])
    assert out.finish_reason == "stop" and len(out.token_ids) < NUM_TOKENS
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core
    assert not scheduler.has_unfinished_requests() and scheduler.requests == {}
    assert scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.engine_core.num_blocks - 1


def test_stop_token_id(llm, prompt, greedy):
    ids, _ = greedy
    stop_id = ids[6]
    first = ids.index(stop_id)
    out = generate(llm, prompt, stop_token_ids=[stop_id])
    assert out.token_ids == ids[:first + 1]
    assert out.text == decode(llm, ids[:first])  # the stop token's own text is left out
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_max_tokens(llm, prompt, greedy):
    ids, _ = greedy
    out = generate(llm, prompt, max_tokens=5)
    assert out.token_ids == ids[:5] and out.text == decode(llm, ids[:5])
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_min_tokens_masks_the_stop_token_like_transformers(llama_checkpoint, llm, prompt, greedy):
    ids, _ = greedy
    stop_id = ids[1]
    min_tokens = 10
    out = generate(llm, prompt, stop_token_ids=[stop_id], min_tokens=min_tokens)
    # transformers masks its EOS below min_new_tokens: declare the stop token its EOS
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                               min_new_tokens=min_tokens, eos_token_id=stop_id, pad_token_id=0)
    expected = reference[0, len(prompt):].tolist()
    assert out.token_ids == expected
    assert stop_id not in out.token_ids[:min_tokens - 1]
    if expected[-1] == stop_id:
        assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
        assert out.text == decode(llm, expected[:-1])
    else:
        assert out.finish_reason == "length" and out.text == decode(llm, expected)


@pytest.fixture(scope="module")
def checkpoint_with_eos(llama_checkpoint, greedy, tmp_path_factory):
    """The same weights, with the 5th greedy token declared the end-of-sequence token."""
    folder = tmp_path_factory.mktemp("eos-ckpt")
    for item in llama_checkpoint.iterdir():
        shutil.copy(item, folder / item.name)
    eos_id = greedy[0][4]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return folder, eos_id


def test_eos_and_ignore_eos(checkpoint_with_eos, prompt, greedy):
    folder, eos_id = checkpoint_with_eos
    ids, text = greedy
    llm = LLM(folder, dtype="float32", max_model_len=512)
    stopped = generate(llm, prompt, ignore_eos=False)
    first = ids.index(eos_id)
    assert stopped.token_ids == ids[:first + 1] and stopped.text == decode(llm, ids[:first])
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    ignored = generate(llm, prompt, ignore_eos=True)
    assert ignored.token_ids == ids and ignored.text == text and ignored.finish_reason == "length"
