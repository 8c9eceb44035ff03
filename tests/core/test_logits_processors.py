"""The sampler's logits-processor pipeline: built-in members keep their order, and a new processor plugs in
without touching the sampler."""

from __future__ import annotations

import pytest
import torch

from quire.core.worker.logits_processors import (
    AllowedTokenIds,
    BannedTokenIds,
    GrammarBitmask,
    LogitBias,
    LogitsProcessor,
    default_logits_processors,
)
from quire.core.worker.sampler import Sampler, SamplingMetadata
from quire.offline import LLM, SamplingParams


class ForceToken(LogitsProcessor):
    """Rows listed in ``metadata.processor_inputs["force_token"]`` (row -> token id) must take that token."""

    def __init__(self):
        self.num_applied = 0

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.processor_inputs.get("force_token"))

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        self.num_applied += 1
        for row, token_id in metadata.processor_inputs["force_token"].items():
            logits[row] = float("-inf")
            logits[row, token_id] = 0.0
        return logits


class ForceEverywhere(ForceToken):
    """Every row of every step takes ``token_id``."""

    def __init__(self, token_id: int):
        super().__init__()
        self.token_id = token_id

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return True

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        metadata.processor_inputs["force_token"] = dict.fromkeys(range(logits.shape[0]), self.token_id)
        return super().apply(logits, metadata)


def greedy_metadata(batch: int, **fields) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(batch), **fields)


def test_built_in_members_in_the_documented_order():
    members = default_logits_processors().processors
    assert [type(p) for p in members] == [GrammarBitmask, AllowedTokenIds, BannedTokenIds, LogitBias]
    # allowed ids first, then bans, then bias: a banned allowed token stays banned, a biased one wins
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    metadata = greedy_metadata(1, allowed_token_ids={0: [0, 1, 2]}, banned_token_ids={0: [0]},
                               logit_bias={0: ([2], [10.0])})
    out = default_logits_processors().apply(logits.clone(), metadata)
    assert out.tolist() == [[float("-inf"), 4.0, 13.0, float("-inf")]]


def test_an_added_processor_changes_only_its_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.Generator().manual_seed(0))
    force = ForceToken()
    sampler.logits_processors.append(force)
    plain = greedy_metadata(3)
    assert sampler.is_plain_greedy(plain)
    assert sampler(logits.clone(), plain).token_ids.tolist() == logits.argmax(-1).tolist()
    assert force.num_applied == 0
    forced = greedy_metadata(3, processor_inputs={"force_token": {1: 42}})
    assert not sampler.is_plain_greedy(forced)  # the pipeline reports the active processor
    tokens = sampler(logits.clone(), forced).token_ids.tolist()
    expected = logits.argmax(-1).tolist()
    expected[1] = 42
    assert tokens == expected and force.num_applied == 1


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=256)


def test_a_processor_added_to_the_engine_forces_its_token(llm, corpus_token_ids):
    prompts = [corpus_token_ids[:12], corpus_token_ids[300:340]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def generate():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    sampler = llm.llm_engine.engine_core.engine_core.executor.model_runner.sampler
    plain = generate()
    idle = ForceToken()  # never active: greedy steps keep the plain path and the same tokens
    sampler.logits_processors.append(idle)
    assert generate() == plain and idle.num_applied == 0
    forced_id = next(t for t in range(100, 200) if t not in plain[0] + plain[1])
    sampler.logits_processors.append(ForceEverywhere(forced_id))
    assert generate() == [[forced_id] * 6] * 2
    sampler.logits_processors.processors.pop()
    assert generate() == plain
