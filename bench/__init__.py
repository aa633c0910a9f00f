"""Benchmarks of the worker engine (run as `python -m bench.steerling`, `python -m bench.isd`); the GPU floor (bench.floor)."""
