"""The peak of the CPU bytes a call allocates, from the profiler's memory events (not collected by pytest)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def allocated_peak(fn: Callable[[], object]) -> int:
    """The most CPU bytes ``fn()`` had allocated at any time, above what was allocated before it.

    The profiler reports every allocation and free of the CPU allocator as a "[memory]" event
    (a free with negative bytes); their running sum in time order is what ``fn`` holds. The raw
    events are read (``kineto_results``): ``prof.events()`` folds those made inside an operator
    into the operator's total, so an operator's peak between them would be lost. The free of a
    block allocated before ``fn`` is not reported: such a block counts as held to the end, so
    the peak may be above, never below, what ``fn`` added.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events()
         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda e: e.start_ns(),
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak
