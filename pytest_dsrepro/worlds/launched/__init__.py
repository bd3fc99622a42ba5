"""A pytest process that an external launcher (torchrun, SLURM) made a rank: no fork server, the body runs in place.

``launcher`` (what the launcher made of this process and its node), ``launched_world`` (one world across the
launched pytest processes: a process group per test, rank 0's outcome), ``peers`` (the launcher's store, and which
ranks died or were interrupted), ``lockstep`` (every rank at the same test), ``body_watch`` (the body's watcher).
"""
