"""Speculative decoding's figures in the benchmarks: the engine's counters read from a server's /metrics or
from an offline engine's scheduler statistics, differenced over a run and printed as vLLM's bench does."""

from __future__ import annotations

import dataclasses

import httpx

_SPEC_DECODE_SAMPLES = {"quire:spec_decode_num_drafts_total": "num_drafts",
                        "quire:spec_decode_num_draft_tokens_total": "num_draft_tokens",
                        "quire:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
_ACCEPTED_PER_POS_SAMPLE = "quire:spec_decode_num_accepted_tokens_per_pos_total"


@dataclasses.dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's cumulative counters (a server's /metrics or an engine's ``SchedulerStats``,
    summed over engines); a benchmark reports the difference between two readings."""

    num_drafts: int = 0  # verification steps: one per request with proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def from_scheduler_stats(cls, stats) -> SpecDecodeCounts:
        if stats is None:  # no engine step yet
            return cls()
        return cls(stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                   stats.spec_decode_num_accepted_tokens, tuple(stats.spec_decode_num_accepted_tokens_per_pos))

    @classmethod
    def from_prometheus_text(cls, text: str) -> SpecDecodeCounts | None:
        """The counters in a Prometheus exposition, summed over every label but ``position``; None when it
        has none of them (a server without them, or text that does not parse)."""
        from prometheus_client.parser import text_string_to_metric_families

        totals, per_pos, is_found = dict.fromkeys(_SPEC_DECODE_SAMPLES.values(), 0.0), {}, False
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in _SPEC_DECODE_SAMPLES:
                        totals[_SPEC_DECODE_SAMPLES[sample.name]] += sample.value
                    elif sample.name == _ACCEPTED_PER_POS_SAMPLE and sample.labels.get("position", "").isdigit():
                        position = int(sample.labels["position"])
                        per_pos[position] = per_pos.get(position, 0.0) + sample.value
                    else:
                        continue
                    is_found = True
        except ValueError:
            return None
        if not is_found:
            return None
        accepted_per_pos = tuple(round(per_pos.get(i, 0.0)) for i in range(max(per_pos, default=-1) + 1))
        return cls(**{name: round(value) for name, value in totals.items()},
                   num_accepted_tokens_per_pos=accepted_per_pos)

    def since(self, earlier: SpecDecodeCounts) -> SpecDecodeCounts:
        earlier_per_pos = earlier.num_accepted_tokens_per_pos
        return SpecDecodeCounts(
            self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(count - (earlier_per_pos[i] if i < len(earlier_per_pos) else 0)
                  for i, count in enumerate(self.num_accepted_tokens_per_pos)))

    def summary(self) -> dict:
        """vLLM's ``spec_decode_*`` result keys; empty without drafts. The acceptance length counts the
        tokens one verification step yields: the accepted proposals and the one the target model adds."""
        if self.num_drafts <= 0:
            return {}
        return {
            "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1) * 100,
            "spec_decode_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts,
            "spec_decode_num_drafts": self.num_drafts, "spec_decode_draft_tokens": self.num_draft_tokens,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_per_position_acceptance_rates": [count / self.num_drafts
                                                          for count in self.num_accepted_tokens_per_pos],
        }


def read_spec_decode_counts(http: httpx.Client) -> SpecDecodeCounts | None:
    """The server's speculative-decoding counters, or None when /metrics cannot be read or has none."""
    try:
        response = http.get("/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return SpecDecodeCounts.from_prometheus_text(response.text)


def print_spec_decode_section(summary: dict) -> None:
    """vLLM's "Speculative Decoding" rows, from ``SpecDecodeCounts.summary`` keys (nothing without them)."""
    if "spec_decode_num_drafts" not in summary:
        return
    print("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
    print("{:<40} {:<10.2f}".format("Acceptance rate (%):", summary["spec_decode_acceptance_rate"]))
    print("{:<40} {:<10.2f}".format("Acceptance length:", summary["spec_decode_acceptance_length"]))
    print("{:<40} {:<10}".format("Drafts:", summary["spec_decode_num_drafts"]))
    print("{:<40} {:<10}".format("Draft tokens:", summary["spec_decode_draft_tokens"]))
    print("{:<40} {:<10}".format("Accepted tokens:", summary["spec_decode_accepted_tokens"]))
    if summary["spec_decode_per_position_acceptance_rates"]:
        print("Per-position acceptance (%):")
        for position, rate in enumerate(summary["spec_decode_per_position_acceptance_rates"]):
            print("{:<40} {:<10.2f}".format(f"  Position {position}:", rate * 100))
