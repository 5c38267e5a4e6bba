"""Behaviours across processes as tests (``tests/test_distributed_*.py``): each behaviour is a test of
its own (``@across_processes(worlds)``); the behaviours of a world size, from every test file that
registers some, run in ONE set of local Gloo processes (start-up dominates the cost), and one that
crashes its set is run again alone, so one failure fails one test. Collectives time out after 30 s,
so a broken check fails instead of hanging."""
from __future__ import annotations

import importlib
import traceback
from typing import Callable

import pytest

from testkit.local_group import run_local_group

BEHAVIOURS: dict[int, dict[str, Callable[[int, int], None]]] = {}
"""world size -> {test name: what every rank runs}, in the order they run."""


def across_processes(*worlds: int) -> Callable[[Callable[[int, int], None]], Callable[..., None]]:
    """Make ``behaviour(rank, world)`` a test that runs it on every rank of a local Gloo group
    of each size in ``worlds``: the test named as the behaviour, parametrized over the world."""

    def register(behaviour: Callable[[int, int], None]) -> Callable[..., None]:
        for world in worlds:
            BEHAVIOURS.setdefault(world, {})[behaviour.__name__] = behaviour

        @pytest.mark.parametrize("world", worlds)
        def test(process_sets: "ProcessSets", world: int) -> None:
            process_sets.verify(world, behaviour.__name__)

        test.__name__ = test.__qualname__ = behaviour.__name__
        test.__doc__ = behaviour.__doc__
        return test

    return register


def run_behaviours(rank: int, world: int, names: list[tuple[str, str]]) -> dict[str, str | None]:
    """In each process: import the modules that register the behaviours (module, name), run the
    behaviours in order; the traceback of each that failed (None where it passed)."""
    results: dict[str, str | None] = {}
    for module, name in names:
        try:
            importlib.import_module(module)
            BEHAVIOURS[world][name](rank, world)
            results[name] = None
        except BaseException:  # noqa: BLE001 - reported by the parent's test
            results[name] = traceback.format_exc()
    return results


def _registered(world: int, names: list[str]) -> list[tuple[str, str]]:
    return [(BEHAVIOURS[world][name].__module__, name) for name in names]


class ProcessSets:
    """Runs every behaviour of a world size in ONE set of processes (their start-up dominates
    the cost), the first time one of them is tested. Where that set dies (a crash, a timeout),
    each behaviour is run again in a set of its own when it is tested, so that one failure fails
    one test."""

    def __init__(self) -> None:
        self._outcomes: dict[int, list[dict[str, str | None]] | None] = {}

    def verify(self, world: int, name: str) -> None:
        if world not in self._outcomes:
            try:
                self._outcomes[world] = run_local_group(run_behaviours, world, _registered(world, list(BEHAVIOURS[world])), timeout_s=30)
            except Exception:  # noqa: BLE001 - each behaviour is retried on its own below
                self._outcomes[world] = None
        outcome = self._outcomes[world]
        if outcome is None:
            outcome = run_local_group(run_behaviours, world, _registered(world, [name]), timeout_s=30)
        failures = [f"rank {rank}:\n{result[name]}" for rank, result in enumerate(outcome) if result[name]]
        assert not failures, "\n".join(failures)


_PROCESS_SETS = ProcessSets()


@pytest.fixture
def process_sets() -> ProcessSets:
    """The one ProcessSets of the test run, shared by every file that imports this fixture."""
    return _PROCESS_SETS
