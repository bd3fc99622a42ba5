"""The worlds: N-rank torch.distributed worlds forked from a preloaded fork server, and the in-place launcher path.

By process:
- the pytest process: ``client`` (the fork server's lifecycle, one world's run, the outcome), ``launcher`` (in place,
  when torchrun or SLURM made pytest a rank);
- the fork server: ``server`` (``python -m pytest_dsrepro.worlds.server``), ``comm_op`` (DeepSpeed's CPU comm op);
- inside a rank: ``rank`` (rendezvous, process group, fixes, the body);
- shared by them: ``protocol`` (every message and record that crosses a process boundary), ``workdir`` (a world's
  directory and its files), ``shm`` (a world's ``/dev/shm`` buffers).

Imports ``core`` and ``inrank`` (and pytest's public API inside ranks), never the pytest side, the plugin or the
tools; torch and DeepSpeed only inside functions that run in the server or a rank.
"""
