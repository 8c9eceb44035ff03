"""The offline LLM class: ordering, per-prompt parameters, chat, tokenizer access, progress."""

import pytest

from quire.offline import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, dtype="float32", max_model_len=256, max_num_seqs=4)


def test_outputs_come_back_in_input_order_with_their_own_parameters(llm):
    prompts = ["def main():", "import os", "x = [", "class A:", "return", "while True:"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 7, 1, 5, 3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 2, 7, 1, 5, 3]
    single = llm.generate("import os", params[1], use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_text_and_token_id_prompts_agree(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("for item in items:")
    params = SamplingParams(temperature=0, max_tokens=6)
    by_text, by_ids, by_dict = llm.generate(
        ["for item in items:", ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert by_text.prompt_token_ids == ids == by_ids.prompt_token_ids
    assert by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids)


def test_chat_renders_one_or_many_conversations(llm):
    conversation = [{"role": "user", "content": "Hello"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    (one,) = llm.chat(conversation, params, use_tqdm=False)
    many = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], params, use_tqdm=False)
    expected_prompt = llm.get_tokenizer().encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert one.prompt_token_ids == expected_prompt == many[0].prompt_token_ids
    assert one.outputs[0].token_ids == many[0].outputs[0].token_ids


def test_progress_bar_reports_requests_and_token_rates(llm, capsys):
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "3/3" in err and "output" in err and "tok/s" in err


def test_a_text_only_model_refuses_images_before_any_engine_work(llm):
    from quire.core.errors import ValidationError
    from quire.core.testing.multimodal_checkpoints import sample_image as make_image

    image = make_image(8, 8)
    with pytest.raises(ValidationError) as error:
        llm.generate({"prompt": "hi <image>", "multi_modal_data": {"image": image}}, use_tqdm=False)
    assert error.value.param == "multi_modal_data.image" and "text only" in error.value.message
    with pytest.raises(ValidationError) as error:
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                               {"type": "text", "text": "What is it?"}]}], use_tqdm=False)
    assert error.value.param == "messages[0].content[0]"
    assert not llm.llm_engine.has_unfinished_requests()
