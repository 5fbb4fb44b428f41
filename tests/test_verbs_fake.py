"""The emulated RDMA device the verbs tests run on (tests/fakeverbs/): it builds with the suite,
and it enforces the verbs contract as rdma-core documents it.

tests/fakeverbs/contract.cc drives the device through the verbs API the way an application does
and compares every answer with the man pages and the InfiniBand RC rules (state machine, R_Key and
L_Key checks, CQ overrun, queue depths, RNR and transport retries, completion order, deregistering
while work is posted, flush errors, a responder in another process), once with an InfiniBand and
once with a RoCE port. A device that stopped enforcing any of it would let the provider's tests
pass against behaviour no hardware has.
"""

import os
import subprocess

import pytest

from tests import fakeverbs

CHECKS = ("device_and_port", "qp_state_machine", "write_with_imm_and_send", "remote_access",
          "local_protection", "reg_mr_access", "cq_depth_and_overrun", "send_queue_depth",
          "receiver_not_ready", "ordering", "dereg_while_posted", "flush_in_error",
          "completion_channel", "retry_exceeded", "cross_process", "no_leaks")


@pytest.fixture(scope="module", params=["ib", "roce"])
def contract(request):
  exe = fakeverbs.build()["contract"]   # a build failure raises here: every check fails
  env = dict(os.environ, FAKEVERBS_FABRIC=fakeverbs.fabric_name("contract"),
             FAKEVERBS_LINK_LAYER=request.param)
  proc = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=120)
  lines = {}
  for line in proc.stdout.splitlines():
    verdict, _, rest = line.partition(" ")
    name, _, why = rest.partition(": ")
    lines[name] = (verdict, why)
  return request.param, lines, proc


@pytest.mark.parametrize("check", CHECKS)
def test_emulated_device_enforces_the_documented_contract(contract, check):
  link, lines, proc = contract
  assert check in lines, f"{link}: check {check} did not run\n{proc.stdout}\n{proc.stderr}"
  verdict, why = lines[check]
  assert verdict == "PASS", f"{link}: {check}: {why}"


def test_every_check_of_the_program_is_listed_here(contract):
  link, lines, proc = contract
  assert set(lines) == set(CHECKS), (link, proc.stdout)
  assert proc.returncode == (0 if all(v == "PASS" for v, _ in lines.values()) else 1)
