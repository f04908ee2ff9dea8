"""Keep the examples' output to progress bars and results: silence the stack's known noise.

torch, TorchRec and FBGEMM warn about their own internals on every run (deprecated
collectives that TorchRec calls, a DDP argument TorchRec passes, the planner's
storage estimate, ...): nothing a user of these examples can act on. :func:`install`
filters exactly that, and only in the examples (the library filters nothing):

- Python warnings of the deprecation categories raised from inside those packages
  (matched by category and by the warning's module);
- torch's deprecation of ``ShardedTensor``, which names the caller's line (TorchRec's
  sharded tables are ShardedTensors, and a checkpoint load reads them): matched by
  category and message wherever it is raised;
- a few known log messages of theirs, by logger and message prefix.

Any other warning (from this repository's modules too) and any other log message still
shows. The examples call :func:`install` when imported, before importing
torch, so the ranks that torchrun starts (each runs the example afresh) get the same filters.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["install", "THIRD_PARTY", "CATEGORIES", "KNOWN_MESSAGES", "KNOWN_LOGS"]

THIRD_PARTY = r"(torch|torchrec|fbgemm_gpu)(\.|$)"
CATEGORIES = (FutureWarning, DeprecationWarning)
# (category, message regex) of third-party deprecations reported at a caller's line
KNOWN_MESSAGES = ((FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),)

# logger -> message prefixes: the stack's notices that a user of the examples cannot act on
KNOWN_LOGS = {
    "torchrec.distributed.planner.types": ("The topology was constructed directly",),
    "torchrec.distributed.planner.storage_reservations": ("There is a known issue with TorchRec's dense tensor",),
    "torchrec.distributed.utils": ("Compute Kernel is dense, caching params will be ignored",),
    "torch.fx._symbolic_trace": ("is_fx_tracing will return true",),
}


class _DropKnown(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Filter the stack's known warnings and log notices in this process (idempotent)."""
    for category in CATEGORIES:
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)
    for category, message in KNOWN_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefixes in KNOWN_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(prefixes))

