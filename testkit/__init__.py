"""Tools for the tests, the benchmarks and ``test.py``, not part of the library (not installed):
a local process group runner and a collective counter, and the lockstep trainer."""
