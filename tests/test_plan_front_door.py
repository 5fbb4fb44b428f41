"""``dtenjax.plan`` called as a user coming from MaxText / FSDP2 / flax+optax calls it: the
planned step jitted with ``jax.jit``'s own options (``static_argnums``, arguments by name),
arrays already laid out on the user's own mesh, and bad options to the plan and its methods.
Each test stands for a program written from docs/planner.md that failed with a raw JAX error;
values are compared with the plain ``jax.jit`` of the same step, and bad input must raise a
``DtenjaxError`` naming the value and the fix. One small plan per test (8 simulated devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax


def _loss(p, x):
  return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)


def _args():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (16, 32)), "w2": jax.random.normal(k2, (32, 16))}
  return params, jax.random.normal(k3, (16, 16))


def _close(got, want):
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_plan_jit_takes_static_argnums_and_arguments_by_name():
  """A step with a Python flag (``train``), planned with the flag and jitted as a user jits it,
  ``plan.jit(step, static_argnums=2)``, failed with JAX's "pjit in_shardings ... is the wrong
  length": the plan's in_shardings still held one for the static flag. And a call passing an
  argument by name, ``train_step(params, x=x, train=True)``, failed with JAX's "pjit does not
  support kwargs when in_shardings is specified"; now it is bound to its place, and a keyword the
  plan has no place for is named with the functools.partial fix."""
  params, x = _args()

  def step(p, x, train, *, lr=0.1):
    v, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - lr * train * b, p, g), v

  plan = dtenjax.plan(step, params, x, True, batch_argnums=1)
  want = jax.jit(step, static_argnums=2)(params, x, True)
  _close(plan.jit(step, static_argnums=2)(params, x, True), want)
  _close(plan.jit(step, static_argnames="train")(params, x=x, train=True), want)
  with pytest.raises(dtenjax.PlacementError, match=r"keyword arguments \['lr'\].*functools\."
                     r"partial\(step, lr=\.\.\.\)"):
    plan.jit(step, static_argnums=2)(params, x, True, lr=0.2)
  with pytest.raises(dtenjax.PlacementError, match=r"static_argnums \[3\] are not positions of "
                     r"the plan's 3 arguments"):
    plan.jit(step, static_argnums=3)


def test_plan_jit_names_an_argument_laid_out_on_another_mesh_or_a_short_batch():
  """Parameters already placed on the user's own ``jax.make_mesh`` (as a MaxText or FSDP2 user
  holds them when trying the planner) handed to ``plan.jit(step)`` failed with JAX's "Sharding
  passed to jit does not match the sharding on the respective arg"; the error now names the leaf
  and ``plan.shard``, after which the step runs and matches the plain jax.jit. A last batch of
  fewer rows than the plan splits ended in JAX's IndivisibleError; it is named with the fix."""
  params, x = _args()

  def step(p, x):
    v, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v

  mine = jax.make_mesh((4, 2), ("a", "b"))
  held = jax.device_put(params, NamedSharding(mine, P("a")))
  plan = dtenjax.plan(step, held, x, mesh={"fsdp": 8})
  train = plan.jit(step)
  with pytest.raises(dtenjax.PlacementError, match=r"argument 0 leaf \['w1'\] lies on .*"
                     r"plan\.shard\(\*args\)"):
    train(held, x)
  _close(train(*plan.shard(held, x)), jax.jit(step)(params, x))
  with pytest.raises(dtenjax.PlacementError, match=r"argument 1 leaf \(root\) has shape \(12, 16\), "
                     r"whose dimension 0 \(12\) .* splits 8 ways \(the plan was made for \(16, "
                     r"16\)\); give a multiple of 8"):
    train(params, x[:12])            # the last batch of an epoch, fewer rows than planned


