"""Layer 2: pipeline parallelism: schedules as values (``schedule``), their timetables and
predicted bubble and activation memory, and the pipelined loss over a ``stage`` mesh axis
(``run``), the same pipeline as separate programs in separate processes joined by the host
transport (``host``), with the choice of how stages exchange activations across processes
(``transport``).

Depends on the base modules (errors, jaxapi, tables) and on net (layer 1: the host transport's
pair links, for ``host``); the planner (layer 3) prices schedules
with it and its ``stage`` role hands ``dtenjax.pipeline`` the values it chose.
"""
