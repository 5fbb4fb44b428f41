"""Layer 4: decisions before a step runs: the planner, meshes, placements
and ``explain``.

Depends on ``topology`` and the base modules.
"""
