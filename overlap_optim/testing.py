"""Run code on N gloo ranks in spawned processes: for tests and benchmarks.

:func:`run_ranks` runs one function on every rank. A rank's exception comes back to the
parent with its traceback; ranks that outlive the timeout are killed.

:func:`run_cases` runs many named cases in a spawned group (a torch import costs seconds)
and keeps each case's outcome apart: a case that raises is recorded under its name, with its
traceback, and the next case runs. The group outlives the call: the next ``run_cases`` of the
same world size (the next test module's) runs in it too, until a case stalls or a rank dies,
after which a fresh group starts. :func:`selected_cases` tells a pytest fixture which cases
the tests selected in this session (``-k``, node ids) need. A test module uses them so::

    CASES = {"table_wise": partial(train, sharding_type="table_wise"), ...}  # fn(rank, world_size)

    @pytest.fixture(scope="module")
    def ranks(request):
        return run_cases(CASES, selected_cases(request, CASES), timeout=300)

    @pytest.mark.parametrize("case", CASES)
    def test_trains(ranks, case):
        for value in ranks[case]:  # a case that failed raises here, naming the case
            ...
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["CaseResults", "run_cases", "run_ranks", "selected_cases"]

_GRACE = 10.0  # seconds to keep reading the other ranks' reports once one rank has stopped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int, timeout: float) -> dist.TCPStore:
    """Join the gloo group; returns its store, which ``run_cases`` also uses outside gloo."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return store


def _leave(results: Any, ok: bool) -> None:
    # The result must be on the pipe before anything else can go wrong, and the
    # teardown of gloo and DDP at interpreter exit can abort (SIGABRT): wait for
    # every rank, then leave without that teardown.
    results.close()
    results.join_thread()
    try:
        if ok:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer died; the parent reports it
        ok = False
    os._exit(0 if ok else 1)


def _entry(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results: Any) -> None:
    ok = False
    try:
        _init(rank, world_size, port, timeout)
        results.put((rank, "ok", fn(rank, world_size, *args)))
        ok = True
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    _leave(results, ok)


