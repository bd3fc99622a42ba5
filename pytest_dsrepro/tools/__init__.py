"""The ``dsrepro`` command line: the catalogue, new repros, per-release installs, bisecting, the version matrix.

Runs in its own process; reads the core (and results files), never imports the worlds or the pytest side.
"""
