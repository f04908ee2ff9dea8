"""A rank's process group is freed by ``gc.collect()`` after ``destroy_process_group()``.

Nothing of ours may hold gloo's process group outside collectable cycles (a
global registry, say): its worker threads would then live into interpreter
shutdown, and a worker that drops the last collective's tensors a moment late
aborts the rank ("terminate called without an active exception"). The examples
end every rank with that collection (``examples/launch.py``, ``run_rank``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent / "_exit_job.py"


def test_collecting_after_destroy_joins_the_gloo_threads():
    done = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # while training and after destroy_process_group, the group lives (DMP and DDP hold it in cycles)
    assert counts["training"] > 0 and counts["destroyed"] == counts["training"], counts
    assert counts["collected"] == 0, counts
