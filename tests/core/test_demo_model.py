"""quire-demo, the embedded model: loadable by transformers, equal to it, trained, chat-capable, and able to
call tools (held-out requests, and examples/tool_calling.py's agent loop against the real server)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quire.core import demo_model_path
from quire.offline import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
HELDOUT_QUESTIONS = ROOT / "tests/data/quire_demo_heldout_chat.json"
HELDOUT_TOOL_REQUESTS = ROOT / "tests/data/quire_demo_heldout_tools.json"
PROMPTS = [
    "The json module", "Return the", "def", "Module os.path\n\n", "This function returns a new",
    "<|im_start|>user\nWhat does `math.sqrt` do?<|im_end|>\n<|im_start|>assistant\n",
    "Raise ValueError if", "A list is", "class", "The default value of",
]


@pytest.fixture(scope="module")
def demo_float32():
    return LLM(dtype="float32")


def test_llm_without_arguments_generates_from_quire_demo():
    llm = LLM()
    assert Path(llm.llm_engine.model_config.path) == demo_model_path()
    out = llm.generate("The json module", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text.strip()


def test_transformers_loads_it_offline_and_agrees_greedily(demo_float32):
    code = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "AutoTokenizer.from_pretrained(sys.argv[1]); AutoModelForCausalLM.from_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(demo_model_path())], check=True, timeout=300,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = demo_float32.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_it_learned_the_chat_format(demo_float32):
    questions = json.loads(HELDOUT_QUESTIONS.read_text())
    assert len(questions) == 50
    end_of_turn = demo_float32.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    outputs = demo_float32.chat([[{"role": "user", "content": q}] for q in questions],
                                SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    ended = sum(o.outputs[0].token_ids[-1] == end_of_turn for o in outputs)
    assert ended >= 40, f"only {ended} of 50 held-out chat answers ended with <|im_end|>"


def load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_perplexity_is_far_below_the_vocabulary_size():
    trainer = load_script("train_demo_model", ROOT / "tools/train_demo_model.py")
    documents, _ = trainer.stdlib_items()
    heldout = [text for key, text in documents if trainer.is_held_out(key)]
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    stream = trainer.token_stream(tokenizer, heldout)
    loss = trainer.mean_loss(model, stream, seq_len=512, max_windows=10**9)
    vocab_size = len(tokenizer)
    assert math.exp(loss) < vocab_size / 50
    card = (demo_model_path() / "README.md").read_text()
    assert "held-out perplexity" in card and "psf-2.0" in card


def parses_as_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def test_it_calls_the_right_tool_on_held_out_requests():
    heldout = json.loads(HELDOUT_TOOL_REQUESTS.read_text())
    requests = heldout["requests"]
    assert len(requests) == 30
    llm = LLM(dtype="float32", tool_call_parser="hermes")
    outputs = llm.chat([r["messages"] for r in requests], SamplingParams(temperature=0, max_tokens=64),
                       tools=heldout["tools"], use_tqdm=False)
    llm.shutdown()
    right = [any(call.name == request["tool"] and parses_as_object(call.arguments)
                 for call in output.outputs[0].tool_calls)
             for request, output in zip(requests, outputs)]
    missed = [r["messages"][-1]["content"] for r, ok in zip(requests, right) if not ok]
    assert sum(right) >= 24, f"only {sum(right)} of 30 held-out requests called the right tool: missed {missed}"


def test_the_tool_calling_example_completes_a_round_trip():
    from openai import OpenAI

    from tests.servers import ServerProcess

    example = load_script("tool_calling_example", ROOT / "examples/tool_calling.py")
    assert example.TOOLS == json.loads(HELDOUT_TOOL_REQUESTS.read_text())["tools"], "the example offers other tools"
    server = ServerProcess("--dtype", "float32", "--tool-call-parser", "hermes")
    try:
        client = OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        run = example.run_agent(client, "What does os.path.join do?", max_rounds=3)
    finally:
        server.stop()
    roles = [message["role"] for message in run.messages]
    assert roles[:3] == ["user", "assistant", "tool"], run.messages
    assert run.messages[1]["tool_calls"][0]["function"]["name"] in example.FUNCTIONS
    assert run.messages[2]["tool_call_id"] == run.messages[1]["tool_calls"][0]["id"]
    assert run.finish_reason == "stop" and run.answer, run.messages
