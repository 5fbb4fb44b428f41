"""Layer 3: decisions before a step runs: the alpha-beta cost model, the planner, meshes, placements
and ``explain``.

Depends on ``topology`` and the base modules.
"""
