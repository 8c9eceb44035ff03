"""How a data-parallel client turns what each engine core reports into the one answer a front end expects
from a single engine (pure Python).

Rules, for utility answers and scheduler statistics alike: counts and seconds are summed (a group of engines
holds the sum of their requests and blocks, and has done the sum of their steps: step timings become
engine-seconds, which may exceed the wall time since the engines run at once); ``kv_cache_usage`` is the
used share of all the group's blocks; lists are joined. ``reset_prefix_cache`` is true only if every engine
reset its cache, and the idle check passes only if it passes on every engine. ``get_stats`` also lists each
engine's own answer under ``engines``, in rank order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import msgspec

from quire.core.wire import SchedulerStats


def sum_reports(reports: list[dict[str, Any]], num_blocks: list[int]) -> dict[str, Any]:
    """One report from several engines' reports (same keys), by the rules above; ``num_blocks`` is each
    engine's number of KV blocks, which weighs its ``kv_cache_usage``."""
    combined: dict[str, Any] = {}
    for key, first in reports[0].items():
        values = [report[key] for report in reports]
        if key == "kv_cache_usage":
            total_blocks = sum(num_blocks)
            combined[key] = sum(u * n for u, n in zip(values, num_blocks)) / total_blocks if total_blocks else 0.0
        elif key.endswith("_per_pos"):  # counts by position: added position by position
            combined[key] = [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
        elif isinstance(first, list):
            combined[key] = [item for value in values for item in value]
        elif isinstance(first, bool) or not isinstance(first, (int, float)):
            combined[key] = first  # not a quantity: the same on every engine
        else:
            combined[key] = sum(values)
    return combined


def combine_scheduler_stats(latest: list[SchedulerStats | None], current: SchedulerStats,
                            num_blocks: list[int]) -> SchedulerStats:
    """The group's statistics from each engine's latest snapshot (``current`` is the one that just came in,
    and its own structured-output compile times: the only per-snapshot field)."""
    reported = [(msgspec.structs.asdict(stats), blocks)
                for stats, blocks in zip(latest, num_blocks) if stats is not None]
    combined = sum_reports([report for report, _ in reported], [blocks for _, blocks in reported])
    combined["structured_output_compile_seconds"] = current.structured_output_compile_seconds
    return SchedulerStats(**combined)


def _get_stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    combined = sum_reports(results, [result["num_blocks"] for result in results])
    combined["engines"] = results
    return combined


# One rule per utility method (``core_client.UTILITY_METHODS``); a test keeps the two lists equal.
COMBINE_RULES: dict[str, Callable[[list[Any]], Any]] = {
    "reset_prefix_cache": all,
    "check_idle_invariants": all,
    "get_stats": _get_stats,
    "get_step_timings": lambda results: sum_reports(results, [0] * len(results)),
}


def combine_utility_results(method: str, results: list[Any]) -> Any:
    """Every engine's answer to ``method`` (in rank order) as one answer."""
    return COMBINE_RULES[method](results)
