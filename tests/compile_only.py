"""Compiler options for a program a test compiles only to read what XLA made of it (its optimised
HLO: collectives, fusions, loops; its buffer assignment: ``memory_analysis()``), not its speed.

XLA's HLO passes and its buffer assignment run before LLVM turns each fused kernel into machine
code, and LLVM's optimisation is a large part of an XLA:CPU compile of the planner's steps (a
small decoder's data-parallel step: 2.1 s of CPU, 1.3 s at ``xla_backend_optimization_level=0``).
At level 0 the optimised HLO and the memory are those of the default level: one step is compiled
both ways by tests/test_step_planner_memory.py, and every program the planner's memory, gather,
sequence, roles and GPU-memory tests compiled was compared when the option was chosen
(docs/testing.md, the thirteenth round). Only the machine code is another: slower where a test
runs it (tests/test_gather.py's values: the same HLO computes the same values)."""

from tests.helpers import DEFAULT_CPU_EMITTERS

LLVM_O0 = {"xla_backend_optimization_level": 0}
# The program users get (XLA's default fusion emitters, tests/helpers.py), compiled quicker.
USERS_PROGRAM = {**DEFAULT_CPU_EMITTERS, **LLVM_O0}
# The same for a process a test starts (its XLA_FLAGS): a bench, an example or the command line
# whose claims read what XLA made, never its speed or a stored digest.
LLVM_O0_FLAGS = " ".join(f"--{k}={v}" for k, v in LLVM_O0.items())
