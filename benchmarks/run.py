"""Run every benchmark: ``python -m benchmarks.run [--quick] [--out benchmarks/results]``.

Prints a table of ratios, and writes ``results.json`` and ``report.md`` to ``--out``.
``--quick`` is the smoke mode CI runs: tiny sizes, a few repeats; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

from benchmarks import dense_hook, fallback

log = logging.getLogger("benchmarks")
BENCHMARKS = {"fallback": fallback.run, "dense_hook": dense_hook.run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny sizes, seconds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", help="run only these")
    args = parser.parse_args()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"machine": _machine(), "quick": args.quick, "benchmarks": {}}
    for name in args.only or sorted(BENCHMARKS):
        started = time.perf_counter()
        log.info("running %s%s ...", name, " (quick)" if args.quick else "")
        results["benchmarks"][name] = BENCHMARKS[name](args.quick)
        log.info("  done in %.1f s", time.perf_counter() - started)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report = _report(results)
    (args.out / "report.md").write_text(report)
    print(report)


def _machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def _report(results: dict) -> str:
    lines = [f"# Benchmark report{' (quick smoke mode: numbers mean nothing)' if results['quick'] else ''}", "",
             f"Machine: {results['machine']}", ""]
    for name, result in results["benchmarks"].items():
        lines += [f"## {name}", "", f"Setup: {result['setup']}", "", "| ratio | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f}x |" for k, v in result["ratios"].items()]
        lines += ["", "| peer | median s | p25 s | p75 s |", "| --- | --- | --- | --- |"]
        lines += [f"| {p} | {t['median_s']:.4f} | {t['p25_s']:.4f} | {t['p75_s']:.4f} |" for p, t in result["timings"].items()]
        if "scaling" in result:
            lines += ["", "| table rows | median s | / smallest |", "| --- | --- | --- |"]
            lines += [f"| {k} | {v['median_s']:.4f} | {v['ratio_to_smallest']:.2f}x |" for k, v in result["scaling"].items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
