"""The suite tests our kernels: a lone replica takes them (as ``SYNCBN_LONE_REPLICA=ours``)
wherever they are compiled, whatever the measured table of ``functions/lone_replica.py`` would
pick on this machine, so that every layer test exercises them. ``tests/test_lone_replica.py``
tests the measured routing itself (and torch's route) under ``lone_replica.forced``."""
import pytest

from syncbn.functions import lone_replica


@pytest.fixture(autouse=True)
def lone_replica_takes_our_kernels():
    with lone_replica.forced("ours"):
        yield
