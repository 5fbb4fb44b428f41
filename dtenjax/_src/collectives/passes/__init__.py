"""jaxpr passes over users' functions: psum substitution, communication fusion, the memory plan.

The top of the ``collectives`` layer: passes import the public collectives (``all_reduce``), never the reverse.
"""
