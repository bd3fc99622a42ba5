"""The worlds: N-rank torch.distributed worlds forked from a preloaded fork server, and the in-place launcher path.

The tree says which process a module runs in (each module's docstring opens with it): ``client/`` the pytest process;
``server/`` the fork server (``python -m pytest_dsrepro.worlds.server``), its store process and build child; ``rank/``
inside a rank; ``launched/`` a pytest process that an external launcher (torchrun, SLURM) made a rank; the modules at
this level (``protocol``, ``workdir``, ``shm``, ``device_nodes``, ``prctl``) are shared by them all.

Imports ``core`` and ``inrank`` (and pytest's public API inside ranks), never the pytest side, the plugin or the tools;
torch and DeepSpeed only inside functions that run in the server or a rank; the client never imports server or rank.
"""
