"""A pytest process that an external launcher (torchrun, SLURM) made a rank: no fork server, the body runs in place.

``launcher`` (what the launcher made of this process and its node), ``launched_world`` (one world across the
launched pytest processes: lockstep, a process group per test, the watcher, rank 0's outcome).
"""
