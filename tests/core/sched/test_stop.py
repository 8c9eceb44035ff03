from quire.core.request import FinishReason
from tests.core.sched.helpers import EOS, make_request, make_scheduler, run_step


def run_to_end(request, tokens, max_model_len=256):
    """Feed ``tokens`` one per step; return (new token ids seen, final output)."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(request)
    feed = iter(tokens)
    seen = []
    for _ in range(len(tokens)):
        _, outputs = run_step(scheduler, token=lambda r: next(feed))
        for output in outputs:
            seen += output.new_token_ids
            if output.finished:
                return seen, output
    raise AssertionError("request did not finish")


def test_eos_stops_with_no_stop_reason():
    seen, output = run_to_end(make_request("a", 3), [5, 6, EOS, 8])
    assert seen == [5, 6, EOS] and output.finish_reason == FinishReason.STOP
    assert output.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    seen, output = run_to_end(make_request("a", 3, ignore_eos=True, max_tokens=4), [EOS, EOS, 5, 6, 7])
    assert seen == [EOS, EOS, 5, 6] and output.finish_reason == FinishReason.LENGTH


def test_stop_token_id_is_the_stop_reason():
    seen, output = run_to_end(make_request("a", 3, stop_token_ids=[9]), [5, 9, 6])
    assert seen == [5, 9] and output.finish_reason == FinishReason.STOP and output.stop_reason == 9


def test_min_tokens_defers_eos_and_stop_tokens():
    seen, output = run_to_end(make_request("a", 3, min_tokens=3, stop_token_ids=[9]), [EOS, 9, 4, 9])
    assert seen == [EOS, 9, 4, 9] and output.stop_reason == 9


def test_max_tokens_is_a_length_finish():
    seen, output = run_to_end(make_request("a", 3, max_tokens=2), [5, 6, 7])
    assert seen == [5, 6] and output.finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_the_sequence():
    seen, output = run_to_end(make_request("a", 6, max_tokens=100), [5] * 10, max_model_len=9)
    assert len(seen) == 3 and output.finish_reason == FinishReason.LENGTH