def test_bad_options_to_plan_and_its_methods_name_the_value_and_the_fix():
  """Each of these ended in a raw ValueError, TypeError or AttributeError from deep inside (or,
  for ``donate="yes"`` and a non-callable ``plan.jit``, was taken and failed later); a step that
  branches on a Python flag given as an example argument got JAX's TracerBoolConversionError
  with no word of how to plan it; ``plan.shard`` of ``jax.eval_shape``'s abstract arguments
  (the docs' own example arguments) ended in JAX's "not a valid JAX type", and
  ``plan.check(..., compiler_options="O3")`` in "'str' object has no attribute 'items'". A step
  that returns no new state (nnx's in-place ``optimizer.update``, whose update jax.jit drops) was
  planned without a word; its report now says so."""
  params, x = _args()

  def step(p, x):
    v, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v

  bad = [(dict(measure="yes"), r"measure='yes' must be True, False or a whole number"),
         (dict(measure=0.5), r"measure=0\.5 must be"),
         (dict(batch_argnums="x"), r"batch_argnums='x' must be an int or a tuple of ints"),
         (dict(topology="h100_64"),
          r"topology='h100_64' is a str.*dtenjax\.Topology\.fixture\('h100_64'\)"),
         (dict(donate="yes"), r"donate='yes' must be True")]
  for kwargs, message in bad:
    with pytest.raises(dtenjax.PlacementError, match=message):
      dtenjax.plan(step, params, x, **kwargs)

  def flagged(p, x, train):              # a Python flag the step branches on, as flax users write
    return step(p, 2 * x if train else x)

  with pytest.raises(dtenjax.PlacementError, match=r"branches in Python on an argument.*"
                     r"plan\(functools\.partial\(step, train=True\), \.\.\.\)"):
    dtenjax.plan(flagged, params, x, True, batch_argnums=1)
  plan = dtenjax.plan(step, params, x, mesh={"data": 8})
  assert not any(n.startswith("state:") for n in plan.notes), plan.notes

  def in_place(p, x):                    # nnx's train_step: optimizer.update(model, grads)
    v, g = jax.value_and_grad(_loss)(p, x)
    jax.tree.map(lambda a, b: a - 0.1 * b, p, g)          # the update, dropped
    return v

  lost = dtenjax.plan(in_place, params, x, mesh={"data": 8})
  assert any(n.startswith("state: the step returns no new value of its state arguments") and
             "nnx.state" in n for n in lost.notes), lost.notes
  with pytest.raises(dtenjax.PlacementError, match=r"StepPlan\.jit: step is a dict, not callable"):
    plan.jit(params)
  with pytest.raises(dtenjax.PlacementError, match=r"StepPlan\.check: step is a dict"):
    plan.check(params, x)
  with pytest.raises(dtenjax.PlacementError, match=r"StepPlan\.check: the plan has 2 arguments, "
                     r"got 1"):
    plan.check(step, params)
  with pytest.raises(dtenjax.PlacementError, match=r"compiler_options='O3' must be a dict"):
    plan.check(step, params, x, compiler_options="O3")
  abstract = jax.eval_shape(lambda: params)
  with pytest.raises(dtenjax.PlacementError, match=r"StepPlan\.shard: argument 0 leaf \['w1'\] is "
                     r"a jax\.ShapeDtypeStruct .*jax\.jit\(init, out_shardings="):
    plan.shard(abstract, x)
  train = plan.jit(functools.partial(step))       # the jax.jit function's own methods are kept
  assert train.lower(params, x).compile().memory_analysis() is not None


