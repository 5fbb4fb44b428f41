"""Layer 5: pipeline parallelism: schedules as values (``schedule``), their timetables and
predicted bubble and activation memory, and the pipelined loss over a ``stage`` mesh axis
(``run``), with the choice of how stages exchange activations across processes (``transport``).

Depends only on the base modules (errors, jaxapi, tables).
"""
