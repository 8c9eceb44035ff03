"""Tensor parallelism over gloo: TP=2 equals TP=1 and transformers, each rank holds half the split weights, a
dead worker fails the engine promptly."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.distributed.group import TensorParallelGroup, shard_range
from quire.core.engine_args import EngineArgs
from quire.core.errors import ConfigError, EngineDeadError
from quire.core.models.parallel_layers import SHARD_DIM
from quire.core.worker.model_runner import ModelRunner
from quire.offline import LLM, SamplingParams
from tests.conftest import checkpoint_specs
from tests.gguf.greedy import transformers_greedy

NUM_PROMPTS = 20
NUM_NEW_TOKENS = 8
FLOAT32_MIN_MARGIN = 1e-3  # the rule of test_transformers_equality: a clear greedy margin on every step
MAX_MODEL_LEN = 128
ARCHS = ("llama", "qwen2", "qwen3", "llama_kv1")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Rank 0 runs in this process and sets its share of the threads for the whole process."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tiny_tokenizer, tmp_path_factory):
    """The shared tiny checkpoints, and ``llama_kv1``: one KV head, fewer than the two ranks."""
    from quire.core.testing.checkpoints import build_checkpoint

    built = {}

    def get(arch):
        if arch not in built:
            if arch == "llama_kv1":
                spec = dataclasses.replace(checkpoint_specs()["llama"], num_key_value_heads=1)
                built[arch] = build_checkpoint(tmp_path_factory.mktemp("ckpt-llama-kv1"), spec, tiny_tokenizer)
            else:
                built[arch] = tiny_checkpoint(arch)
        return built[arch]

    return get


def make_prompts(corpus_token_ids):
    """NUM_PROMPTS prompts of 1 to 58 tokens from the corpus (also test_ray_tensor_parallel's)."""
    return [corpus_token_ids[i * 457:i * 457 + 1 + 3 * i] for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return make_prompts(corpus_token_ids)


def hf_greedy(path, prompts):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    results = transformers_greedy(path, prompts, model=model, num_tokens=NUM_NEW_TOKENS)
    assert min(min(margins) for _, margins in results) > FLOAT32_MIN_MARGIN, "checkpoint not peaked enough"
    return [ids for ids, _ in results]


def run(path, prompts, tensor_parallel_size, **options):
    """Greedy ids and each prompt's logprobs of its own tokens (``options``: more of ``LLM``'s)."""
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tensor_parallel_size,
              **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    prompt_logprobs = [[position[token].logprob for position, token in zip(o.prompt_logprobs[1:], prompt[1:])]
                       for o, prompt in zip(outputs, prompts)]
    return [o.outputs[0].token_ids for o in outputs], prompt_logprobs


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1_and_transformers(checkpoint, prompts, arch):
    path = checkpoint(arch)
    expected = hf_greedy(path, prompts)
    ids_tp1, logprobs_tp1 = run(path, prompts, 1)
    ids_tp2, logprobs_tp2 = run(path, prompts, 2)
    assert ids_tp1 == expected
    assert ids_tp2 == expected
    for one, two in zip(logprobs_tp1, logprobs_tp2):
        assert torch.allclose(torch.tensor(one), torch.tensor(two), atol=1e-4, rtol=0)


def test_engine_process_starts_the_workers(checkpoint, prompts):
    """The default engine runs in its own process (as behind ``quire serve``), which spawns the workers."""
    path = checkpoint("llama_kv1")
    llm = LLM(path, multiprocess=True, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts[:4], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts[:4])


def split_bytes(model) -> tuple[int, int]:
    """Bytes of the parameters split between the ranks, and of those every rank holds whole."""
    split = sum(p.numel() * p.element_size() for p in model.parameters() if hasattr(p, SHARD_DIM))
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not hasattr(p, SHARD_DIM))
    return split, whole


@pytest.mark.parametrize("arch", ["qwen2", "llama_kv1"])
def test_each_rank_loads_half_of_the_split_weights(checkpoint, arch):
    config = EngineArgs(model=str(checkpoint(arch)), dtype="float32", max_model_len=MAX_MODEL_LEN,
                        tensor_parallel_size=2).create_engine_config()
    whole_model = ModelRunner(config).model
    total = sum(p.numel() * p.element_size() for p in whole_model.parameters())
    ranks = []
    for rank in range(2):  # loading runs no collective: a group without a process group behind it will do
        group = TensorParallelGroup(rank, 2, process_group=object())
        ranks.append(ModelRunner(config, group).model)
    num_kv_heads = config.model.num_key_value_heads
    for model in ranks:
        split, whole = split_bytes(model)
        replicated_kv = 0 if num_kv_heads >= 2 else sum(  # one KV head on each rank instead of half of one
            layer.self_attn.kv_size * 2 * config.model.hidden_size * 4 for layer in model.model.layers) // 2
        assert split + whole < total
        assert abs(2 * split - (total - whole) - 2 * replicated_kv) <= 0.01 * total
    # the two ranks' embedding rows are the whole table, in order
    table = torch.cat([model.model.embed_tokens.weight for model in ranks])[:config.model.vocab_size]
    assert torch.equal(table, whole_model.model.embed_tokens.weight)
    if num_kv_heads == 1:  # the one KV head is on both ranks
        q_size = ranks[0].model.layers[0].self_attn.q_size
        assert torch.equal(ranks[0].model.layers[0].self_attn.qkv_proj.weight[q_size:],
                           ranks[1].model.layers[0].self_attn.qkv_proj.weight[q_size:])


def test_shard_range():
    assert shard_range(8, 4, 1, 2) == (4, 8)
    assert shard_range(5, 3, 1, 2) == (3, 5)  # the last rank's slice is short
    assert shard_range(2, 2, 1, 2) == (0, 2)  # one KV head, two ranks: both hold it
    assert [shard_range(4, 2, rank, 4) for rank in range(4)] == [(0, 2), (0, 2), (2, 4), (2, 4)]


@pytest.mark.parametrize("when", ["between_steps", "during_steps"])
def test_dead_worker_fails_the_engine_promptly(checkpoint, prompts, when, monkeypatch):
    llm = LLM(checkpoint("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.engine_core.executor
    worker = executor.workers[0].process
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)
        if when == "between_steps":
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(5)
        else:  # the rank dies in the third step, as rank 0 starts it: the collectives it leaves fail
            execute, steps = executor.model_runner.execute, itertools.count()

            def execute_and_kill(*args):
                if next(steps) == 2:
                    os.kill(worker.pid, signal.SIGKILL)
                return execute(*args)

            monkeypatch.setattr(executor.model_runner, "execute", execute_and_kill)
        assert_next_generate_fails_promptly(llm, params)
    finally:
        llm.shutdown()
    assert not any(w.process.is_alive() for w in executor.workers)


def assert_next_generate_fails_promptly(llm, params) -> None:
    """The engine's next steps raise EngineDeadError (a rank is gone) within 5 s."""
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1|tensor-parallel step failed"):
        llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
    assert time.monotonic() - start < 5


def test_shutdown_stops_every_worker(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
              num_threads=2)
    executor = llm.llm_engine.engine_core.engine_core.executor
    assert executor.num_threads() == 1  # two threads shared by two ranks
    assert executor.num_kv_blocks() >= 1
    llm.shutdown()
    assert not any(w.process.is_alive() for w in executor.workers)


def test_threads_are_shared_out_between_the_ranks(llama_checkpoint):
    def threads(**options):
        return EngineArgs(model=str(llama_checkpoint), device="cpu", **options).create_engine_config().num_threads

    assert threads(tensor_parallel_size=2, num_threads=5) == 2
    assert threads(tensor_parallel_size=2, data_parallel_size=2, num_threads=8) == 2
    assert threads(tensor_parallel_size=1, num_threads=5) == 5


@pytest.mark.parametrize("size", [0, 3])
def test_tensor_parallel_size_is_validated(llama_checkpoint, size):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineArgs(model=str(llama_checkpoint), tensor_parallel_size=size, device="cpu").create_engine_config()
