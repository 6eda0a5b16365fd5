"""Retry storm: 1,000 jobs fail at the same instant, the downstream is out for 30 s, then back.

A discrete-event simulation in virtual time (deterministic per seed, runs in well under a
second per mode) of the delays in :mod:`resources.retry`:

- every job makes its first call at t=0; calls before ``outage`` seconds fail;
- after the outage the downstream serves at most ``capacity`` calls per 1 s window; calls above
  that are refused (overload 503) and are retried like any transient failure: this is what makes
  a synchronised cohort keep failing after the downstream is back;
- policy: capped exponential backoff (base 1 s, cap 60 s), ``max_attempts`` 10, a 600 s time
  budget; a job out of attempts or time is dead-lettered;
- modes: no jitter, Dagster's PLUS_MINUS, full jitter, decorrelated jitter, and full jitter with a
  shared retry budget (token bucket of ``budget_capacity`` tokens, each retry spends one, each
  success refunds 0.1; empty -> the job is dead-lettered with "retry budget exhausted", to be
  replayed later at a controlled rate; that replay is not simulated here).

Reported per mode: peak retries in any 1 s (sliding) window, total calls, time to drain (last
job completed or dead-lettered), completed, dead-lettered, and ratios against "none".

Run: ``.venv/bin/python -m benchmarks.retry_storm [--quick]``. Writes
``benchmarks/results/retry_storm.png`` (arrivals per second over time, per mode).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.plotting import RESULTS, pyplot, save
from benchmarks.suite import module_main
from proof.retry_storm import Scenario, simulate

MODES: dict[str, tuple[str, bool]] = {
    "none": ("none", False),
    "plus_minus (Dagster)": ("plus_minus", False),
    "full": ("full", False),
    "decorrelated": ("decorrelated", False),
    "full+budget": ("full", True),
}


def run(quick: bool = False) -> dict[str, Any]:
    scenario = Scenario()
    seeds = [1] if quick else [1, 2, 3, 4, 5]
    started = time.perf_counter()
    modes: dict[str, dict[str, Any]] = {}
    arrivals: dict[str, list[float]] = {}
    for name, (jitter, budget) in MODES.items():
        runs = [simulate(scenario, jitter, budget, seed) for seed in seeds]
        arrivals[name] = runs[0]["arrivals"]
        modes[name] = {
            key: statistics.mean(r[key] for r in runs)
            for key in ("peak_retries_1s", "peak_calls_after_recovery_1s",
                        "refused_after_recovery", "total_calls", "time_to_drain_s",
                        "completed", "dead_lettered", "dlq_replays")
        }
        modes[name]["dead_letter_reasons"] = runs[0]["dead_letter_reasons"]
    baseline = modes["none"]
    for values in modes.values():
        values["ratios_vs_none"] = {
            key: round(values[key] / baseline[key], 3) if baseline[key] else None
            for key in ("peak_retries_1s", "peak_calls_after_recovery_1s",
                        "refused_after_recovery", "total_calls", "time_to_drain_s")
        }
    plot = _plot(arrivals, scenario)
    return {
        "summary": [
            {"metric": f"{name}: peak calls/s after recovery (drain {m['time_to_drain_s']:.0f} s,"
             f" dead-lettered {m['dead_lettered']:.0f})",
             "value": m["peak_calls_after_recovery_1s"], "unit": "calls/s",
             "baseline": "no jitter", "ratio": m["ratios_vs_none"]["peak_calls_after_recovery_1s"],
             "target": None, "ok": None}
            for name, m in modes.items()
        ],
        "scenario": scenario.__dict__,
        "seeds": seeds,
        "modes": modes,
        "plot": str(plot) if plot else None,
        "elapsed_s": round(time.perf_counter() - started, 2),
    }


def _plot(arrivals: dict[str, list[float]], scenario: Scenario) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    horizon = int(max(max(a) for a in arrivals.values())) + 2
    fig, axes = plt.subplots(len(arrivals), 1, figsize=(11, 2.2 * len(arrivals)), sharex=True)
    for ax, (name, times) in zip(axes, arrivals.items(), strict=True):
        counts = [0] * horizon
        for t in times:
            counts[int(t)] += 1
        ax.bar(range(horizon), counts, width=1.0, color="tab:blue")
        ax.axvspan(0, scenario.outage, color="tab:red", alpha=0.12)
        ax.axhline(scenario.capacity, color="tab:green", linestyle="--", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylabel("calls/s")
        ax.set_title(name, loc="left", fontsize=9)
    axes[-1].set_xlabel("seconds (red: outage; green: downstream capacity)")
    fig.suptitle(f"retry storm: {scenario.jobs} jobs, {scenario.outage:.0f}s outage")
    return save(fig, RESULTS / "retry_storm.png")


def render(result: dict[str, Any]) -> None:
    s = result["scenario"]
    print(f"retry storm: {s['jobs']} jobs, {s['outage']:.0f}s outage, capacity "
          f"{s['capacity']}/s after, base {s['base']}s cap {s['cap']}s, max_attempts "
          f"{s['max_attempts']}, seeds {result['seeds']}")
    header = (f"{'mode':<22}{'peak/1s':>9}{'x none':>8}{'peak>rec':>9}{'x none':>8}"
              f"{'refused':>8}{'calls':>8}{'x none':>8}{'drain s':>9}{'x none':>8}"
              f"{'done':>6}{'DLQ':>5}{'replays':>8}")
    print(header)
    print("-" * len(header))
    for name, m in result["modes"].items():
        r = m["ratios_vs_none"]
        print(f"{name:<22}{m['peak_retries_1s']:>9.0f}{r['peak_retries_1s']:>8.2f}"
              f"{m['peak_calls_after_recovery_1s']:>9.0f}"
              f"{r['peak_calls_after_recovery_1s']:>8.2f}{m['refused_after_recovery']:>8.0f}"
              f"{m['total_calls']:>8.0f}{r['total_calls']:>8.2f}{m['time_to_drain_s']:>9.1f}"
              f"{r['time_to_drain_s']:>8.2f}{m['completed']:>6.0f}{m['dead_lettered']:>5.0f}"
              f"{m['dlq_replays']:>8.0f}")
    print("peak/1s: retries in any 1 s window; peak>rec: calls in any 1 s window after the "
          "outage (capacity " f"{s['capacity']}/s); refused: calls refused for overload after it")
    print(f"plot: {result['plot']}   ({result['elapsed_s']}s)")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
