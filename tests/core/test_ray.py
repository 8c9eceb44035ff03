"""Ray: tensor parallelism over Ray actors (TP=2 on Ray equals TP=2 on processes, a killed actor fails the
engine promptly, shutdown releases the actors and the placement group, without Ray the error says what to
install) and data parallelism with engine cores as Ray actors (outputs equal one engine's, a killed actor fails
the front end promptly, shutdown frees the CPUs).

The module starts one local Ray cluster (``ray start --head --block``, 2 CPUs) and points ``RAY_ADDRESS`` at it,
so that the engine core joins it whether it runs in this process or in its own.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from quire.core.errors import ConfigError, EngineDeadError
from quire.offline import LLM, SamplingParams
from tests.core.test_tensor_parallel import (
    MAX_MODEL_LEN,
    NUM_NEW_TOKENS,
    assert_next_generate_fails_promptly,
    make_prompts,
    restore_torch_threads,  # noqa: F401 (an autouse fixture)
    run,
)
from tests.ray_cluster import wait_for_every_cpu


@pytest.fixture(scope="module")
def prompts(corpus_token_ids):
    return make_prompts(corpus_token_ids)


@pytest.fixture(scope="module")
def tp2_on_processes(llama_checkpoint, prompts):
    """The mp executor's greedy ids and prompt logprobs: what the Ray executor must give."""
    return run(llama_checkpoint, prompts, 2)


def test_tp2_on_ray_equals_tp2_on_processes(ray_cluster, llama_checkpoint, prompts, tp2_on_processes):
    ids_mp, logprobs_mp = tp2_on_processes
    ids_ray, logprobs_ray = run(llama_checkpoint, prompts, 2, distributed_executor_backend="ray")
    assert ids_ray == ids_mp
    for mp, ray in zip(logprobs_mp, logprobs_ray):
        assert torch.allclose(torch.tensor(mp), torch.tensor(ray), atol=1e-4, rtol=0)


def test_killed_actor_fails_the_engine_promptly_and_shutdown_releases_the_cluster(
        ray_cluster, llama_checkpoint, prompts):
    ray = ray_cluster
    llm = LLM(llama_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.engine_core.executor
    actor, placement_group = executor.workers[0].actor, executor.placement_group
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)
        ray.kill(actor, no_restart=True)
        assert_next_generate_fails_promptly(llm, params)
    finally:
        llm.shutdown()
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"
    wait_for_every_cpu(ray)


def test_engine_process_joins_the_cluster(ray_cluster, llama_checkpoint, prompts, tp2_on_processes):
    """An engine core in its own process (as behind ``quire serve``) joins the cluster RAY_ADDRESS names."""
    llm = LLM(llama_checkpoint, multiprocess=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts[:4], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == tp2_on_processes[0][:4]
    wait_for_every_cpu(ray_cluster)


def test_without_ray_the_error_says_how_to_install_it(llama_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"needs Ray: pip install 'quire-core\[ray\]'"):
        LLM(llama_checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
            distributed_executor_backend="ray")


DP_GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ray_llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float32", max_model_len=256, num_threads=2, data_parallel_size=2,
               data_parallel_backend="ray", multiprocess=True)


def test_engine_cores_as_ray_actors_equal_one_engine(ray_cluster, llama_checkpoint, prompts):
    ray = ray_cluster
    prompts = prompts[:6]
    expected = [o.outputs[0].token_ids for o in
                LLM(llama_checkpoint, dtype="float32", max_model_len=256, multiprocess=False)
                .generate(prompts, DP_GREEDY, use_tqdm=False)]
    llm = ray_llm(llama_checkpoint)
    try:
        assert ray.available_resources().get("CPU", 0) == 0  # each actor holds its engine core's one thread
        outputs = llm.generate(prompts, DP_GREEDY, use_tqdm=False, data_parallel_rank=[0, 1] * 3)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        engines = llm.llm_engine.get_stats()["engines"]
        assert [stats["num_steps"] > 0 for stats in engines] == [True, True], engines
        assert [stats["num_threads"] for stats in engines] == [1, 1]
    finally:
        llm.shutdown()
    wait_for_every_cpu(ray)


def test_killed_actor_fails_the_front_end_promptly(ray_cluster, llama_checkpoint, prompts):
    ray = ray_cluster
    llm = ray_llm(llama_checkpoint)
    try:
        client = llm.llm_engine.engine_core
        ray.kill(client.engines[1].process._actor, no_restart=True)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while time.monotonic() < started + 5:
                llm.generate(prompts[:2], DP_GREEDY, use_tqdm=False, data_parallel_rank=1)
                time.sleep(0.1)
        assert time.monotonic() - started < 5
    finally:
        llm.shutdown()
    wait_for_every_cpu(ray)
