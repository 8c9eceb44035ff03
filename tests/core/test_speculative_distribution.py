"""Random sampling with speculation follows the target model exactly, end to end: 5,000 samples of the tokens
after a fixed prompt, with and without speculation, agree by a chi-square test (p > 0.01), and the same test
catches a rejection sampler whose replacement step draws from the target instead of the residual.

The first output token comes from the prompt's own forward pass; speculation starts with the second. The
test compares the second and third output tokens, the first two positions a verification step decides.
The draft is the target itself (greedy): it proposes the target's most likely token, which a temperature
of 1 accepts often but not always, so both the acceptance and the replacement paths are exercised.
"""

import pytest
import torch

from quire.core import SamplingParams
from quire.core.worker import rejection_sampler
from quire.offline import LLM
from tests.stats import chi_square_p_value

NUM_SAMPLES = 5000
POSITIONS = (1, 2)  # output positions compared (0-based)


@pytest.fixture(scope="module")
def prompt(corpus_token_ids):
    return corpus_token_ids[40:52]


def token_counts(path, prompt, speculative_config=None):
    """Per compared position, how often each token came out in ``NUM_SAMPLES`` unseeded samples."""
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=256, multiprocess=False,
              speculative_config=speculative_config)
    # room for 4 proposals after the first token (the scheduler keeps each step within max_tokens)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    counts = llm.llm_engine.engine_core.engine_core.scheduler.spec_decode_counts
    vocab_size = llm.llm_engine.engine_core.engine_core.config.model.vocab_size
    llm.shutdown()
    if speculative_config is not None:
        assert counts.num_drafts >= NUM_SAMPLES  # every request verified proposals
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    tokens = torch.tensor([output.outputs[0].token_ids for output in outputs])
    return [torch.bincount(tokens[:, position], minlength=vocab_size) for position in POSITIONS]


def pooled(counts, reference):
    """Tokens the reference saw fewer than 5 times, pooled into one bin (chi-square wants expected counts >= 5)."""
    rare = reference < 5
    return torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])


@pytest.fixture(scope="module")
def reference_counts(tiny_checkpoint, prompt):
    return token_counts(tiny_checkpoint("llama"), prompt)


def speculative_counts(tiny_checkpoint, prompt):
    path = tiny_checkpoint("llama")
    return token_counts(path, prompt, {"method": "draft_model", "model": path, "num_speculative_tokens": 4,
                                       "disable_by_batch_size": None})


def test_speculative_samples_follow_the_target(tiny_checkpoint, prompt, reference_counts):
    for counts, reference in zip(speculative_counts(tiny_checkpoint, prompt), reference_counts):
        assert reference.max() < 0.9 * NUM_SAMPLES  # not a near-certain token: the comparison has power
        assert chi_square_p_value(pooled(counts, reference), pooled(reference, reference)) > 0.01


def test_a_replacement_drawn_from_the_target_is_caught(tiny_checkpoint, prompt, reference_counts, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "_residual_probs", lambda target_probs, draft_probs: target_probs)
    counts, reference = speculative_counts(tiny_checkpoint, prompt)[0], reference_counts[0]
    assert chi_square_p_value(pooled(counts, reference), pooled(reference, reference)) < 0.01
