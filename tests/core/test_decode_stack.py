"""Decode steps through the C++ decoder stack give bit-identical results to the Python modules."""

from __future__ import annotations

import pytest

from quire.kernels import linear as linear_ops
from quire.offline import LLM, SamplingParams

needs_bf16_kernel_path = pytest.mark.skipif(
    linear_ops.bf16_path() == "torch",
    reason="bfloat16 models use the decoder stack where their linear layers are prepacked (Quire's AVX2 kernel or "
           "oneDNN); without either they decode through the modules")

NEW_TOKENS = 12


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.model_runner.model.model


def generate(llm: LLM, prompts):
    llm.reset_prefix_cache()  # both runs compute every prompt from scratch
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs]) for o in outputs]


def assert_stack_equals_modules(llm: LLM, corpus_token_ids, batch_sizes=(1, 4)) -> int:
    """Greedy ids and logprobs of decodes of ``batch_sizes`` prompts through the stack equal the modules' bit for
    bit; returns how many of the stack's steps ran as one parallel region."""
    model = model_of(llm)
    assert model.decode_stack is not None and model.decode_stack.num_layers == len(model.layers)
    calls = []
    stack = model.decode_stack

    class Counting:  # counts the steps the stack ran, to show the comparison exercised it
        num_layers = stack.num_layers

        def forward(self, *args):
            calls.append(args[0].shape[0])
            return stack.forward(*args)

    model.decode_stack = Counting()
    lengths = (5, 1, 7, 33, 60, 2, 18)  # varied prompt lengths, the first alone in the batch-1 run
    batches = [[corpus_token_ids[i * 100:i * 100 + lengths[i % len(lengths)]] for i in range(size)]
               for size in batch_sizes]
    one_region_before = getattr(stack, "one_region_steps", 0)
    fused = [generate(llm, batch) for batch in batches]
    one_region = getattr(stack, "one_region_steps", 0) - one_region_before
    assert set(batch_sizes) <= set(calls)  # decode steps of each batch size went through the stack
    model.decode_stack = None
    modules = [generate(llm, batch) for batch in batches]
    model.decode_stack = stack
    assert fused == modules
    return one_region


