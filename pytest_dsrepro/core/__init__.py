"""The pure core: options, world specs, version gates and verdicts, configs, outcomes, the results-file schema.

Runs in every process. Imports no torch, no pytest and no other subpackage, so every decision here is a plain
function tested without a world.
"""
