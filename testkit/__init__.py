"""Tools for the tests, the benchmarks and ``test.py``, not part of the library (not installed):
a local process group runner and a collective counter, the lockstep trainer, ``test.py``'s run, and
what several test files share (``docs/code-map.md`` names each module)."""
