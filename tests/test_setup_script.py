"""scripts/setup.sh, run again with everything in place (as scripts/test.sh does before every
run), does nothing: no pip, no apt, no build, so it needs no network. And which CUDA
architectures the set-up builds (scripts/cuda_archs.cmake): the test command's one architecture
on a machine without a GPU, and a build that reports what its set-up asked for."""

import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_setup_does_nothing_when_everything_is_in_place(tmp_path):
  stamp = ROOT / ".venv" / ".dtenjax-setup-done"
  assert stamp.exists(), "scripts/setup.sh did not finish here (no stamp)"
  before = stamp.stat().st_mtime_ns
  # Any pip or apt-get call fails: they are shadowed by failing commands, and pip's index is an
  # address nothing listens on.
  fake = tmp_path / "bin"
  fake.mkdir()
  for tool in ("apt-get", "pip", "pip3"):
    (fake / tool).write_text("#!/bin/sh\necho \"$0 called\" >&2\nexit 97\n")
    (fake / tool).chmod(0o755)
  pip_log = tmp_path / "pip.log"           # written by any `python -m pip` run (PIP_LOG)
  env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PIP_LOG=str(pip_log),
             PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="",
             PIP_FIND_LINKS="", PIP_NO_INDEX="1")
  # in place = built for what this run asks: scripts/test.sh's architectures if it built them
  env.pop("DTENJAX_CUDA_ARCHS_WITHOUT_GPU", None)
  env.update(_stamp_request(stamp))
  t0 = time.monotonic()
  r = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines() == [r.stdout.strip()] and r.stdout.startswith("dtenjax 0.1.0 |")
  assert "called" not in r.stderr and "rebuilding" not in r.stdout
  assert not pip_log.exists(), pip_log.read_text()[-2000:]
  assert stamp.stat().st_mtime_ns == before
  assert time.monotonic() - t0 < 120


def _stamp_request(stamp: pathlib.Path) -> dict[str, str]:
  """The CUDA architecture request the set-up recorded in its stamp, as the environment it
  came from (scripts/setup.sh: report --stamp)."""
  asked = dict(ln.partition("=")[::2] for ln in stamp.read_text().splitlines() if "=" in ln)
  return ({"DTENJAX_CUDA_ARCHS_WITHOUT_GPU": asked["cuda_archs_without_gpu"]}
          if "cuda_archs_without_gpu" in asked else {})


def test_a_plain_setup_rebuilds_what_the_test_command_built_for_fewer_architectures(tmp_path):
  """The stamp of a set-up that scripts/test.sh asked for sm_80 alone makes a plain set-up
  rebuild the extension (for the default list; no package index), and the test command's next
  set-up keep it: an image built with `bash scripts/setup.sh` never ships the test build."""
  repo = tmp_path / "repo"
  for d in ("scripts", "csrc", "custom_calls", ".venv/bin"):
    (repo / d).mkdir(parents=True)
  for f in ("pyproject.toml", "CMakeLists.txt", "scripts/cuda_archs.cmake"):
    (repo / f).write_text("")
  (repo / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
  calls = tmp_path / "calls"
  # A .venv whose python says every requirement is met and records every pip run.
  (repo / ".venv" / "bin" / "python").write_text(
      f"#!/bin/sh\nif [ \"$1\" = -m ]; then echo \"$*\" >> {calls}; fi\ncat >/dev/null\n"
      "echo 'dtenjax 0.1.0 | native: (fake)'\n")
  (repo / ".venv" / "bin" / "python").chmod(0o755)
  stamp = repo / ".venv" / ".dtenjax-setup-done"
  stamp.write_text("cuda_archs_without_gpu=80\n")
  old = time.time() - 60
  for f in repo.rglob("*"):
    os.utime(f, (old, old))
  base = {k: v for k, v in os.environ.items() if k != "DTENJAX_CUDA_ARCHS_WITHOUT_GPU"}
  for asked, rebuilds in (("80", False), (None, True), ("90", True)):
    calls.unlink(missing_ok=True)
    env = base if asked is None else dict(base, DTENJAX_CUDA_ARCHS_WITHOUT_GPU=asked)
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    ran = calls.read_text() if calls.exists() else ""
    assert ("pip install -q --no-build-isolation --no-deps -e ." in ran) == rebuilds, (asked, ran)
    assert ("DTENJAX_CUDA_ARCHS_WITHOUT_GPU=80" in r.stdout) == rebuilds, r.stdout


def _fake_python(tmp_path, *, ensurepip: bool, headers: bool) -> pathlib.Path:
  """A python3 that behaves like Debian's without python3-venv (no ensurepip) and without
  python3-dev (no Python.h): the two set-up needs a bare image lacks."""
  real = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True,
                        text=True, check=True).stdout.strip()
  include = tmp_path / "include"
  include.mkdir(exist_ok=True)
  if headers:
    (include / "Python.h").write_text("")
  code = ("import sys, sysconfig; paths = sysconfig.get_paths; "
          f"sysconfig.get_paths = lambda *a, **k: {{**paths(*a, **k), 'include': {str(include)!r}}}; "
          + ("" if ensurepip else "sys.modules['ensurepip'] = None; "))
  fake = tmp_path / "python3"
  fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then shift; exec {real} -c \"{code}$1\" \"$@\"; fi\n"
                  f"exec {real} \"$@\"\n")
  fake.chmod(0o755)
  return fake


