"""CudaGraphRunner's static buffers and padding, checked on the CPU: every "graph" here replays the model
eagerly on the same buffers (Triton kernels in the interpreter), so only the capture itself is left to
the GPU tests."""

from __future__ import annotations

import torch

from quire.core.worker.cuda_graphs import CudaGraphRunner
from quire.offline import LLM, SamplingParams


class _EagerReplay:
    def __init__(self, fn):
        self.replay = fn


class EagerGraphs(CudaGraphRunner):
    def capture(self) -> None:
        for size in self.batch_sizes:
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))
            self.outputs[size] = self.model(*args)
            self.graphs[size] = _EagerReplay(
                lambda size=size, args=args: self.outputs[size].copy_(self.model(*args)))


def test_decode_steps_through_graph_buffers_equal_eager(llama_checkpoint, corpus_token_ids):
    prompts = [corpus_token_ids[i * 100:i * 100 + n] for i, n in enumerate((3, 17, 40, 9, 66))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(dtype="float32", device="cpu", attention_backend="triton", max_model_len=1024, max_num_seqs=6,
                   multiprocess=False)
    eager = [o.outputs[0].token_ids for o in LLM(llama_checkpoint, **options).generate(prompts, params, use_tqdm=False)]

    llm = LLM(llama_checkpoint, **options)
    runner = llm.llm_engine.engine_core.engine_core.executor.model_runner
    runner.cuda_graphs = graphs = EagerGraphs(runner.model, runner.attn_backend, runner.kv_caches, 6,
                                              runner.input_batch.block_table.shape[1], 1024, runner.block_size,
                                              torch.device("cpu"))
    graphs.capture()
    assert graphs.batch_sizes == [1, 2, 4, 6]
    replays = []
    run = graphs.run
    graphs.run = lambda *args: replays.append(args[0].shape[0]) or run(*args)
    # 5 requests run in the graph of 6 (one padding row), then fewer as they finish
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
    assert replays and max(replays) == 5
    assert llm.llm_engine.engine_core.call_utility("check_idle_invariants")