def test_pins_and_rules_the_plan_cannot_lay_out_are_named():
  """A pin naming an axis the planner lacks ended in a raw KeyError; one naming an axis twice, or
  more dimensions than the leaf has, or splitting a dimension its mesh axis does not divide, was
  planned and failed at ``plan.jit`` with JAX's DuplicateSpecError / "incompatible with its
  sharding annotation" / IndivisibleError; a pin that is a string was silently planned instead;
  ``rules="fsdp"`` ended in "not enough values to unpack"."""
  params, x = _args()
  params = {**params, "b": jnp.zeros((12,))}

  def step(p, x):
    v, g = jax.value_and_grad(lambda p: _loss(p, x) + jnp.sum(p["b"]))(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v

  def pin(w1=None, b=None):
    return ({"w1": w1, "w2": None, "b": b}, None)

  bad = [(pin(P("model")), r"pinned\[0\] at \['w1'\]: .*'model'.* names axes \['model'\] "
          r"the planner does not have"),
         (pin(P("fsdp", "fsdp")), r"puts axes \['fsdp'\] on more than one dimension"),
         (pin(P(None, None, "fsdp")), r"has 3 entries for a leaf of shape \(16, 32\)"),
         (pin("fsdp"), r"at \['w1'\] is 'fsdp' \(str\); pin a leaf with a jax\.sharding\."
          r"PartitionSpec"),
         (pin(b=P("fsdp")), r"leaf \[0\]\['b'\] is pinned by you .*'fsdp'.*, which "
          r"splits its dimension 0 \(12\) 8 ways")]
  for pinned, message in bad:
    with pytest.raises(dtenjax.PlacementError, match=message):
      dtenjax.plan(step, params, x, pinned=pinned, mesh={"fsdp": 8})
  with pytest.raises(dtenjax.PlacementError, match=r"rules='fsdp' must be flax logical axis "
                     r"rules: a sequence of \(name, mesh axis\) pairs"):
    dtenjax.plan(step, params, x, rules="fsdp")
  plan = dtenjax.plan(step, params, x, pinned=pin(b=P("fsdp")), mesh={"fsdp": 4, "tensor": 2})
  assert plan.leaves[0].spec == P("fsdp")              # 12 over 4 divides: kept as pinned
  _close(plan.jit(step)(params, x), jax.jit(step)(params, x))


def test_the_cli_refuses_a_fixtures_check_and_a_factorys_keyword_arguments(tmp_path, monkeypatch,
                                                                          capsys):
  """``dtenjax plan ... --fixture h100_64 --check`` planned, printed the plan, then failed with
  "devices [8, 9, ...] are not among the 8 present": the check compiles on this machine. Now
  refused at once, as a usage error naming both sets of devices. And an ``--args`` factory's
  keyword arguments (``{"args": ..., "kwargs": ...}``, as ``dtenjax explain`` takes them) were
  dropped without a word: the step was planned without them."""
  from dtenjax._src.cli import main as cli
  (tmp_path / "fdstep.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def step(p, x):\n  return jnp.sum(x @ p)\n"
      "def example():\n  return (jax.ShapeDtypeStruct((8, 8), jnp.float32),\n"
      "          jax.ShapeDtypeStruct((16, 8), jnp.float32))\n"
      "def named():\n  return {'args': example(), 'kwargs': {'scale': 2.0}}\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  rc = cli.main(["plan", "fdstep:step", "--args", "fdstep:example", "--fixture", "h100_64",
                 "--check"], prog="dtenjax")
  out, err = capsys.readouterr()
  assert rc == 2 and out == "", (rc, out)
  assert err.strip() == (
      "dtenjax plan: error: --check with --fixture 'h100_64': the check compiles the plan on "
      "this machine's devices (8 cpu), and the fixture plans for 64 gpu devices; run --check "
      "without --fixture on the machine the plan is for"), err
  rc = cli.main(["plan", "fdstep:step", "--args", "fdstep:named"], prog="dtenjax")
  out, err = capsys.readouterr()
  assert rc == 2 and out == "", (rc, out)
  assert "--args 'fdstep:named' returned keyword arguments ['scale']; the planner plans the " \
         "step's positional arguments" in err, err


def test_plan_jit_of_another_plans_jit_runs_this_plans_layout():
  """A user re-planning on another mesh passes the step they already jitted,
  ``plan2.jit(plan1.jit(step))``: ``functools.update_wrapper`` copied the first function's
  attributes over the new one's, so the call ran plan 1's program, on plan 1's mesh, without a
  word. Now each plan's function runs its own layout (the step the first one wraps)."""
  params, x = _args()

  def step(p, x):
    v, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v

  first = dtenjax.plan(step, params, x, mesh={"fsdp": 8})
  second = dtenjax.plan(step, params, x, mesh={"data": 4, "tensor": 2})
  train = second.jit(first.jit(step))
  got = train(params, x)
  assert got[0]["w1"].sharding.mesh.shape == dict(zip(second.axis_names, second.mesh_shape))
  assert got[0]["w1"].sharding.spec == second.specs[0]["w1"]
  _close(got, jax.jit(step)(params, x))


