"""The worlds: N-rank torch.distributed worlds forked from a preloaded fork server, and the in-place launcher path.

The tree says which process a module runs in (each module's docstring opens with it):
- ``client/``: the pytest process (its fork servers, one world's run, the outcome, GPU probe and leases);
- ``server/``: the fork server (``python -m pytest_dsrepro.worlds.server``), its store process and build child;
- ``rank/``: inside a rank (rendezvous, process group, fixes, the body, its report);
- ``launched/``: a pytest process that an external launcher (torchrun, SLURM) made a rank;
- shared by them, at this level: ``protocol`` (every message and record that crosses a process boundary, the report
  file and the reuse link), ``workdir`` (a world's directory and its files), ``shm`` (a world's ``/dev/shm``
  buffers), ``device_nodes`` (whether a GPU exists at all), ``prctl`` (Linux's process controls).

Imports ``core`` and ``inrank`` (and pytest's public API inside ranks), never the pytest side, the plugin or the
tools; torch and DeepSpeed only inside functions that run in the server or a rank. The client side never imports the
server or rank side.
"""
