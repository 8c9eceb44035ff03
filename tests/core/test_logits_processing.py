"""Penalties, logit bias, allowed ids, bad words and min-p, each against a reference written here from
its definition (greedy decoding over transformers' logits), repetition penalty also against
transformers' own logits processor."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.offline import LLM, SamplingParams
from tests.core.reference import hf_logits, reference_greedy

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def prompt(corpus_token_ids):
    return corpus_token_ids[2000:2024]


@pytest.fixture(scope="module")
def plain(model, prompt):
    return reference_greedy(model, prompt, NUM_TOKENS)


def quire_greedy(llm, prompt, **params):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **params)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def check(llm, model, prompt, plain, process, **params):
    expected = reference_greedy(model, prompt, NUM_TOKENS, process)
    assert expected != plain, "the setting should change the greedy output, or this test proves little"
    assert quire_greedy(llm, prompt, **params) == expected


def test_presence_penalty(llm, model, prompt, plain):
    def process(logits, prompt, output):
        for token in set(output):
            logits[token] -= 2.0
        return logits
    check(llm, model, prompt, plain, process, presence_penalty=2.0)


def test_frequency_penalty(llm, model, prompt, plain):
    def process(logits, prompt, output):
        for token in set(output):
            logits[token] -= 1.5 * output.count(token)
        return logits
    check(llm, model, prompt, plain, process, frequency_penalty=1.5)


def test_repetition_penalty(llm, model, prompt, plain):
    penalty = 3.0

    def process(logits, prompt, output):
        for token in set(prompt + output):
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        return logits
    check(llm, model, prompt, plain, process, repetition_penalty=penalty)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                        do_sample=False, repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    assert quire_greedy(llm, prompt, repetition_penalty=penalty) == hf[0, len(prompt):].tolist()


def test_logit_bias(llm, model, prompt, plain):
    bias = {plain[0]: -100.0, 7: 6.0, 11: 3.5}

    def process(logits, prompt, output):
        for token, value in bias.items():
            logits[token] += value
        return logits
    check(llm, model, prompt, plain, process, logit_bias=bias)


def test_allowed_token_ids(llm, model, prompt, plain):
    allowed = [3, 17, 99, 250, 512, 1000, 1500]

    def process(logits, prompt, output):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked
    check(llm, model, prompt, plain, process, allowed_token_ids=allowed)
    assert set(quire_greedy(llm, prompt, allowed_token_ids=allowed)) <= set(allowed)


def test_bad_words(llm, model, prompt, plain):
    tokenizer = llm.get_tokenizer()
    word = next(w for w in (tokenizer.decode([t]).strip() for t in plain) if w.isalpha())
    # definition: a bad word, as token ids alone and after a space, may never be completed
    sequences = [tokenizer.encode(v, add_special_tokens=False) for v in (word, " " + word)]

    def process(logits, prompt, output):
        for sequence in sequences:
            if len(sequence) == 1 or output[len(output) - len(sequence) + 1:] == sequence[:-1]:
                logits[sequence[-1]] = float("-inf")
        return logits
    check(llm, model, prompt, plain, process, bad_words=[word])


def test_min_p_keeps_only_tokens_near_the_best(llm, model, prompt):
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=3, max_tokens=NUM_TOKENS, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    probs = hf_logits(model, prompt + output).softmax(-1)
    for step, token in enumerate(output):
        row = probs[len(prompt) - 1 + step]
        assert row[token] >= 0.5 * row.max() - 1e-6
    # without min_p the same seed wanders outside that set
    free = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=NUM_TOKENS,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    free_probs = hf_logits(model, prompt + free).softmax(-1)
    assert any(free_probs[len(prompt) - 1 + s][t] < 0.5 * free_probs[len(prompt) - 1 + s].max()
               for s, t in enumerate(free))
