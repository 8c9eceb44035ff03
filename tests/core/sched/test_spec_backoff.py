"""Speculation back-off: requests whose proposals are mostly rejected pause, for longer each time in a row."""

from quire.core.spec_decode.backoff import SpeculationBackoff


def test_low_acceptance_pauses_a_request_and_doubles_the_pause():
    backoff = SpeculationBackoff(window=4, min_accepted_per_step=0.5, pause_steps=8, max_pause_steps=16)
    for step in range(1, 5):  # 1 accepted token in 4 steps: below 0.5 per step
        assert backoff.allows("a", step)
        backoff.record("a", 1 if step == 1 else 0, step)
    assert not backoff.allows("a", 5) and not backoff.allows("a", 12)
    assert backoff.allows("a", 13)  # 8 steps paused
    for step in range(13, 17):
        backoff.record("a", 0, step)
    assert not backoff.allows("a", 32) and backoff.allows("a", 33)  # 16 steps the second time
    for step in range(33, 37):
        backoff.record("a", 0, step)
    assert backoff.allows("a", 53) and not backoff.allows("a", 52)  # capped at max_pause_steps
    assert backoff.num_pauses == 3
    assert backoff.allows("b", 5)  # other requests are not affected


def test_good_acceptance_never_pauses_and_resets_the_doubling():
    backoff = SpeculationBackoff(window=4, min_accepted_per_step=0.5, pause_steps=8)
    for step in range(1, 41):
        backoff.record("a", 2, step)
        assert backoff.allows("a", step + 1)
    for step in range(41, 45):
        backoff.record("a", 0, step)
    assert not backoff.allows("a", 45) and backoff.allows("a", 53)
    for step in range(53, 57):
        backoff.record("a", 3, step)  # a good window ends the run of pauses
    for step in range(57, 61):
        backoff.record("a", 0, step)
    assert backoff.allows("a", 69)  # 8 steps again, not 16
    backoff.remove_requests(["a"])
    assert backoff.records == {}
