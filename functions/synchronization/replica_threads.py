"""The replica threads of ThreadedDataParallel (syncbn.modules.parallel): a pool of workers that
outlive the step, the caller's thread-local state carried into them, and a run of one job per
replica whose failure releases the others at once and whose stragglers are named, with their
stacks, instead of waited for without end."""
from __future__ import annotations

import gc
import queue
import sys
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from ..operators.backend import set_thread_intra_op_threads
from .replicas import ReplicaRound, ReplicaSyncError, abort_rounds

T = TypeVar("T")


class ThreadState:
    """The caller's thread-local state (grad mode, autocast, CUDA stream) for worker threads, and
    each CPU replica's share of the caller's intra-op threads."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.autocast = [(t, torch.get_autocast_dtype(t)) for t in types if torch.is_autocast_enabled(t)]
        self.streams = {d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"}
        # CPU replicas run at once: each starting a team of all the caller's threads would put
        # R x threads on the cores (measured: a small ResNet step under 4 CPU replicas on 2
        # vCPUs took 100 ms so, 24 ms with one thread each; benchmarks/RESULTS.md)
        self.cpu_threads = max(1, torch.get_num_threads() // max(1, sum(d.type == "cpu" for d in devices)))

    @contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        if device.type == "cpu":
            set_thread_intra_op_threads(self.cpu_threads)
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield


class Worker:
    """A daemon thread that runs the jobs it is handed, one at a time. Workers outlive the step
    (they wait in a free list between calls), so that per-thread state, such as the OpenMP
    thread team that torch's CPU kernels start from each calling thread, is made once rather
    than at every forward and backward."""

    _idle: list["Worker"] = []
    _idle_lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="ThreadedDataParallel-worker").start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    @classmethod
    def take(cls, count: int) -> list["Worker"]:
        """``count`` idle workers, started where there are not enough."""
        with cls._idle_lock:
            taken = cls._idle[:count]
            del cls._idle[:count]
        return taken + [cls() for _ in range(count - len(taken))]

    @classmethod
    def give_back(cls, workers: Sequence["Worker"]) -> None:
        with cls._idle_lock:
            cls._idle.extend(workers)


TAIL_TIMEOUTS = 10
"""Once a replica of a step has ended well, the others get this many timeouts more (10 minutes by
default): replicas may end apart (uneven chunks, work after the last synchronized layer), but not
by that much, short of a hang."""

STRAGGLER_TIMEOUTS = 3
"""Once a replica of a step has failed, the others, released from the rounds at once, get this
many of the longest timeout among the wrapper's and the synchronized layers' own: a replica
exchange waits up to twice its timeout (once more when the master is combining), so that the
layer's error, which says where, comes first."""


def run_in_threads(jobs: Sequence[Callable[[], T]], rounds: Sequence[ReplicaRound], timeout: float) -> list[T]:
    """Run one job per replica, all at once, each on its own worker thread. When one raises,
    the rounds of the synchronized layers are broken at once so that no replica waits for it;
    after all jobs ended, the first error that is not such a consequence is re-raised.

    The wait is bounded once a job has ended: ``TAIL_TIMEOUTS * timeout`` after the first ended
    well, ``STRAGGLER_TIMEOUTS`` times the longest timeout after the first failed. Past that, the
    rounds are broken and a :class:`ReplicaSyncError` names the stragglers, with their stacks;
    their workers are not reused (they may be stuck, and may still write the module's buffers
    when they wake: replica 0 holds them). Replicas that all hang outside the synchronized layers,
    where no exchange notices, are waited for."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    ended = [False] * len(jobs)
    threads: list[int | None] = [None] * len(jobs)
    ending = threading.Condition()

    def work(index: int) -> None:
        threads[index] = threading.get_ident()
        try:
            results[index] = jobs[index]()
        except BaseException as error:
            errors[index] = error
            abort_rounds(rounds, error, index)
        finally:
            with ending:
                ended[index] = True
                ending.notify()

    workers = Worker.take(len(jobs))
    with no_automatic_collection():
        for index, worker in enumerate(workers):
            worker.submit(lambda index=index: work(index))
        after_failure = STRAGGLER_TIMEOUTS * max([timeout, *(round.timeout for round in rounds)])
        stragglers = _wait_for_jobs(ended, errors, ending, TAIL_TIMEOUTS * timeout, after_failure)
    Worker.give_back([w for w, done in zip(workers, ended) if done])
    if stragglers:
        errors.append(_stragglers_error(stragglers, ended, [threads[i] for i in stragglers], rounds))
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if not isinstance(e, ReplicaSyncError)), failed[0])
    return results


@contextmanager
def no_automatic_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off while replicas run (it runs at the next allocation
    after): torch's ``Generator.get_state()`` allocates while it holds the generator's mutex, a
    collection started there frees a tensor with the GIL let go, and a replica that then takes the
    GIL and waits for that mutex (checkpoint's ``fork_rng``, in every replica's recomputation)
    deadlocks the two where no timeout can end it (nothing runs Python again)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _wait_for_jobs(
    ended: list[bool], errors: list[BaseException | None], ending: threading.Condition, tail: float, after_failure: float
) -> list[int]:
    """Wait until every job has ended, at most ``tail`` seconds after the first one ended and
    ``after_failure`` seconds after the first one failed; the jobs still running then."""
    deadline = None
    with ending:
        while not all(ended):
            now = time.monotonic()
            if any(ended):
                limits = [now + tail] + ([now + after_failure] if any(e is not None for e in errors) else [])
                deadline = min([*limits, *([deadline] if deadline is not None else [])])
                if deadline <= now:
                    return [i for i, done in enumerate(ended) if not done]
            ending.wait(None if deadline is None else deadline - now)
    return []


def _stragglers_error(
    stragglers: list[int], ended: list[bool], threads: list[int | None], rounds: Sequence[ReplicaRound]
) -> ReplicaSyncError:
    """Say who hangs, and where (their stacks, taken before the rounds are broken); then break
    the rounds, so that a straggler waiting in one is released."""
    frames = sys._current_frames()
    stacks = "".join(
        f"\n--- replica {j} (thread {ident}):\n" + "".join(traceback.format_stack(frames[ident], limit=12))
        for j, ident in zip(stragglers, threads)
        if ident in frames
    )
    finished = [i for i, done in enumerate(ended) if done]
    error = ReplicaSyncError(
        f"ThreadedDataParallel: replica(s) {stragglers} did not finish in time"
        + (f" after replicas {finished} had ended" if finished else "")
        + "; their rounds are broken. The wait is set by timeout= or $SYNCBN_TIMEOUT. Where they were:"
        + stacks
    )
    abort_rounds(rounds, error)
    return error