def test_plan_jit_lowers_by_name_and_names_a_wrong_number_of_arguments():
  """The call took an argument by name, but ``train.lower(params, x=x)`` (and ``trace``,
  ``eval_shape``) ended in JAX's "pjit does not support kwargs when in_shardings is specified";
  and a call with one argument too many or too few in JAX's "pjit in_shardings specification
  must be a tree prefix of the positional arguments tuple". Both are as the call takes them
  now."""
  params, x = _args()

  def step(p, x):
    return jax.tree.map(lambda a: 2 * a, p), _loss(p, x)

  plan = dtenjax.plan(step, params, x, mesh={"data": 8})
  train = plan.jit(step)
  lowered = train.lower(params, x=x)
  assert lowered.as_text() == train.lower(params, x).as_text()
  assert train.trace(p=params, x=x).jaxpr == train.trace(params, x).jaxpr
  shapes = train.eval_shape(params, x=x)
  assert shapes[1].shape == () and shapes[0]["w1"].shape == (16, 32)
  for args in ((params,), (params, x, x)):
    with pytest.raises(dtenjax.PlacementError, match=rf"StepPlan\.jit: the plan has 2 arguments, "
                       rf"got {len(args)}; pass the step's arguments"):
      train(*args)
    with pytest.raises(dtenjax.PlacementError, match=rf"the plan has 2 arguments, got {len(args)}"):
      train.lower(*args)


def test_a_step_returning_its_state_reshaped_or_through_a_loop_gets_no_state_note():
  """The report's note "the step returns no new value of its state" (nnx's in-place update)
  looked for an output tied to the state by elementwise work only: a step that runs its
  optimizer steps in a ``lax.scan`` (several steps per call), or returns a weight transposed
  back or reshaped, got the note though it returns every new weight."""
  params, x = _args()

  def looped(p, x):
    def body(p, xb):
      v, g = jax.value_and_grad(_loss)(p, xb)
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v
    p, vs = jax.lax.scan(body, p, x.reshape(2, 8, 16))
    return p, vs.mean()

  def reshaped(p, x):
    v, g = jax.value_and_grad(_loss)(p, x)
    new = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return {"w1": new["w1"].T.T, "w2": new["w2"].reshape(-1).reshape(32, 16)}, v

  for step in (looped, reshaped):
    plan = dtenjax.plan(step, params, x, mesh={"data": 8})
    assert not any(n.startswith("state:") for n in plan.notes), (step.__name__, plan.notes)


def test_a_call_by_name_missing_a_planned_argument_names_the_count():
  """A step planned with its learning rate as an argument, ``plan(step, params, x, 0.1)``, called
  ``train(params, x=x)`` (the default left to the signature): the error said keyword arguments
  ['x'] are not among the plan's 3 arguments, naming the one argument that has its place. The
  missing one is named by the count now; only a keyword the plan has no place for gets the
  functools.partial fix."""
  params, x = _args()

  def step(p, x, lr=0.1, *, decay=0.0):
    v, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a * (1 - decay) - lr * b, p, g), v

  train = dtenjax.plan(step, params, x, 0.1, batch_argnums=1, mesh={"data": 8}).jit(step)
  with pytest.raises(dtenjax.PlacementError, match=r"the plan has 3 arguments, got 2"):
    train(params, x=x)
  with pytest.raises(dtenjax.PlacementError, match=r"keyword arguments \['decay'\] are not among "
                     r"the 3 arguments.*functools\.partial\(step, decay=\.\.\.\)"):
    train(params, x, lr=0.1, decay=0.1)


def test_a_step_branching_on_its_loss_is_told_of_lax_cond_not_a_partial():
  """A step that skips its update in Python where the loss blew up (``if loss > 1e6: return p``)
  was refused with "bind such a value (a train flag, a size) ... functools.partial(step,
  train=True)": no argument of it is a flag, and the fix is the one jax.jit needs as well, a
  ``jax.lax.cond`` or ``jnp.where`` of the computed value."""
  params, x = _args()

  def step(p, x):
    v, g = jax.value_and_grad(_loss)(p, x)
    if v > 1e6:
      return p, v
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), v

  with pytest.raises(dtenjax.PlacementError, match=r"branches in Python on a value computed from "
                     r"its arrays.*jax\.lax\.cond or jnp\.where") as e:
    dtenjax.plan(step, params, x)
  assert "functools.partial" not in str(e.value)


def test_plan_jit_s_function_shows_its_step_and_mesh():
  """``print(train_step)`` (a training loop's log, a debugger) showed
  ``<dtenjax._src.planning.result._PlannedStep object at 0x...>``: neither the step nor the
  layout. As jax.jit's ``<PjitFunction of <function step ...>>`` it names the step, and the mesh
  it runs on."""
  params, x = _args()

  def step(p, x):
    return jax.tree.map(lambda a: 2 * a, p), _loss(p, x)

  train = dtenjax.plan(step, params, x, mesh={"data": 8}).jit(step)
  assert repr(train) == f"<plan.jit of {step!r} on mesh {{'data': 8}}>"
