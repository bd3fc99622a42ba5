"""Runs in the fork server: its entry point, ``python -m pytest_dsrepro.worlds.server`` (``serving.main``)."""

from .serving import main

if __name__ == "__main__":
    main()
