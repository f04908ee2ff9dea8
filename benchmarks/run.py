"""Run every benchmark: ``python -m benchmarks.run [--quick] [--out benchmarks/results] [--docs docs/benchmarks.md]``.

Prints a table of ratios (each against its target), and writes ``results.json``,
``report.md`` and the PNG plots to ``--out``; ``--docs`` also writes the report
there. ``--quick`` is the smoke mode CI runs: tiny sizes, a few repeats, and every
multi-rank part in one spawned group of ranks (``benchmarks._timing.on_ranks``: 117 s
to 27 s here); its numbers mean nothing.

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless set): with the default
spinning, an operator's two threads on this shared 2-core machine stall each other whenever
another job holds a core, and steps took 7-10x longer (SparseAdam 145 ms instead of 20 ms)
in whichever peer was unlucky, so ratios swung from 0.7 to 2.1 between runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when OpenMP starts: before torch is imported

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    accumulation, clipping, dense_hook, ec_vs_torchrec, fallback, fsdp, layerwise, limit, local_sgd, lost,
    many_tables, precision, round_phases,
    scaling, sparse_vs_torchrec, tensor_parallel, virtual_groups,
)

log = logging.getLogger("benchmarks")
MODULES = {
    "sparse_vs_torchrec": sparse_vs_torchrec,
    "ec_vs_torchrec": ec_vs_torchrec,
    "fallback": fallback,
    "dense_hook": dense_hook,
    "limit": limit,
    "scaling": scaling,
    "virtual_groups": virtual_groups,
    "layerwise": layerwise,
    "local_sgd": local_sgd,
    "clipping": clipping,
    "accumulation": accumulation,
    "fsdp": fsdp,
    "round_phases": round_phases,
    "precision": precision,
    "many_tables": many_tables,
    "tensor_parallel": tensor_parallel,
    "lost": lost,
}
FULL_COMMAND = ".venv/bin/python -m benchmarks.run --out benchmarks/results --docs docs/benchmarks.md"
QUICK_COMMAND = ".venv/bin/python -m benchmarks.run --quick --out /tmp/bench"
REPORT_COMMAND = FULL_COMMAND + " --report-only"

# What each benchmark's numbers mean, and why a missed target is missed: one short paragraph each
# (shown under the benchmark's heading). Past runs live in git history and results.json.
NOTES = {
    "lost": (
        "The cost every process that annotates pays so that torch's own `fully_shard` is refused at its first "
        "forward, not left to train nothing: a global forward pre-hook takes each module call off "
        "`Module.__call__`'s fast path. It is a fixed cost per module call, so it shows against modules that "
        "do almost nothing (`tiny`) and vanishes against real layers (`tower`)."
    ),
    "many_tables": (
        "Both peers run FBGEMM's lookup and TorchRec's collectives with the same kernels; ours steps them with "
        "our compiled backward, and checks live settings once per annotation group, only when they change. "
        "`state_dict()` is held to 50 ms, not to a ratio: ours builds its torch.optim-form, plan-independent state "
        "dict at each call, where stock's fused optimizer hands back ShardedTensors made at sharding. At T = 8 the "
        "step is a few milliseconds, where our per-module work (the round, the hooks) shows; the build at T = 1024 "
        "is TorchRec's own for 90% of it, and one build moves 10-20% between runs (the median of 3 is reported)."
    ),
    "layerwise": (
        "Each rank's Adafactor step costs its touched rows plus two passes over its shard (the weight's norm and "
        "weight decay); torch's Adafactor on the whole table makes about ten passes over a dense gradient the "
        "table's size. The 2 ranks share the 2 cores, as the one-process peer's 2 threads do. One extra "
        "all-reduce per step, whatever the number of layer-wise tables. The setup's 1e-4 weight difference is "
        "torch's float32 `norm()`, 0.6% off on this table; ours sums in float64."
    ),
    "local_sgd": (
        "The dense part's all-reduce bytes fall by the period (one flattened all-reduce of the parameters "
        "every H steps, none on the local steps in between). Gloo on one machine makes communication cheap, "
        "so the step time gains less than the bytes do; across machines the bytes are what costs."
    ),
    "sparse_vs_torchrec": (
        "Both peers run FBGEMM's lookup and TorchRec's collectives. The fused tables' backward is ours "
        "(`sharders/fused_rows.py`): one radix sort of each kernel's ids, then blocks of touched rows, their "
        "gradients summed from the output gradient while the next block is prefetched, stepped in place with "
        "torch.optim's arithmetic. `ours_fbgemm_backward` is ours with FBGEMM's backward, as where the extension "
        "is not built. What bounds the ratio now is the part every peer shares: all-to-alls, lookup, autograd."
    ),
    "ec_vs_torchrec": (
        "The EmbeddingCollection form of sparse_vs_torchrec: FBGEMM's unpooled lookup and TorchRec's "
        "collectives for both peers, our compiled backward against FBGEMM's. FBGEMM's unpooled CPU backward is "
        "its slowest and most of stock's step, hence a lower ratio than the pooled case; the rest is what both "
        "peers share."
    ),
    "fallback": (
        "Dense Adam touches the whole table every step; SparseAdam and the fallback only the touched rows, so "
        "step time should stay flat in the table size. Adam and AdamW tables step in one compiled pass "
        "(`overlap_optim/row_pass.py`): sort the ids, then per touched row sum its gradients, run torch's Adam "
        "arithmetic and write back in place. Without a C++ compiler at install, the slower gather, step and "
        "scatter path runs, with the same results."
    ),
    "dense_hook": (
        "Ours steps in the comm hook with torch's fused CPU kernel, one call per distinct setting. **Why 2x "
        "against torch's in-backward loop is missed:** forward and backward dominate every peer's step; the "
        "update-cost ratios show the hook's own gain. **Why batch 256 reads about 1 against DDP + fused Adam:** "
        "on 2 shared cores the hook's update competes with backward instead of overlapping it; a spare core or "
        "a GPU stream is where the overlap pays."
    ),
    "limit": (
        "The byte counts are lower bounds (each looked-up row read once, each touched row and its state read "
        "and written once), so the fractions flatter every kernel. **Why both targets are missed:** scattered "
        "256-byte row updates in tables far larger than the caches are bound by memory latency (cache and TLB "
        "misses), not bandwidth; our sharded path also pays the lookup, TorchRec's dists "
        "and autograd around its pass, so even a free update would barely reach 0.25."
    ),
    "scaling": (
        "Cost should follow the touched rows: flat in the table size, at most linear in the batch. The fused "
        "kernel (one float of state per row) grows little; the fallback grows at 4M rows, where its random row "
        "accesses into three 1 GB tensors (weight, exp_avg, exp_avg_sq) miss caches and TLB. Below linear in "
        "the batch means fixed per-step costs (input dist, Python) are amortised."
    ),
    "virtual_groups": (
        "All peers run one thread: they differ in grouping only. Dense: ours makes one fused-kernel call per "
        "distinct learning rate, so 48 cost about what one does. **Why 2x against DDP + foreach Adam is "
        "missed:** forward and backward are about half of that peer's step, so even a free update would give "
        "only about 2.2x; the update-cost ratio shows the update's own gain. Sparse: one fallback kernel, one "
        "lookup, for the 6 tables of a virtual group instead of 6."
    ),
    "fsdp": (
        "Ours steps each FSDP group's local shards right after its reduce-scatter, in one multi-tensor AdamW "
        "update; torch's AdamW over the DTensor parameters runs after backward. Each rank holds half the DDP "
        "path's optimizer state. FSDP2 itself costs more than DDP here: gathers and reduce-scatters over gloo, "
        "on the 2 cores that compute. Under FSDP2 as under DDP, every rank orthogonalises each whole Muon "
        "update; handing each matrix to one rank would divide that cost by the world size."
    ),
    "tensor_parallel": (
        "Both peers run the same tensor-parallel forward and backward; they differ in the update. Ours steps "
        "each piece in backward and sums the whole-tensor statistics in one all-reduce (Muon gathers each "
        "matrix in it); the peer gathers every gradient whole and steps full copies after backward, so every "
        "rank holds the whole state. Adafactor's state is factored: a weight split along its rows keeps its "
        "column factor whole on every rank, so its state ratio sits above 1/TP; Muon's momentum is element-wise "
        "and splits as the weight does. **Why Muon's 1 is missed:** its gather is the round's all-reduce of the "
        "whole matrix in float64, zeros outside each piece: four times the bytes of the peer's float32 "
        "all-gather; both then orthogonalise every matrix on every rank."
    ),
    "clipping": (
        "Each clipped peer clips by the global 2-norm at 0.3x its first step's norm, so the bound binds every "
        "step. Sparse: clipped fused tables stay fused, their backward split into two halves around the norm. "
        "**Why 1.10 is missed:** the summing that one pass "
        "hides under the update's memory latency is paid in full before the norm, and the exact norm needs that "
        "split. Dense: `ours_clipped / ours` is the overlap given up by waiting for the norm."
    ),
    "round_phases": (
        "**The counts are the claim; the step times cannot show it here.** Rounds of one phase and process "
        "group share one all-reduce: `separate` (2 clipping sets, 3 modules) issues 1 CLIP and 1 STATISTICS "
        "all-reduce per step. One gloo all-reduce of a float64 costs about 0.1 ms, inside this machine's "
        "run-to-run spread; across machines each costs its network latency. `separate / one_module` is the "
        "cost of 3 sharded modules, each with its own dists."
    ),
    "precision": (
        "One 4M x 64 Adam table, row_wise on 2 ranks. Peak RSS falls less than the table's bytes (0.50x and "
        "0.83x): the process itself (torch, TorchRec) holds about 0.3 GiB. The FP32 table steps in one compiled "
        "pass (float32 only); FP16 and BF16 tables gather their rows, step float32 copies and pool in plain "
        "torch, hence slower. Row-wise Adagrad on FP16: both peers fuse it, our compiled backward (one "
        "rounding) against FBGEMM's."
    ),
    "accumulation": (
        "Both peers run 4 micro-batches per round. A window makes one update where 4 steps make 4, and fused "
        "tables run one backward over the concatenated micro-batches, so `window / 4 steps` is below 1. The "
        "embedding all-to-alls still run at every micro-batch: TorchRec has no `no_sync` for sharded tables. "
        "`window_fallback`, the other exact route for fused tables, is slower and holds more: the fallback sums "
        "every table's touched rows at every micro-batch. What a window holds grows linearly in k."
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny sizes, seconds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    parser.add_argument("--docs", type=Path, default=None, help="also write the report here")
    parser.add_argument("--only", choices=sorted(MODULES), action="append", help="run only these")
    parser.add_argument("--report-only", action="store_true", help="rewrite the reports from <out>/results.json")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads((args.out / "results.json").read_text())
        _write_reports(results, args)
        print(ratio_table(results))
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"machine": _machine(), "quick": args.quick, "date": datetime.date.today().isoformat(),
               "benchmarks": {}, "seconds": {}}
    for name in args.only or list(MODULES):
        started = time.perf_counter()
        log.info("running %s%s ...", name, " (quick)" if args.quick else "")
        run = MODULES[name].run
        plots = name in ("scaling", "many_tables")
        results["benchmarks"][name] = run(args.quick, args.out) if plots else run(args.quick)
        results["seconds"][name] = time.perf_counter() - started
        log.info("  done in %.1f s", results["seconds"][name])
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    _write_reports(results, args)
    print(ratio_table(results))


def _write_reports(results: dict, args: argparse.Namespace) -> None:
    plots = _plots(results, args.out)
    (args.out / "report.md").write_text(report(results, plots_from="", plots=plots))
    if args.docs is not None:
        relative = os.path.relpath(args.out, args.docs.parent)
        args.docs.write_text(report(results, plots_from=relative + "/", plots=plots) + _kept_sections(args.docs))


# What follows this line in the docs page comes from benchmarks run by hand (benchmarks/soak.py).
HAND_RUN = "<!-- Sections below come from benchmarks run by hand; benchmarks.run keeps them. -->"

# The plots the report shows under its table of targets, in this order, each with its caption.
# soak.png comes from a hand run (benchmarks/soak.py): shown when it is in the output directory.
PLOTS = {
    "many_tables.png": "many_tables: ours / stock TorchRec for each phase as the tables grow (T), with 1 and 32 "
                       "distinct settings (S); below 1, ours is faster.",
    "scaling.png": "scaling: step time against the table's rows (flat: the cost follows the touched rows) and "
                   "against the batch.",
    "soak.png": "soak (run by hand, `benchmarks/soak.py`): resident memory per rank over 10,000 steps with every "
                "in-backward path live; flat after warm-up.",
}


def _plots(results: dict, out: Path) -> list[str]:
    made = [plot for result in results["benchmarks"].values() for plot in result.get("plots", [])]
    return [plot for plot in PLOTS if plot in made or (out / plot).exists()] + [p for p in made if p not in PLOTS]


def _kept_sections(docs: Path) -> str:
    text = docs.read_text() if docs.exists() else ""
    return "\n" + text[text.index(HAND_RUN):] if HAND_RUN in text else ""


def _machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def verdict(name: str, value: float) -> tuple[str, str]:
    """(target, "met"/"missed"/"") from a ratio's name, e.g. ``... (target >= 2)``."""
    found = re.search(r"target ([<>=]=) ([\d.]+)", name)
    if not found:
        return "", ""
    op, bound = found.group(1), float(found.group(2))
    met = value >= bound if op == ">=" else value <= bound if op == "<=" else value == bound
    return f"{op} {bound:g}", "met" if met else "**missed**"