@needs_bf16_kernel_path
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm + tied head
def test_stack_equals_modules_bit_for_bit(tiny_checkpoint, corpus_token_ids, arch):
    llm = LLM(tiny_checkpoint(arch), dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    steps = assert_stack_equals_modules(llm, corpus_token_ids)
    if linear_ops.bf16_path() == "kernel":  # AVX2: batch-1 steps run as one region on linear_bf16's row kernel
        assert model_of(llm).decode_stack.one_region_max_rows == 1
        assert steps >= NEW_TOKENS - 1  # every decode step of the batch-1 run


def cpu_extension_kernels():
    from quire.kernels import cpu_extension

    return cpu_extension.load()


def one_region_possible() -> bool:
    """Whether this build runs small decode steps as one parallel region (AVX-512 BF16 and oneDNN's packing)."""
    import torch

    kernels = cpu_extension_kernels()
    return (kernels is not None and linear_ops.bf16_path() == "onednn" and kernels.onednn_gemv_max_rows() > 0
            and hasattr(kernels.DecodeStack, "one_region_steps")
            # oneDNN packs bfloat16 weights in blocks onednn_gemv reads (32 or 64 outputs wide)
            and kernels.onednn_gemv_layout(linear_ops.prepack(torch.randn(64, 64).bfloat16()).packed))


@pytest.mark.skipif(not one_region_possible(), reason="one-region decode steps need AVX-512 BF16 (onednn_gemv) "
                    "and oneDNN-packed bfloat16 weights")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_region_steps_equal_modules_bit_for_bit(tmp_path_factory, tiny_tokenizer, corpus_token_ids, arch):
    """Heads of 32 (the width paged_decode's bfloat16 kernel takes): batch-1 and batch-4 decode steps run as one
    parallel region, with the modules' bits (plain; q/k/v bias; q/k norms and a tied head)."""
    import dataclasses

    from quire.core.testing.checkpoints import build_checkpoint
    from tests.conftest import checkpoint_specs

    spec = dataclasses.replace(checkpoint_specs()[arch], head_dim=32, num_hidden_layers=3)
    folder = build_checkpoint(tmp_path_factory.mktemp(f"one-region-{arch}"), spec, tiny_tokenizer)
    llm = LLM(folder, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    stack = model_of(llm).decode_stack
    kernels = cpu_extension_kernels()
    assert stack.one_region_max_rows == max(8, kernels.onednn_amx_max_rows(), kernels.onednn_wide_max_rows())
    steps = assert_stack_equals_modules(llm, corpus_token_ids)
    assert steps >= 2 * (NEW_TOKENS - 1)  # every decode step of both runs


@pytest.mark.skipif(not one_region_possible() or max(cpu_extension_kernels().onednn_amx_max_rows(),
                                                     cpu_extension_kernels().onednn_wide_max_rows()) < 64,
                    reason="one-region decode steps of more than 8 rows need AMX tiles (onednn_gemv's AMX kernel, "
                    "oneDNN's 32-output blocks) or oneDNN's 64-output blocks (onednn_gemv's runs of rows)")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms and a tied head
def test_one_region_steps_of_many_rows_equal_modules_bit_for_bit(tmp_path_factory, tiny_tokenizer,
                                                                   corpus_token_ids, arch):
    """Steps of 9 to 64 rows run as one parallel region, with the modules' bits: on AMX tiles (rows padded to 16:
    one 16-row pass, a padded 32-row one, whole 32-row passes with a 16-row or 32-row tail, whole passes alone), or
    on oneDNN's 64-output blocks in runs of up to 6 rows (runs of 5 and 4 rows at 9, 4 runs at 20, 7-11 runs),
    from 16 rows each of the two threads with its own rows through every layer (split rows)."""
    import dataclasses

    from quire.core.testing.checkpoints import build_checkpoint
    from tests.conftest import checkpoint_specs

    spec = dataclasses.replace(checkpoint_specs()[arch], head_dim=32, num_hidden_layers=2)
    folder = build_checkpoint(tmp_path_factory.mktemp(f"one-region-tiles-{arch}"), spec, tiny_tokenizer)
    # two threads: on 64-output blocks, steps of 16 rows or more split their rows between them
    llm = LLM(folder, dtype="bfloat16", max_model_len=256, max_num_seqs=64, num_threads=2)
    stack = model_of(llm).decode_stack
    split_before = stack.split_steps
    steps = assert_stack_equals_modules(llm, corpus_token_ids, batch_sizes=(9, 20, 40, 50, 64))
    assert steps >= 5 * (NEW_TOKENS - 1)  # every decode step of every run
    if cpu_extension_kernels().onednn_amx_max_rows() == 0:
        # 64-output blocks: every step of 20-64 rows split them (prompts of 1-60 tokens: uneven runs of rows)
        assert stack.split_steps - split_before >= 4 * (NEW_TOKENS - 1)


@pytest.mark.skipif(not one_region_possible(), reason="one-region decode steps need AVX-512 BF16 (onednn_gemv) "
                    "and oneDNN-packed bfloat16 weights")
def test_one_region_steps_with_several_queries_of_a_request_equal_modules(tmp_path_factory, tiny_tokenizer,
                                                                         corpus_token_ids):
    """A prompt's last chunk of up to MAX_SPLIT_QUERY_LEN tokens after its cached part decodes as one stack row per
    token, beside other requests' decode rows: each row reads the keys and values the rows before it write in the
    same step. Alone (6 and 10 rows) and with three decode rows (19 rows), the stack gives the modules' bits."""
    import dataclasses

    from quire.core.testing.checkpoints import build_checkpoint
    from quire.kernels.attention import MAX_SPLIT_QUERY_LEN
    from tests.conftest import checkpoint_specs

    # four KV heads a row, long contexts: a row's later heads are written well after its first is read
    spec = dataclasses.replace(checkpoint_specs()["llama"], head_dim=32, num_attention_heads=8, num_key_value_heads=4,
                               num_hidden_layers=2)
    folder = build_checkpoint(tmp_path_factory.mktemp("one-region-chunk-tails"), spec, tiny_tokenizer)
    llm = LLM(folder, dtype="bfloat16", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
    model = model_of(llm)
    stack = model.decode_stack
    shared_rows = []  # the stack's steps in which rows of one request follow each other

    class Recording:
        num_layers = stack.num_layers

        def forward(self, hidden, kv_caches, tables, *rest):
            if len({tuple(row) for row in tables.tolist()}) < tables.shape[0]:
                shared_rows.append(hidden.shape[0])
            return stack.forward(hidden, kv_caches, tables, *rest)

    # 134 and 138 tokens: a 128-token chunk, then a 6-token or 10-token tail alone; 40, 40, 40 and 274 tokens: the
    # three short prompts and 8 tokens of the long one, 125 more of it twice beside three decodes, then its 16-token
    # tail beside them
    batches = [[corpus_token_ids[:134]], [corpus_token_ids[:138]],
               [corpus_token_ids[i * 300:i * 300 + n] for i, n in enumerate((40, 40, 40, 274))]]
    model.decode_stack = Recording()
    fused = [generate(llm, batch) for batch in batches]
    model.decode_stack = None
    modules = [generate(llm, batch) for batch in batches]
    model.decode_stack = stack
    assert {6, 10, 19} <= set(shared_rows) and MAX_SPLIT_QUERY_LEN >= 16
    assert fused == modules


@pytest.mark.skipif(not one_region_possible() and linear_ops.bf16_path() != "kernel",
                    reason="one-region decode steps need oneDNN-packed bfloat16 weights (AVX-512 BF16) or Quire's "
                           "AVX2 kernel")
def test_one_region_can_be_switched_off(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("QUIRE_DECODE_ONE_REGION", "0")
    llm = LLM(tiny_checkpoint("qwen3"), dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    stack = model_of(llm).decode_stack
    assert stack.one_region_max_rows == 0
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert stack.one_region_steps == 0


@pytest.mark.parametrize(("arch", "dtype"), [("qwen2", "float32"), ("qwen3", "bfloat16")])
def test_stack_on_int8_weights_equals_modules_on_any_cpu(tiny_checkpoint, corpus_token_ids, arch, dtype):
    llm = LLM(tiny_checkpoint(arch), dtype=dtype, quantization="int8", max_model_len=256, max_num_seqs=8)
    assert_stack_equals_modules(llm, corpus_token_ids)


@needs_bf16_kernel_path
def test_stack_rejects_mismatched_inputs(tiny_checkpoint):
    import torch

    llm = LLM(tiny_checkpoint("llama"), dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    model = model_of(llm)
    runner = llm.llm_engine.engine_core.engine_core.executor.model_runner
    hidden = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, model.config.head_dim // 2, dtype=torch.bfloat16)
    tables, lens = torch.ones(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="KV caches"):
        model.decode_stack.forward(hidden, runner.kv_caches[:1], tables, lens, torch.zeros(1, dtype=torch.int64),
                                   cos, sin)
    with pytest.raises(RuntimeError, match="outside the cache"):
        model.decode_stack.forward(hidden, runner.kv_caches, tables, lens, torch.tensor([10**9]), cos, sin)
