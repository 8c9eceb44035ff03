"""Checkpoint variants: sharded weights, Mistral's architecture name, chat templates in either file."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire.core.errors import ConfigError, ValidationError
from quire.core.renderer import ChatPrompt, Renderer
from quire.core.tokenizer import load_tokenizer
from quire.offline import LLM, SamplingParams

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def copy_checkpoint(source, destination):
    destination.mkdir(exist_ok=True)
    for item in source.iterdir():
        shutil.copy(item, destination / item.name)
    return destination


def greedy_ids(folder, prompt, n=12):
    llm = LLM(folder, dtype="float32", max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def hf_greedy_ids(folder, prompt, n=12):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_sharded_safetensors_load(llama_checkpoint, corpus_token_ids, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(llama_checkpoint / name, tmp_path / name)
    prompt = corpus_token_ids[:30]
    assert greedy_ids(tmp_path, prompt) == greedy_ids(llama_checkpoint, prompt)


def test_mistral_architecture_name_loads_llama_weights(llama_checkpoint, corpus_token_ids, tmp_path):
    folder = copy_checkpoint(llama_checkpoint, tmp_path / "mistral")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    config.pop("rope_parameters")  # Mistral: plain rope
    (folder / "config.json").write_text(json.dumps(config))
    prompt = corpus_token_ids[100:140]
    assert greedy_ids(folder, prompt) == hf_greedy_ids(folder, prompt)


def test_missing_weights_are_named(llama_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_checkpoint(llama_checkpoint, tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="layers.1.self_attn.qkv_proj"):
        LLM(folder, dtype="float32")


def test_chat_template_from_jinja_file_or_tokenizer_config(llama_checkpoint, tmp_path):
    assert (llama_checkpoint / "chat_template.jinja").is_file()
    expected = render_chat(load_tokenizer(str(llama_checkpoint)), MESSAGES)
    folder = copy_checkpoint(llama_checkpoint, tmp_path / "in-config")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(folder))
    assert render_chat(tokenizer, MESSAGES) == expected
    text = tokenizer.decode(expected)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_chat_template_override_and_missing_template(llama_checkpoint, tmp_path):
    tokenizer = load_tokenizer(str(llama_checkpoint))
    override = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert tokenizer.decode(render_chat(tokenizer, MESSAGES, chat_template=override)) == (
        "[system] Be brief.\n[user] What is 2+2?\n")
    folder = copy_checkpoint(llama_checkpoint, tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValidationError, match="chat template"):
        render_chat(load_tokenizer(str(folder)), MESSAGES)


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), (["hi"], "messages[0]"), ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
])
def test_bad_messages_name_the_field(llama_checkpoint, messages, param):
    with pytest.raises(ValidationError) as info:
        render_chat(load_tokenizer(str(llama_checkpoint)), messages)
    assert info.value.param == param


def test_text_parts_are_joined(llama_checkpoint):
    tokenizer = load_tokenizer(str(llama_checkpoint))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.decode(render_chat(tokenizer, parts)).startswith("<|im_start|>user\na\nb<|im_end|>")


def render_chat(tokenizer, messages, chat_template=None) -> list[int]:
    return Renderer(tokenizer, len(tokenizer)).render(ChatPrompt(messages, chat_template)).token_ids