def _label(name: str) -> str:
    return re.sub(r" ?\(target [<>=]= [\d.]+\)", "", name)


def _value(name: str, value: float) -> str:
    """``1.23x``; three decimals where two would round onto the target and hide the verdict."""
    found = re.search(r"target [<>=]= ([\d.]+)", name)
    close = found is not None and round(value, 2) == float(found.group(1)) and value != float(found.group(1))
    return f"{value:.3f}x" if close else f"{value:.2f}x"


def ratio_table(results: dict, targets_only: bool = False) -> str:
    """Every ratio of every benchmark with its verdict; ``targets_only``: those with a target, linked."""
    header = "| benchmark | what | value | target | verdict |" if targets_only else "| benchmark | ratio | value | target | |"
    lines = [header, "| --- | --- | --- | --- | --- |"]
    for bench, result in results["benchmarks"].items():
        for name, value in result["ratios"].items():
            target, outcome = verdict(name, value)
            if targets_only and not target:
                continue
            where = f"[{bench}](#{bench})" if targets_only else bench
            lines.append(f"| {where} | {_label(name)} | {_value(name, value)} | {target} | {outcome} |")
    return "\n".join(lines)


def report(results: dict, plots_from: str, plots: list[str] | None = None) -> str:
    """The page: the targets and their verdicts, the plots, then each benchmark: what, why, measurements."""
    machine, seconds = results["machine"], sum(results["seconds"].values())
    verdicts = [verdict(k, v)[1] for r in results["benchmarks"].values() for k, v in r["ratios"].items()]
    targets = [v for v in verdicts if v]
    plots = plots if plots is not None else [p for r in results["benchmarks"].values() for p in r.get("plots", [])]
    lines = [
        "# Benchmarks" + (" (quick smoke mode: numbers mean nothing)" if results["quick"] else ""), "",
        f"Run of {results['date']} on {machine['platform']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"{machine['threads']} threads"
        + (f" (OMP_WAIT_POLICY={policy})" if (policy := machine.get("omp_wait_policy")) else "")
        + f"; {seconds:.0f} s in all. Every value is a ratio between peers measured in the same run, alternating "
        "warm-up and repeats, on this shared machine; absolute times are noise. "
        f"{targets.count('met')} of {len(targets)} targets met; each benchmark's section says why a target is missed.",
        "", ratio_table(results, targets_only=True), "",
    ]
    if plots:
        lines += ["## Plots", ""]
        for plot in plots:
            lines += [f"![{plot}]({plots_from}{plot})", ""] + ([f"*{PLOTS[plot]}*", ""] if plot in PLOTS else [])
    lines += ["## Regenerate", "", "This page and everything in `benchmarks/results/`:", "",
              f"```bash\n{FULL_COMMAND}\n{QUICK_COMMAND}    # smoke mode, as CI runs it\n{REPORT_COMMAND}"
              "    # the pages again from results.json, nothing run\n```", ""]
    for name, result in results["benchmarks"].items():
        doc = (MODULES[name].__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        lines += [f"## {name}", "", doc, ""] + ([NOTES[name], ""] if name in NOTES else [])
        others = [(k, v) for k, v in result["ratios"].items() if not verdict(k, v)[0]]
        if others:
            lines += ["| other ratios | value |", "| --- | --- |"] + [f"| {k} | {v:.2f}x |" for k, v in others] + [""]
        lines += ["<details><summary>Setup and measurements</summary>", "", f"Setup: `{json.dumps(result['setup'])}`",
                  "", *_details(result), "</details>", ""]
    return "\n".join(lines).rstrip() + "\n"


def _details(result: dict) -> list[str]:
    lines = []
    if "timings" in result:
        lines += ["| peer | median s | p25 s | p75 s |", "| --- | --- | --- | --- |"]
        lines += [f"| {p} | {t['median_s']:.4f} | {t['p25_s']:.4f} | {t['p75_s']:.4f} |"
                  for p, t in result["timings"].items()]
        lines.append("")
    if "all_reduces" in result:
        columns = list(next(iter(result["all_reduces"].values())))
        lines += ["| all-reduces per step | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
        lines += [f"| {peer} | " + " | ".join(f"{counts[c]:g}" for c in columns) + " |"
                  for peer, counts in result["all_reduces"].items()]
        lines.append("")
    if "peak_rss_kib" in result:
        lines += ["| peer | peak RSS (MiB, max over ranks) |", "| --- | --- |"]
        lines += [f"| {p} | {kib / 1024:.0f} |" for p, kib in result["peak_rss_kib"].items()]
        lines.append("")
    if "held_before_last_micro_batch_mib" in result:
        lines += ["| k | held before the last micro-batch (MiB, per rank) |", "| --- | --- |"]
        lines += [f"| {k} | {mib:.1f} |" for k, mib in result["held_before_last_micro_batch_mib"].items()]
        lines.append("")
    for label, shares in result.get("phases", {}).items():
        lines += [f"| where the time goes: {label} | share |", "| --- | --- |"]
        lines += [f"| {phase} | {100 * share:.0f}% |" for phase, share in shares.items()]
        lines.append("")
    if "scaling" in result:
        lines += ["| table rows | median s | / smallest |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['median_s']:.4f} | {v['ratio_to_smallest']:.2f}x |" for k, v in result["scaling"].items()]
        lines.append("")
    if "limit" in result:
        lines += [f"Measured limit: copy {result['limit']['copy_gb_s']:.1f} GB/s, "
                  f"triad {result['limit']['triad_gb_s']:.1f} GB/s.", "",
                  "| kernel | bytes per step (lower bound) | achieved GB/s |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['bytes_per_step'] / 1e6:.1f} MB | {v['gb_s']:.2f} |" for k, v in result["achieved"].items()]
        lines.append("")
        for kernel, ops in result["profiles"].items():
            top = ", ".join(f"`{op}` {share:.0f}%" for op, share in ops)
            lines += [f"- Where {kernel} spends its time (self CPU): {top}"]
        lines.append("")
    for key, label in (("by_rows_s", "table rows"), ("by_batch_s", "batch")):
        if key in result:
            kernels = list(result[key])
            points = list(result[key][kernels[0]])
            lines += [f"| {label} | " + " | ".join(f"{k} (ms)" for k in kernels) + " |",
                      "| --- |" + " --- |" * len(kernels)]
            lines += [f"| {p} | " + " | ".join(f"{result[key][k][p] * 1e3:.1f}" for k in kernels) + " |" for p in points]
            lines.append("")
    return lines


if __name__ == "__main__":
    main()
