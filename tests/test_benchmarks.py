"""The benchmarks run and write their report (smoke mode: no time is asserted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmarks_write_report_and_json(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path), "--docs", str(tmp_path / "docs.md")],
        cwd=ROOT, capture_output=True, text=True, timeout=540, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    fallback = results["benchmarks"]["fallback"]
    assert set(fallback["timings"]) == {"dense", "sparse_adam", "fallback"}
    assert all(v > 0 for v in fallback["ratios"].values())
    assert len(fallback["scaling"]) == 3
    dense = results["benchmarks"]["dense_hook"]
    assert {"ours (batch 16)", "torch_in_backward (batch 16)", "ddp_foreach (batch 16)"} <= set(dense["timings"])
    assert set(dense["peak_rss_kib"]) == {"ours", "torch_in_backward", "ddp_foreach"}
    stock = results["benchmarks"]["sparse_vs_torchrec"]
    peers = {"ours", "torchrec", "ours_fbgemm_backward"}
    assert set(stock["timings"]) == peers and set(stock["peak_rss_kib"]) == {"ours", "torchrec"}
    ec = results["benchmarks"]["ec_vs_torchrec"]
    assert ec["setup"]["collection"] == "ec" and set(ec["timings"]) == peers
    clipping = results["benchmarks"]["clipping"]
    assert {"sparse fused", "sparse fallback", "sparse clipped", "dense ours (batch 16)", "dense ours_clipped (batch 16)",
            "dense ddp_clip (batch 16)"} <= set(clipping["timings"])
    assert set(clipping["peak_rss_kib"]) == {"ours_clipped", "ddp_clip"}
    assert clipping["setup"]["sparse"]["kernels"] == {
        "fused": ["fused"], "fallback": ["lazy"], "clipped": ["fused"], "clipped_fallback": ["lazy"]}
    assert all(bound["binds"] for bound in clipping["setup"]["bounds"].values()), "the bound must clip"
    accumulation = results["benchmarks"]["accumulation"]
    assert set(accumulation["peak_rss_kib"]) == {"steps", "window", "window_fallback"}
    held = accumulation["held_before_last_micro_batch_mib"]
    assert 0 < held["2"] < held["4"] < held["8"], held  # JSON keys: k as text
    rounds = results["benchmarks"]["round_phases"]
    assert set(rounds["timings"]) == {"separate", "one_set", "one_module", "unclipped"}
    counts = rounds["all_reduces"]
    # one all-reduce per round (2 clipping sets, 3 modules), or one per phase once rounds of a phase merge
    assert (counts["separate"]["CLIP"], counts["separate"]["STATISTICS"]) in {(2, 3), (1, 1)}, counts
    assert counts["one_set"]["CLIP"] == 1 and counts["unclipped"]["CLIP"] == 0, counts
    assert counts["one_module"]["STATISTICS"] == 1 and counts["separate"]["SETTLE"] == 0, counts
    assert all(c["rounds"] + c["other all_reduce calls"] <= c["every gloo all-reduce"] for c in counts.values())
    assert all(bound["binds"] for bounds in rounds["setup"]["bounds"].values() for bound in bounds)
    precision = results["benchmarks"]["precision"]
    assert set(precision["peak_rss_kib"]) == {"fp32", "fp16", "fp16_bf16"}
    assert set(precision["timings"]) == {"fp32", "fp16", "fp16_bf16", "ours_rowwise_fp16", "stock_rowwise_fp16",
                                         "fallback_rowwise_fp16"}
    limit = results["benchmarks"]["limit"]
    assert limit["limit"]["triad_gb_s"] > 0 and len(limit["achieved"]) == 4
    assert all(len(ops) == 5 for ops in limit["profiles"].values())
    scaling = results["benchmarks"]["scaling"]
    assert all(len(v) == 3 for v in scaling["by_rows_s"].values()) and all(len(v) == 3 for v in scaling["by_batch_s"].values())
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    many = results["benchmarks"]["many_tables"]
    assert set(many["by_config"]) == {"T=4,S=1", "T=4,S=4", "T=16,S=1", "T=16,S=4"}
    assert all(set(peers) == {"ours", "torchrec"} and all(v > 0 for p in peers.values() for v in p.values())
               for peers in many["by_config"].values())
    assert (tmp_path / "many_tables.png").stat().st_size > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "dense / fallback" in report and "quick smoke mode" in report
    assert "| all-reduces per step | SETTLE | CLIP | STATISTICS |" in report
    assert re.search(r"\| >= 10 \| (met|\*\*missed\*\*) \|", report), "each target gets a verdict"
    assert "![scaling.png](scaling.png)" in report
    docs = (tmp_path / "docs.md").read_text()
    assert "![scaling.png](./scaling.png)" in docs
    assert "ratio" in run.stdout  # the table of ratios is printed
    (tmp_path / "report.md").unlink()
    again = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--report-only", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert again.returncode == 0 and (tmp_path / "report.md").read_text() == report


def test_a_started_process_reports_its_own_peak_rss_not_its_parents():
    """The peak-RSS comparisons start each peer's ranks from a large runner: the rank's reading
    must be its own (``ru_maxrss`` there is the runner's peak, which made every peer equal)."""
    parent = bytearray(3 << 30)
    parent[:: 1 << 12] = b"x" * len(parent[:: 1 << 12])  # touched: 3 GiB resident in this process
    code = ("import resource; from benchmarks._timing import own_peak_rss_kib; "
            "print(own_peak_rss_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    del parent
    own, inherited = map(int, run.stdout.split())
    assert own < 2 << 20, (own, inherited)  # KiB: the child (torch imported) is well under 2 GiB
    if sys.platform == "linux":  # the reason for the helper: Linux's ru_maxrss carried the parent's 3 GiB over
        assert inherited >= 3 << 20, (own, inherited)


def test_round_phases_reads_the_phase_from_the_frames_that_issue_an_all_reduce():
    """benchmarks/round_phases.py counts the rounds' all-reduces by phase without knowing the
    schedule's code, so that the count holds when rounds of one phase merge: the phase is read
    from what the issuing frames hold (a round, the rounds of one phase, a Phase)."""
    from benchmarks.round_phases import UNKNOWN, _issuer
    from overlap_optim.round import EndOfBackwardRound, Phase

    def issued(first=None, second=None):
        return _issuer(sys._getframe())

    assert issued(torch.zeros(2), [1, 2]) is None  # no round's (no round is in this test's frame yet)
    clip, statistics = EndOfBackwardRound(None, Phase.CLIP), EndOfBackwardRound(None, Phase.STATISTICS)
    assert issued(clip) == "CLIP"  # EndOfBackwardRound.run: its self
    assert issued(clip, [statistics, clip]) == "CLIP"  # beside the list of every armed round
    assert issued([statistics, statistics]) == "STATISTICS"  # merged: the rounds of one phase
    assert issued({("STATISTICS", None): [statistics]}) == "STATISTICS"  # merged, keyed by phase and group
    assert issued(Phase.STATISTICS, torch.zeros(2)) == "STATISTICS"
    assert issued([clip, statistics]) == issued(clip, statistics) == UNKNOWN  # a round's, phase not told
