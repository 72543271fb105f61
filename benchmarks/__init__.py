"""The benchmark scripts (``bench_*.py``, ``check_*.py``, ``tune_head.py``, ``head_regression.py``) and the
pieces they share: ``common`` (the run stamp), ``harness`` (step timing, sync audit, profilers) and
``real_workload`` (the real-workload benchmark's harness).

A package, so that the scripts and the tests import these pieces by name. Run a script from the
repository root as ``python -m benchmarks.<script> ...``, or as ``python benchmarks/<script>.py ...``
with the repository root on ``PYTHONPATH`` (``export PYTHONPATH=$PWD:$PYTHONPATH``; torchrun takes
``-m benchmarks.<script>`` too). Not part of the installed package (pyproject.toml ships
``gradcache_sparton`` only).
"""
