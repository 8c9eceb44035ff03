"""``bench-peers --serving-repeats``: each server's median round and the round-by-round ratios it prints (the
benchmark's servers are not started here: the rounds are made up)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import peers  # noqa: E402
from peers_serving import ServingLoad, median_round  # noqa: E402


def summary(rate: float, ttft: float = 1.0) -> dict:
    return {"output_throughput": rate, "p50_ttft_ms": ttft, "p99_ttft_ms": ttft, "p50_itl_ms": 3.0,
            "p99_itl_ms": 4.0, "server_cpu_us_per_token": 5.0}


def test_median_round_takes_each_server_s_middle_run():
    rounds = [{"Quire bfloat16": summary(900, ttft=10), "vLLM best bfloat16": summary(600, ttft=20)},
              {"Quire bfloat16": summary(1000, ttft=11), "vLLM best bfloat16": summary(650, ttft=21)},
              {"Quire bfloat16": summary(950, ttft=12), "vLLM best bfloat16": summary(700, ttft=22)}]
    chosen = median_round(rounds)
    assert list(chosen) == ["Quire bfloat16", "vLLM best bfloat16"]
    assert chosen["Quire bfloat16"]["p50_ttft_ms"] == 12  # the 950 round: the whole summary of one round
    assert chosen["vLLM best bfloat16"]["output_throughput"] == 650


def test_median_round_over_the_rounds_a_server_ran_lower_middle_when_even():
    rounds = [{"Quire bfloat16": summary(900), "vLLM best bfloat16": summary(600)},
              {"Quire bfloat16": summary(1000)},  # vLLM's server failed this round
              {"vLLM best bfloat16": summary(700)}]
    chosen = median_round(rounds)
    assert chosen["Quire bfloat16"]["output_throughput"] == 900
    assert chosen["vLLM best bfloat16"]["output_throughput"] == 600


def test_print_serving_pairs_each_round(capsys):
    rounds = [{"Quire bfloat16": summary(900), "vLLM best bfloat16": summary(600)},
              {"Quire bfloat16": summary(1000), "vLLM best bfloat16": summary(500), "vLLM default": summary(550)},
              {"vLLM best bfloat16": summary(580)},  # Quire's server failed: no pair
              {"Quire bfloat16": summary(800), "vLLM best bfloat16": summary(640)}]
    peers.print_serving(rounds, ServingLoad(), "T")
    out = capsys.readouterr().out
    assert "the median of 4 rounds" in out
    assert "round 1: Quire bfloat16 900.0 tok/s, best vLLM 600.0: 1.50x" in out
    assert "round 2: Quire bfloat16 1000.0 tok/s, best vLLM 550.0: 1.82x" in out  # the best vLLM of that round
    assert "round 3:" not in out
    assert "round 4: Quire bfloat16 800.0 tok/s, best vLLM 640.0: 1.25x" in out
    assert "median 1.50x, 1.25-1.82x over 3 rounds" in out


def test_print_serving_one_round_prints_no_rounds(capsys):
    peers.print_serving([{"Quire bfloat16": summary(900), "vLLM best bfloat16": summary(600)}], ServingLoad(), "T")
    out = capsys.readouterr().out
    assert "served output tok/s / best vLLM server's: 1.50x" in out
    assert "round 1" not in out and "median of" not in out