def _start(target: Callable, world_size: int, args: tuple) -> tuple[list, Any]:
    """Spawn ``target(rank, world_size, port, *args, results)`` per rank: (processes, results queue)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, results


def _stop(procs: list) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """``[fn(0, world_size, *args), fn(1, ...), ...]``, each from its own process.

    Raises:
        AssertionError: a rank raised (its traceback is in the message), exited
            without a result, or did not finish within ``timeout`` seconds.
    """
    procs, results = _start(_entry, world_size, (timeout, fn, args))
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for i, p in enumerate(procs) if i not in outcome):
                    break  # a rank died without a word (a crash, not an exception): stop waiting
                continue
            outcome[rank] = (status, value)
            if status == "error":
                break
    finally:
        _stop(procs)
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    missing = sorted(set(range(world_size)) - set(outcome))
    assert not missing, (
        f"ranks {missing} gave no result (exit codes {[p.exitcode for p in procs]}; "
        f"waited {timeout - max(deadline - time.monotonic(), 0):.0f}s of {timeout}s)"
    )
    return [outcome[r][1] for r in range(world_size)]


# -- many cases in one spawned group, kept for the next run_cases --


_KEYS = "overlap_optim.testing/"
_STOP = _KEYS + "stop"


def _case_key(batch: int, name: str, rank: int) -> str:
    return f"{_KEYS}{batch}/{name}/{rank}"


def _stop_key(batch: int) -> str:
    return f"{_STOP}/{batch}"


def _run_one(fn: Callable, rank: int, world_size: int, args: tuple) -> tuple[str, Any]:
    try:  # pickled here: a value that cannot cross to the parent fails its case, not the pipe
        return "passed", pickle.dumps(fn(rank, world_size, *args))
    except Exception:  # noqa: BLE001 - the case's failure is its result; the next case runs
        return "failed", traceback.format_exc()


def _finish(store: dist.Store, batch: int, name: str, rank: int, world_size: int, status: str,
            straggler_timeout: float) -> str:
    """Wait, in the store (outside gloo), until every rank has finished case ``name``: "" to go
    on, or why this rank stops here.

    A case that failed on one rank can leave its peer waiting in a collective; the next case's
    collectives would then pair with the wrong ones. So the ranks stop there instead: the rank
    that waited in vain tells the others (``_STOP``) and leaves, which also ends its peer's wait
    in gloo with an error that shows where the peer waited."""
    try:
        store.set(_case_key(batch, name, rank), status)
        store.wait([_case_key(batch, name, r) for r in range(world_size)], timedelta(seconds=straggler_timeout))
    except Exception:  # noqa: BLE001 - the store's timeout, or its host (rank 0) has left
        try:
            store.set(_stop_key(batch), name)
        except Exception:  # noqa: BLE001 - rank 0 has left: the others learn it from the store anyway
            pass
        return f"stopped after case {name!r}: not every rank had finished it {straggler_timeout:.0f}s after this one"
    if store.check([_stop_key(batch)]):
        return f"stopped after case {name!r}, as another rank did"
    return ""


def _case_entry(rank: int, world_size: int, port: int, timeout: float, tasks: Any, results: Any) -> None:
    """Join the group once, then run each batch of cases that ``tasks`` brings, in order, until
    None comes: report each case's start and outcome, then how the batch ended. A batch that
    stops early (a stalled case) ends the group: its ranks may still be paired in a collective."""
    ended = ("error", "")
    try:
        store = _init(rank, world_size, port, timeout)
        while (task := tasks.get()) is not None:
            batch, cases, names, args, straggler_timeout = task
            ended = ("done", "")
            for name in names:
                results.put((batch, rank, "start", name))
                status, value = _run_one(cases[name], rank, world_size, args)
                results.put((batch, rank, status, (name, value)))
                why = _finish(store, batch, name, rank, world_size, status, straggler_timeout)
                if why:
                    ended = ("stopped", why)
                    break
            results.put((batch, rank, *ended))
            if ended[0] != "done":
                break
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        ended = ("error", f"raised outside any case:\n{traceback.format_exc()}")
        results.put((-1, rank, *ended))
    _leave(results, ended[0] == "done")


class _Group:
    """A spawned group of ranks that runs batches of cases (:func:`_case_entry`) until closed."""

    _open: dict[int, _Group] = {}  # world size -> the group kept for the next run_cases
    _batches = itertools.count()
    _exit_registered = False

    def __init__(self, world_size: int, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size, self.results = world_size, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_case_entry, args=(r, world_size, port, timeout, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    @classmethod
    def take(cls, world_size: int, timeout: float) -> _Group:
        """The open group of ``world_size`` ranks if every rank is alive, else a new one."""
        group = cls._open.pop(world_size, None)
        if group is not None and all(p.exitcode is None for p in group.procs):
            return group
        if group is not None:
            group.close()
        return cls(world_size, timeout)

    def keep(self) -> None:
        if not _Group._exit_registered:
            _Group._exit_registered = True
            atexit.register(_Group.close_all)  # before interpreter exit joins the (waiting) ranks
        _Group._open[self.world_size] = self

    def run(self, cases: dict, names: list[str], args: tuple, timeout: float, straggler_timeout: float) -> _CaseLog:
        batch = next(self._batches)
        for tasks in self.tasks:
            tasks.put((batch, cases, names, args, straggler_timeout))
        log = _CaseLog(names, self.world_size)
        deadline = time.monotonic() + timeout
        while len(log.ended) < self.world_size and time.monotonic() < deadline:
            try:
                sent, rank, kind, value = self.results.get(timeout=1.0)
                if sent in (batch, -1):
                    log.record(rank, kind, value)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if p.exitcode is not None and rank not in log.ended:
                        log.ended[rank] = f"died (exit code {p.exitcode})"
            if log.stopped_early():  # one rank stopped: the others cannot go on long without it
                deadline = min(deadline, time.monotonic() + _GRACE)
        stopped = [r for r, why in sorted(log.ended.items()) if why]
        why = (f"killed after rank {stopped[0]} {log.ended[stopped[0]].splitlines()[0].rstrip(':')}" if stopped
               else f"killed at the group's {timeout:.0f}s timeout")
        for rank in set(range(self.world_size)) - set(log.ended):
            log.ended[rank] = why
        return log

    def close(self, wait: bool = False) -> None:
        """Stop the ranks: let them leave (``wait``), or kill them (one waits in a collective)."""
        if wait:
            for tasks in self.tasks:
                tasks.put(None)
        else:
            for p in self.procs:
                p.kill()
        _stop(self.procs)

    @classmethod
    def close_all(cls) -> None:
        while cls._open:
            cls._open.popitem()[1].close(wait=True)


class CaseResults:
    """What :func:`run_cases` brings back: per case, its value on every rank.

    ``results[name]`` is ``[value on rank 0, value on rank 1, ...]`` for a case that passed on
    every rank, and raises ``AssertionError`` naming the case and saying why for one that did
    not (its traceback by rank, or the case that stopped the group before it ran).
    """

    def __init__(self, values: dict[str, list[Any]], failures: dict[str, str]) -> None:
        self.values, self.failures = values, failures

    def __getitem__(self, name: str) -> list[Any]:
        if name in self.failures:
            raise AssertionError(f"case {name!r} {self.failures[name]}")
        if name not in self.values:
            raise KeyError(f"case {name!r} was not run in this group; it ran {sorted(self.values | self.failures)}")
        return self.values[name]


class _CaseLog:
    """The parent's record of the ranks' reports, and how each rank ended."""

    def __init__(self, names: list[str], world_size: int) -> None:
        self.names, self.world_size = names, world_size
        self.outcomes: dict[str, dict[int, tuple[str, Any]]] = {n: {} for n in names}
        self.current: dict[int, str] = {}  # rank -> the case it started last
        self.ended: dict[int, str] = {}  # rank -> "" (it ran every case) or why it stopped

    def record(self, rank: int, kind: str, value: Any) -> None:
        if kind == "start":
            self.current[rank] = value
        elif kind in ("passed", "failed"):
            self.outcomes[value[0]][rank] = (kind, value[1])
        else:  # "done" (value ""), "stopped" or "error": why this rank ended
            self.ended[rank] = value

    def stopped_early(self) -> bool:
        return any(self.ended.values())

    def _not_run(self, blocker: str | None) -> str:
        if blocker is not None:
            return f"was not run: case {blocker!r} did not finish on every rank"
        return "was not run: " + "; ".join(f"rank {r} {why}" for r, why in sorted(self.ended.items()) if why)

    def results(self) -> CaseResults:
        values, failures, failed, blocker = {}, {}, None, None
        for name in self.names:
            got = self.outcomes[name]
            if blocker is not None or not (got or name in self.current.values()):
                failures[name] = self._not_run(blocker)
            elif len(got) == self.world_size and all(s == "passed" for s, _ in got.values()):
                values[name] = [pickle.loads(got[r][1]) for r in range(self.world_size)]
            else:
                after = f"\n(it ran after case {failed!r} failed)" if failed else ""
                failures[name] = "did not pass on every rank\n" + "\n".join(self._by_rank(name)) + after
                failed = failed or name
                blocker = name if len(got) < self.world_size else None
        return CaseResults(values, failures)

    def _by_rank(self, name: str) -> list[str]:
        got = self.outcomes[name]
        lines = []
        for rank in range(self.world_size):
            if rank in got:
                status, value = got[rank]
                lines.append(f"rank {rank}: failed:\n{value}" if status == "failed" else f"rank {rank}: passed")
            else:
                began = "did not finish" if self.current.get(rank) == name else "did not start"
                lines.append(f"rank {rank}: {began} it: {self.ended.get(rank, 'killed')}")
        return lines


def run_cases(cases: Mapping[str, Callable], names: Iterable[str] | None = None, *args: Any, world_size: int = 2,
              timeout: float = 240.0, straggler_timeout: float = 120.0) -> CaseResults:
    """Run ``cases[name](rank, world_size, *args)`` for each name, in ``cases``' order, in one
    spawned group of ``world_size`` ranks; each case's outcome is kept apart. The group is the
    one the previous call of this world size left, when it ended well, so a case must leave the
    process as it found it (its process group, global settings).

    A case that raises on some rank is recorded with its traceback, and the next case runs once
    every rank has finished the failed one. The group stops at a case that a rank has not
    finished ``straggler_timeout`` seconds after another rank did (it waits in a collective for a
    peer that failed), at a rank that dies, or at the group's ``timeout``: that case and the
    ones after it are reported so, by name.

    Args:
        cases: name -> a picklable function of ``(rank, world_size, *args)`` (defined in an
            importable module; ``functools.partial`` binds its own arguments). Its value on
            every rank must pickle.
        names: the cases to run (None: all); they run in ``cases``' order. An unknown name
            raises ``ValueError``.
        args: passed to every case after ``rank, world_size``.

    Returns:
        :class:`CaseResults`: ``results[name]`` is the case's values by rank, or raises
        ``AssertionError`` naming the case and why it did not pass.
    """
    names = list(cases) if names is None else list(names)
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; the cases are {list(cases)}")
    names = [n for n in cases if n in set(names)]
    group = _Group.take(world_size, timeout)
    try:
        log = group.run(dict(cases), names, args, timeout, straggler_timeout)
    except BaseException:  # interrupted (Ctrl-C, pytest's timeout): no rank may outlive the parent waiting
        group.close()
        raise
    if log.stopped_early():  # a rank stopped, died or outlived the timeout: the group is not reused
        group.close()
    else:
        group.keep()
    return log.results()


def selected_cases(request: Any, cases: Mapping[str, Any]) -> list[str]:
    """The cases that this pytest session's selected tests of ``request``'s module need.

    For a module-scoped fixture that runs ``cases``: a selected test that uses the fixture and
    is parametrized with ``case`` (one of ``cases``) needs that case; a selected test that uses
    it otherwise needs every case. So ``-k`` and node ids run only the cases they select.

    Args:
        request: the fixture's pytest ``request``.
        cases: the fixture's cases (their names).
    """
    needed = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        if not (isinstance(case, str) and case in cases):
            return list(cases)
        needed.add(case)
    return [n for n in cases if n in needed]
