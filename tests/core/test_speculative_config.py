"""``SpeculativeConfig.parse``: vLLM's ``speculative_config`` shape, from JSON text or a dict, with errors that
name the field."""

import pytest

from quire.core.config import SpeculativeConfig
from quire.core.errors import ConfigError


def test_ngram_from_json_text_and_dict():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    config = SpeculativeConfig.parse(text)
    assert config == SpeculativeConfig("ngram", 4, 2, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig("ngram", 3)


def test_disable_by_batch_size_defaults_and_may_be_lifted():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).disable_by_batch_size == 8
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert config.disable_by_batch_size is None


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_checkpoint):
    from quire.core.demo import default_model
    from quire.core.engine_args import EngineArgs

    def engine_config(draft):
        return EngineArgs(model=tiny_checkpoint("llama"), speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 2}).create_engine_config()

    config = engine_config(tiny_checkpoint("qwen2"))
    draft = config.speculative.draft_model_config
    assert draft.architecture == "Qwen2ForCausalLM"
    assert (draft.dtype, draft.max_model_len) == (config.model.dtype, config.model.max_model_len)
    with pytest.raises(ConfigError, match="another tokenizer"):
        engine_config(str(default_model().path))
    with pytest.raises(ConfigError, match="does not exist"):
        engine_config("/no/such/draft")


def test_draft_model_needs_its_folder():
    config = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 2})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/models/draft", 2)
    with pytest.raises(ConfigError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.parametrize(("value", "field"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "only for method draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model_config": {}}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "8"}, "disable_by_batch_size"),
])
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig.parse(value)
