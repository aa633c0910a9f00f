"""The worker's engine: one runtime (runtime.py: the step loop; request_table.py: admission,
preemption, finishing) and two decoding strategies on it, block diffusion for Steerling
(steerling_engine.py, steerling_runner.py) and ISD for causal models (isd_engine.py,
isd_runner.py), over a paged KV cache (kv_cache.py, attention.py) with CUDA graphs (graphs.py)."""
