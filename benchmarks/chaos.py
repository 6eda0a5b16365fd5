"""Chaos, naive vs guarded: the same workload and the same faults, with the defences off and on.

Both runs use the same seed, so they get the same requests, the same delivery order and the same
fault schedule (SIGKILLs at the three points, SIGSTOPs past the lease, Redis restarts, dropped
gateway answers, poison payloads). Naive mode has no idempotency claim, no lock, no
``Idempotency-Key`` and acks before it works. Reported per fault: duplicate effects and lost
requests, naive (the baseline) vs guarded; plus the throughput the defences cost, as a ratio
measured in the same run. Draws ``benchmarks/results/chaos_duplicates.png``.

    .venv/bin/python -m benchmarks.chaos [--quick] [--json]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.plotting import RESULTS, pyplot, save
from benchmarks.suite import module_main
from proof.chaos import DEFAULT_FAULTS, ChaosConfig, ChaosReport, run_chaos


def _config(quick: bool, naive: bool) -> ChaosConfig:
    return ChaosConfig(
        requests=150 if quick else 600,
        workers=3 if quick else 4,
        threads=2,
        redelivery=3,
        kills=4 if quick else 12,
        stops=1 if quick else 3,
        redis_restarts=1 if quick else 2,
        faults=DEFAULT_FAULTS,
        naive=naive,
        seed=42,
        timeout=120 if quick else 600,
    )


def _by_fault(report: ChaosReport) -> dict[str, dict[str, int]]:
    return {r["fault"]: r for r in report.rows}


def run(quick: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    reports = {mode: run_chaos(_config(quick, naive=mode == "naive"))
               for mode in ("naive", "guarded")}
    naive, guarded = reports["naive"], reports["guarded"]
    per_fault = []
    n_rows, g_rows = _by_fault(naive), _by_fault(guarded)
    last = {"none": 1, "all": 2}
    for fault in sorted(set(n_rows) | set(g_rows), key=lambda f: (last.get(f, 0), f)):
        n, g = n_rows.get(fault, {}), g_rows.get(fault, {})
        per_fault.append({
            "fault": fault,
            "naive_requests": n.get("requests", 0), "guarded_requests": g.get("requests", 0),
            "naive_duplicates": n.get("duplicates", 0),
            "guarded_duplicates": g.get("duplicates", 0),
            "naive_lost": n.get("lost", 0), "guarded_lost": g.get("lost", 0),
            "guarded_dead_lettered": g.get("dead_lettered", 0),
        })
    n_all, g_all = n_rows["all"], g_rows["all"]
    rate = {mode: r.config["requests"] / max(r.seconds, 1e-9) for mode, r in reports.items()}

    def ratio(value: float, baseline: float) -> float | None:
        return round(value / baseline, 3) if baseline else None

    summary = [
        {"metric": "duplicate effects, guarded vs naive", "value": g_all["duplicates"],
         "unit": "effects", "baseline": n_all["duplicates"],
         "ratio": ratio(g_all["duplicates"], n_all["duplicates"]), "target": "0",
         "ok": g_all["duplicates"] == 0},
        {"metric": "lost requests, guarded vs naive", "value": g_all["lost"], "unit": "requests",
         "baseline": n_all["lost"], "ratio": ratio(g_all["lost"], n_all["lost"]), "target": "0",
         "ok": g_all["lost"] == 0},
        {"metric": "invariant violations, guarded vs naive", "value": len(guarded.violations),
         "unit": "violations", "baseline": len(naive.violations),
         "ratio": ratio(len(guarded.violations), len(naive.violations)), "target": "0",
         "ok": guarded.ok},
        {"metric": "requests per second under chaos (whole run), guarded vs naive",
         "value": round(rate["guarded"], 1), "unit": "requests/s",
         "baseline": round(rate["naive"], 1), "ratio": ratio(rate["guarded"], rate["naive"]),
         "target": None, "ok": True},
    ]
    plot = _plot(per_fault)
    return {
        "summary": summary,
        "per_fault": per_fault,
        "config": {"requests": naive.config["requests"], "redelivery": naive.config["redelivery"],
                   "workers": naive.config["workers"], "threads": naive.config["threads"],
                   "faults": naive.config["faults"], "seed": naive.config["seed"]},
        "runs": {mode: {"seconds": r.seconds, "stats": r.stats, "violations": len(r.violations),
                        "first_violations": r.violations[:5]} for mode, r in reports.items()},
        "plot": str(plot) if plot else None,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def _plot(per_fault: list[dict[str, Any]]) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in per_fault if r["fault"] != "none"]
    names = [r["fault"] for r in rows]
    x = range(len(rows))
    w = 0.2
    fig, ax = plt.subplots(figsize=(11, 4.5))
    series = [("naive_duplicates", "duplicates, naive", "tab:red", -1.5),
              ("guarded_duplicates", "duplicates, guarded", "tab:green", -0.5),
              ("naive_lost", "lost, naive", "tab:orange", 0.5),
              ("guarded_lost", "lost, guarded", "tab:blue", 1.5)]
    for key, label, color, offset in series:
        values = [r[key] for r in rows]
        ax.bar([i + offset * w for i in x], values, width=w, label=label, color=color)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("requests / extra effects")
    ax.set_yscale("symlog", linthresh=1)
    g_dup = sum(r["guarded_duplicates"] for r in rows if r["fault"] == "all")
    g_lost = sum(r["guarded_lost"] for r in rows if r["fault"] == "all")
    ax.set_title(f"chaos: duplicate effects and lost requests per fault "
                 f"(guarded in total: {g_dup} duplicates, {g_lost} lost)")
    ax.legend(fontsize=8)
    return save(fig, RESULTS / "chaos_duplicates.png")


def render(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"chaos naive vs guarded: {c['requests']} requests x {c['redelivery']}, "
          f"{c['workers']} workers x {c['threads']} threads, faults {','.join(c['faults'])}, "
          f"seed {c['seed']}")
    header = (f"{'fault':<20}{'requests':>9}{'dup naive':>11}{'dup guarded':>13}"
              f"{'lost naive':>12}{'lost guarded':>14}{'DLQ guarded':>13}")
    print(header)
    print("-" * len(header))
    for r in result["per_fault"]:
        print(f"{r['fault']:<20}{r['guarded_requests']:>9}{r['naive_duplicates']:>11}"
              f"{r['guarded_duplicates']:>13}{r['naive_lost']:>12}{r['guarded_lost']:>14}"
              f"{r['guarded_dead_lettered']:>13}")
    print()
    for s in result["summary"]:
        print(f"{s['metric']:<52} {s['value']!s:>8} vs {s['baseline']!s:>8} {s['unit']:<12}"
              f" ratio {s['ratio']}  {'ok' if s['ok'] else 'FAIL'}")
    for mode, r in result["runs"].items():
        print(f"{mode}: {r['seconds']}s, {r['stats'].get('dispatches')} dispatches, "
              f"kills {r['stats'].get('kills', 0)}, stops {r['stats'].get('stops', 0)}, "
              f"{r['violations']} violations")
    print(f"plot: {result['plot']}   ({result['elapsed_s']}s)")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
