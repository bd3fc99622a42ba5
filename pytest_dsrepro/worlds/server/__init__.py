"""The fork server process: one preloaded interpreter per pytest process and DeepSpeed accelerator that forks fresh
ranks for every world, started as ``python -m pytest_dsrepro.worlds.server`` (``__main__``, ``serving``).

``serving`` (its life and its one loop), ``dispatch`` (its answer to each message), ``spawning`` and ``store`` (the
processes it forks), ``kept`` (a reusable world between two tests), ``reaping`` (signalling and reaping), ``warmup``
and ``preload`` (what it imports ahead of its ranks), ``comm_op`` (DeepSpeed's CPU comm op), ``cuda_reexec`` (its
forks kept fit for CUDA).
"""
