"""The pytest side: what ``plugin.py``'s hooks call in the pytest process (settings, markers, collection, running
a test in its world, judging and recording it). Imports the core and the worlds' client, never torch."""
