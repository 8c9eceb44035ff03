"""quire-demo, the embedded model: loadable by transformers, equal to it, trained, chat-capable."""

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


def test_held_out_perplexity_is_far_below_the_vocabulary_size():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "tools/train_demo_model.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
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
