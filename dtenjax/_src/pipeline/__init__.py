"""Layer 2: pipeline parallelism: schedules as values (``schedule``), their timetables and
predicted bubble and activation memory, and the pipelined loss over a ``stage`` mesh axis
(``run``), with the choice of how stages exchange activations across processes (``transport``).

Depends only on the base modules (errors, jaxapi, tables); the planner (layer 3) prices schedules
with it and its ``stage`` role hands ``dtenjax.pipeline`` the values it chose.
"""