def test_setup_names_the_system_packages_a_bare_debian_lacks(tmp_path):
  """--check-system reports python3-venv, python3-dev and g++ when they are missing, with the
  command that installs them, and passes when they are there (it never installs anything)."""
  base = dict(os.environ, PATH=os.environ["PATH"])
  bare = dict(base, PYTHON=str(_fake_python(tmp_path, ensurepip=False, headers=False)),
              CXX="no-such-compiler")
  r = subprocess.run(["bash", "scripts/setup.sh", "--check-system"], cwd=ROOT, env=bare,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 1, r.stdout + r.stderr
  assert "missing system packages: python3-venv python3-dev g++;" in r.stderr
  assert "apt-get install -y python3-venv python3-dev g++" in r.stderr
  ready = dict(base, PYTHON=str(_fake_python(tmp_path, ensurepip=True, headers=True)))
  r = subprocess.run(["bash", "scripts/setup.sh", "--check-system"], cwd=ROOT, env=ready,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and "has what the set-up needs" in r.stdout, r.stdout + r.stderr
  r = subprocess.run(["bash", "scripts/setup.sh", "--bogus"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def test_the_demo_command_sets_up_only_the_demo_extra():
  demo = (ROOT / "scripts" / "demo.sh").read_text()
  assert "bash scripts/setup.sh demo" in demo
  assert "[test]" not in demo


def test_the_test_command_builds_one_cuda_architecture_without_a_gpu(tmp_path):
  """scripts/test.sh asks the set-up for compute_80 PTX alone ("80-virtual": ptxas compiles it to
  sm_80 beside the tests, below) on a machine without a GPU, unless its caller named a list (an
  empty one gives CMakeLists.txt's default back)."""
  (tmp_path / "scripts").mkdir()
  (tmp_path / "scripts" / "test.sh").write_text((ROOT / "scripts" / "test.sh").read_text())
  seen = tmp_path / "asked"
  (tmp_path / "scripts" / "setup.sh").write_text(
      f"echo \"${{DTENJAX_CUDA_ARCHS_WITHOUT_GPU-unset}}\" > {seen}\n")
  (tmp_path / ".venv" / "bin").mkdir(parents=True)
  (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
  (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
  base = {k: v for k, v in os.environ.items() if k != "DTENJAX_CUDA_ARCHS_WITHOUT_GPU"}
  for given, asked in ((None, "80-virtual"), ("90", "90"), ("", "")):
    env = base if given is None else dict(base, DTENJAX_CUDA_ARCHS_WITHOUT_GPU=given)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh")], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert seen.read_text().strip() == asked, (given, seen.read_text())


def _cuda_archs(tmp_path, gpus: str | None, defines=(), **env) -> str:
  """What scripts/cuda_archs.cmake chooses (CMakeLists.txt includes it) with a fake nvidia-smi
  that lists ``gpus`` (None: fails, as on a machine without a driver)."""
  fake = tmp_path / "bin"
  fake.mkdir(exist_ok=True)
  smi = "exit 9\n" if gpus is None else f"printf '{gpus}'\n"
  (fake / "nvidia-smi").write_text("#!/bin/sh\n" + smi)
  (fake / "nvidia-smi").chmod(0o755)
  clean = {k: v for k, v in os.environ.items() if not k.startswith("DTENJAX_CUDA_ARCH")}
  r = subprocess.run([str(pathlib.Path(sys.executable).parent / "cmake"), *defines, "-P",
                      str(ROOT / "scripts" / "cuda_archs.cmake")],
                     env=dict(clean, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", **env),
                     capture_output=True, text=True, timeout=60, check=True)
  return r.stderr.strip()


def test_cuda_archs_are_the_gpus_else_the_callers_else_the_default(tmp_path):
  assert _cuda_archs(tmp_path, None) == "80-real;90 (the default without a GPU)"
  assert _cuda_archs(tmp_path, None, DTENJAX_CUDA_ARCHS_WITHOUT_GPU="80") == (
      "80 (DTENJAX_CUDA_ARCHS_WITHOUT_GPU, no GPU here: device code at -O0, a compile check)")
  assert _cuda_archs(tmp_path, "9.0\n9.0\n8.6\n", DTENJAX_CUDA_ARCHS_WITHOUT_GPU="80") == (
      "90;86 (this machine's GPUs)")
  assert _cuda_archs(tmp_path, "9.0\n", DTENJAX_CUDA_ARCHS="100;120",
                     DTENJAX_CUDA_ARCHS_WITHOUT_GPU="80") == "100;120 (DTENJAX_CUDA_ARCHS)"
  assert _cuda_archs(tmp_path, None, ["-DCMAKE_CUDA_ARCHITECTURES=75"],
                     DTENJAX_CUDA_ARCHS_WITHOUT_GPU="80") == "75 (CMAKE_CUDA_ARCHITECTURES)"


def test_the_build_has_the_cuda_architectures_its_set_up_asked_for(tmp_path):
  """The extension in place reports (build_info()["cuda_archs"], as `dtenjax info` and the
  set-up's last line do) what scripts/cuda_archs.cmake chooses here for the request the stamp
  recorded (scripts/test.sh's DTENJAX_CUDA_ARCHS_WITHOUT_GPU) and the build directory's cached
  list (an earlier DTENJAX_CUDA_ARCHS); in CI, no GPU and nvcc: "80"."""
  from dtenjax._src import ffi
  info = ffi.build_info()
  assert info["built"], info["error"]
  if not info["cuda"]:
    assert info["cuda_archs"] == ""
    return
  stamp = ROOT / ".venv" / ".dtenjax-setup-done"
  tag = f"cp{sys.version_info.major}{sys.version_info.minor}-"
  (cache,) = [p for p in (ROOT / "build").glob(f"{tag}*/CMakeCache.txt")]
  cached = [ln.split("=", 1)[1] for ln in cache.read_text().splitlines()
            if ln.startswith("CMAKE_CUDA_ARCHITECTURES:")]
  gpus = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                        capture_output=True, text=True, timeout=60, check=False).stdout \
      if shutil.which("nvidia-smi") else None
  chosen = _cuda_archs(tmp_path, gpus or None,
                       [f"-DCMAKE_CUDA_ARCHITECTURES={c}" for c in cached], **_stamp_request(stamp))
  assert info["cuda_archs"] == chosen.split(" (")[0].replace(";", ","), (info, chosen)
  # A build for no GPU here is a compile check of the kernels: every .cu file through NVVM (cicc)
  # and ptxas, both at -O0, its PTX kept for scripts/ptxas_check.sh; any other build optimises
  # them and keeps nothing. Read from the nvcc commands and the build directory.
  nvcc = [ln for ln in (cache.parent / "build.ninja").read_text().splitlines()
          if ln.strip().startswith("FLAGS =") and "--generate-code" in ln]
  assert nvcc, "no nvcc command in the build directory of a CUDA build"
  check = "no GPU here" in chosen
  ptx = cache.parent / "ptx"
  for flags in nvcc:
    assert ("-Xcicc -O0" in flags and "-Xptxas -O0" in flags) == check, (chosen, flags)
    assert (f"--keep --keep-dir {ptx}" in flags) == check, (chosen, flags)
  assert ptx.is_dir() == check, (chosen, ptx)
  if check:      # the manifest names every .cu file the build compiled, and a working ptxas
    manifest = (ptx / "manifest").read_text().splitlines()
    units = sorted(ln.removeprefix("unit=") for ln in manifest if ln.startswith("unit="))
    # CMakeFiles/<target>.dir/<source>.o; an object whose source is gone (renamed or removed since
    # an earlier build in this directory) is not this build's
    objects = [o.relative_to(cache.parent / "CMakeFiles")
               for o in cache.parent.glob("CMakeFiles/*/**/*.cu.o")]
    built = sorted(o.name.removesuffix(".cu.o") for o in objects
                   if ROOT.joinpath(*o.parts[1:]).with_suffix("").is_file())
    assert units == built and units, (units, built)
    assert [u for u in units if not (ptx / f"{u}.ptx").is_file()] == []
    (ptxas,) = [ln.removeprefix("ptxas=") for ln in manifest if ln.startswith("ptxas=")]
    assert os.access(ptxas, os.X_OK), ptxas


def _test_command(tmp_path, *, pytest_status: int, units: dict[str, str | None],
                  fast_compile: bool = False) -> tuple:
  """scripts/test.sh in a copy of scripts/ whose set-up does nothing and whose pytest exits
  with ``pytest_status``, over a build directory that kept PTX for ``units`` ({name: the .ptx
  text, or None for a missing file}); the manifest's ptxas is a fake that refuses a PTX
  containing "bad" (with a message) and writes the cubin otherwise, records each compile's
  arguments in ptxas_args, and lists -Ofast-compile in its --help where ``fast_compile`` (ptxas
  12.8 and later). (returncode, stdout, stderr)."""
  (tmp_path / "scripts").mkdir(parents=True, exist_ok=True)
  for f in ("test.sh", "ptxas_check.sh"):
    (tmp_path / "scripts" / f).write_text((ROOT / "scripts" / f).read_text())
  (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
  py = tmp_path / ".venv" / "bin" / "python"
  py.parent.mkdir(parents=True, exist_ok=True)
  py.write_text("#!/bin/sh\nif [ \"$1\" = -c ]; then echo build/cp311-; exit 0; fi\n"
                f"echo pytest ran; exit {pytest_status}\n")
  ptxas = tmp_path / "ptxas"
  help_text = "  --Ofast-compile <0|min|mid|max> (-Ofc)" if fast_compile else "  --opt-level (-O)"
  ptxas.write_text("#!/bin/sh\n# -arch=sm_NN -m64 -O0 FILE -o OUT [-Ofc max]\n"
                   f"if [ \"$1\" = --help ]; then echo '{help_text}'; exit 0; fi\n"
                   f"echo \"$4\" >> {tmp_path / 'ptxas_calls'}\n"
                   f"echo \"$*\" >> {tmp_path / 'ptxas_args'}\n"
                   "if grep -q bad \"$4\"; then echo \"ptxas fatal: $1 $3 refused $4\" >&2; exit 255; fi\n"
                   "echo \"$1 $3\" > \"$6\"\n")
  for f in (py, ptxas):
    f.chmod(0o755)
  ptx = tmp_path / "build" / "cp311-cp311-linux_x86_64" / "ptx"
  ptx.mkdir(parents=True, exist_ok=True)
  (ptx / "manifest").write_text(f"ptxas={ptxas}\n" + "".join(f"unit={u}\n" for u in units))
  for unit, text in units.items():
    if text is not None:
      (ptx / f"{unit}.ptx").write_text(text)
  r = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh")], capture_output=True,
                     text=True, timeout=60, check=False)
  return r.returncode, r.stdout, r.stderr


GOOD_PTX = ".version 9.0\n.target sm_80\n.address_size 64\n"


def test_the_test_command_runs_ptxas_beside_the_tests_and_fails_on_its_refusal(tmp_path):
  """A compile-check build's kept PTX goes through ptxas (for the PTX's own target, at -O0)
  while pytest runs; a unit ptxas refuses, or one whose PTX is missing, fails the test command
  even when every test passed, with ptxas's own message; pytest's failure is kept as it is.
  PTX that passed is not checked again until it changes."""
  code, out, err = _test_command(tmp_path / "ok", pytest_status=0,
                                 units={"kernels_a": GOOD_PTX, "kernels_b": GOOD_PTX})
  assert code == 0, err
  assert "pytest ran" in out
  assert "ptxas check: kernels_a (sm_80) compiled" in out
  assert "ptxas check: kernels_b (sm_80) compiled" in out
  calls = tmp_path / "ok" / "ptxas_calls"
  assert len(calls.read_text().splitlines()) == 2
  # a ptxas without -Ofast-compile gets -O0 alone; one with it (12.8 and later), -Ofc max too
  args = (tmp_path / "ok" / "ptxas_args").read_text().splitlines()
  assert len(args) == 2 and all(a.split()[2] == "-O0" and "-Ofc" not in a for a in args), args
  code, out, _ = _test_command(tmp_path / "fast", pytest_status=0, fast_compile=True,
                               units={"kernels_a": GOOD_PTX, "kernels_b": GOOD_PTX})
  assert code == 0 and "ptxas check: kernels_b (sm_80) compiled" in out, out
  args = (tmp_path / "fast" / "ptxas_args").read_text().splitlines()
  assert len(args) == 2, args
  assert all(a.split()[2] == "-O0" and a.endswith(" -Ofc max") for a in args), args
  code, out, err = _test_command(tmp_path / "ok", pytest_status=0,        # the same PTX again
                                 units={"kernels_a": GOOD_PTX, "kernels_b": GOOD_PTX})
  assert code == 0 and "pytest ran" in out and "passed this build's PTX in an earlier run" in out
  assert len(calls.read_text().splitlines()) == 2, (out, err)              # ptxas not run
  code, out, err = _test_command(tmp_path / "ok", pytest_status=0,        # one unit changed
                                 units={"kernels_a": GOOD_PTX, "kernels_b": GOOD_PTX + "bad\n"})
  assert code == 1 and "ptxas check: kernels_b (sm_80) does not compile" in err, (out, err)
  assert len(calls.read_text().splitlines()) == 4
  code, out, err = _test_command(tmp_path / "bad", pytest_status=0,
                                 units={"kernels_a": GOOD_PTX, "kernels_b": GOOD_PTX + "bad\n"})
  assert code == 1 and "pytest ran" in out, (code, out, err)
  assert "ptxas fatal: -arch=sm_80 -O0 refused" in err and "kernels_b.ptx" in err, err
  assert "ptxas check: kernels_b (sm_80) does not compile" in err
  assert "ptxas check: kernels_a (sm_80) compiled" in err        # the whole log, once
  assert "test: ptxas refused the kernels' PTX" in err
  code, _, err = _test_command(tmp_path / "missing", pytest_status=0,
                               units={"kernels_a": GOOD_PTX, "kernels_b": None})
  assert code == 1 and "kernels_b.ptx is missing" in err, (code, err)
  code, out, err = _test_command(tmp_path / "failed", pytest_status=5,
                                 units={"kernels_a": GOOD_PTX})
  assert code == 5 and "ptxas check: kernels_a (sm_80) compiled" in out, (code, out, err)


def test_the_set_up_byte_compiles_this_checkouts_modules():
  """dtenjax is installed editable, so compileall of the installed packages does not reach its
  sources: the set-up byte-compiles this checkout's dtenjax/, bench/, examples/ and the tests'
  helpers and workers too (not tests/test_*.py: pytest compiles those, rewriting asserts), or
  every fresh process the tests start would compile dtenjax again where PYTHONDONTWRITEBYTECODE
  is set. Every such module not changed since the set-up finished has a .pyc that Python
  accepts for its source (a timestamp or a checked hash, as compileall writes them)."""
  import importlib.util
  done = (ROOT / ".venv" / ".dtenjax-setup-done").stat().st_mtime
  checked = 0
  for src in [p for d in ("dtenjax", "bench", "examples", "tests") for p in (ROOT / d).rglob("*.py")]:
    stat = src.stat()
    if (src.parent.name == "tests" and src.name.startswith("test_")) or stat.st_mtime >= done:
      continue
    pyc = pathlib.Path(importlib.util.cache_from_source(str(src)))
    assert pyc.exists(), f"{src.relative_to(ROOT)} has no .pyc"
    head = pyc.read_bytes()[:16]
    field = lambda i: int.from_bytes(head[4 * i:4 * i + 4], "little")
    assert head[:4] == importlib.util.MAGIC_NUMBER, pyc
    if field(1) == 0:            # timestamp: the source's mtime and size
      assert (field(2), field(3)) == (int(stat.st_mtime) & 0xFFFFFFFF,
                                      stat.st_size & 0xFFFFFFFF), f"{pyc} is stale"
    else:                        # a hash of the source
      assert head[8:16] == importlib.util.source_hash(src.read_bytes()), f"{pyc} is stale"
    checked += 1
  assert checked > 150, checked
