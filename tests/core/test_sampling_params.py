import msgspec
import pytest

from quire.core.errors import ValidationError
from quire.core.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("n", 0),
    ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"),
])
def test_invalid_values_raise_a_validation_error_naming_the_field(field, value):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValidationError, match="min_tokens") as info:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert info.value.param == "min_tokens"


def test_stop_is_normalised_and_survives_the_wire():
    params = SamplingParams(stop="###", seed=3, max_tokens=None)
    assert params.stop == ["###"]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and decoded.max_tokens is None
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
