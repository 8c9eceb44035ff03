"""The n-gram (prompt-lookup) proposer against hand-made sequences and a plain-Python reference."""

import subprocess
import sys
import time

import numpy as np
import pytest

from quire.core.spec_decode.ngram import NgramProposer


def propose(tokens, k=3, lookup_min=1, lookup_max=3):
    proposal = NgramProposer(k, lookup_min, lookup_max).propose(np.array(tokens, dtype=np.int32))
    assert proposal.dtype == np.int64
    return proposal.tolist()


def reference_propose(tokens, k, lookup_min, lookup_max):
    """Straight from the definition: longest tail first, then the latest earlier occurrence."""
    for n in range(lookup_max, lookup_min - 1, -1):
        tail = tokens[len(tokens) - n:] if n <= len(tokens) else None
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # Tail 1 2 3: "1 2 3" occurs at 0 (followed by 7 8); "2 3" alone occurs later, followed by 9.
    assert propose([1, 2, 3, 7, 8, 5, 2, 3, 9, 1, 2, 3]) == [7, 8, 5]


def test_most_recent_earlier_occurrence_wins():
    assert propose([4, 5, 10, 11, 4, 5, 20, 21, 6, 4, 5], k=2, lookup_max=2) == [20, 21]


def test_continuation_shorter_than_k_gives_fewer_tokens():
    assert propose([1, 2, 9, 1, 2], k=5, lookup_min=2, lookup_max=2) == [9, 1, 2]
    # Periodic tail: the latest occurrence of "1 2" is two tokens before the end.
    assert propose([1, 2, 1, 2, 1, 2], k=5, lookup_min=2, lookup_max=2) == [1, 2]


def test_the_suffix_itself_is_not_an_earlier_occurrence():
    assert propose([7, 8, 9], lookup_min=1, lookup_max=3) == []
    assert propose([5, 6, 7, 5, 6], lookup_min=2, lookup_max=2) == [7, 5, 6]
    # Overlapping the suffix is allowed: in 3 3 3 the tail "3 3" also ends at position 1.
    assert propose([3, 3, 3], k=4, lookup_min=2, lookup_max=2) == [3]


def test_match_may_start_at_the_first_token():
    assert propose([1, 2, 8, 1, 2], lookup_min=1, lookup_max=5) == [8, 1, 2]


def test_sequences_shorter_than_min_and_empty_ones():
    assert propose([], lookup_min=1) == []
    assert propose([4], lookup_min=1) == []
    assert propose([4, 4], lookup_min=2, lookup_max=3) == []
    assert propose([4, 4], lookup_min=1, lookup_max=3) == [4]


def test_no_match_or_only_shorter_than_min_gives_nothing():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 9, 3], lookup_min=2, lookup_max=3) == []


def test_propose_batch_skips_rows():
    proposer = NgramProposer(2, 1, 2)
    sequences = [np.array([1, 2, 3, 1, 2]), np.array([5, 6, 5]), np.array([7, 8])]
    proposals = proposer.propose_batch(sequences, skip=[False, True, False])
    assert [p.tolist() for p in proposals] == [[3, 1], [], []]
    assert [p.tolist() for p in proposer.propose_batch(sequences)] == [[3, 1], [6, 5], []]
    assert proposer.propose_batch([]) == []
    with pytest.raises(ValueError, match="skip"):
        proposer.propose_batch(sequences, skip=[True])


@pytest.mark.parametrize("arguments,name", [
    ((0, 1, 3), "num_speculative_tokens"),
    ((2, 0, 3), "prompt_lookup_min"),
    ((2, 4, 3), "prompt_lookup_max"),
])
def test_invalid_arguments_name_the_argument(arguments, name):
    with pytest.raises(ValueError, match=name):
        NgramProposer(*arguments)


def test_matches_the_reference_on_random_sequences():
    rng = np.random.default_rng(25)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        k = int(rng.integers(1, 6))
        lookup_min = int(rng.integers(1, 4))
        lookup_max = int(rng.integers(lookup_min, 7))
        expected = reference_propose(tokens, k, lookup_min, lookup_max)
        assert propose(tokens, k, lookup_min, lookup_max) == expected, (tokens, k, lookup_min, lookup_max)


def test_imports_no_torch():
    code = ("import sys, quire.core.spec_decode.ngram; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_time_per_call():
    """Reports the cost per call (run with -s); no threshold, the machine is shared. Two workloads: a
    large vocabulary with the tail copied from the middle, and the worst case, one token repeated (every
    position is a candidate for every n)."""
    rng = np.random.default_rng(0)
    proposer = NgramProposer(5, 2, 5)
    for length in (100, 1_000, 8_000):
        copying = rng.integers(0, 32_000, size=length)
        copying[-3:] = copying[length // 2:length // 2 + 3]
        for name, tokens in (("copying", copying), ("one token repeated", np.zeros(length, dtype=np.int64))):
            repeats = 1_000
            started = time.perf_counter()
            for _ in range(repeats):
                proposer.propose(tokens)
            microseconds = (time.perf_counter() - started) / repeats * 1e6
            print(f"\nNgramProposer.propose, L={length}, {name}: {microseconds:.1f} us per call")
