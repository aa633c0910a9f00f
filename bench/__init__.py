"""Benchmarks of the worker engine (run as `python -m bench.steerling`, `python -m bench.isd`,
`python -m bench.long_context`); the GPU floors (bench.floor)."""
