"""The layout of the native code (docs/architecture.md, the map of csrc/): the transport is files of
one idea each, every source file is in the build, the verbs-only files are exactly those that need
<infiniband/verbs.h>, private headers stay private, and the kernels' 16-bit vector code exists once.

Reads the sources and CMakeLists.txt as text; builds nothing. Each checker is a function of text or
a directory, and is shown failing on a layout it must reject.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRANSPORT = ROOT / "csrc" / "transport"
LINE_BUDGET = 500   # lines per csrc/transport file: the files merged before this split had ~1000

# Each transport file's idea, by the definitions that make it; each is defined in that file only.
IDEAS = {
    "tcp.cc": [r"const Provider kTcp\b", r"Status ParseEndpoint\("],
    "tcp_handshake.cc": [r"Status ClientHandshake\(", r"Status TcpConnect\(", r"Status Proof\("],
    "tcp_accept.cc": [r"int ChooseVictim\(", r"Verdict Advance\(", r"Status TcpAccept\("],
    "tcp_pump.cc": [r"Status TcpSendSome\(", r"Status TcpRecvSome\(", r"Status TcpWait\("],
    "verbs_rules.cc": [r"Status CheckTransition\(", r"int SelectGidIndex\(",
                       r"Status ValidateQpParams\("],
    "verbs_loader.cc": [r"Status LoadLibrary\(", r"Status ListPorts\(", r"Status AcquireDevice\("],
    "verbs_provider.cc": [r"Status Setup\(", r"const Provider kVerbs\b"],
    "verbs_pump.cc": [r"Status VerbsSendSome\(", r"Status VerbsRecvSome\(", r"Status Drain\("],
    "verbs_pool.cc": [r"Status PoolReg\(", r"RegisterHooks PoolHooks\("],
    "arithmetic.cc": [r"Status Reduce\(", r"uint16_t F32ToBf16\("],
    "ring.cc": [r"class Comm::Ring\b", r"Status Comm::RunRing\("],
    "comm_registry.cc": [r"int64_t RegisterComm\(", r"std::shared_ptr<Comm> FindComm\("],
    "comm.cc": [r"Status Comm::ConnectRing\(", r"Status Comm::AllReduce\(",
                r"Status Comm::Submit\("],
}


def _transport_files(root=TRANSPORT):
  return sorted(p for p in root.iterdir() if p.suffix in (".cc", ".h"))


# --- line budget and file headers -----------------------------------------------------------------

def _over_budget(files, budget=LINE_BUDGET):
  return {p.name: n for p in files if (n := len(p.read_text().splitlines())) > budget}


def test_transport_files_stay_under_the_line_budget():
  files = _transport_files()
  assert not _over_budget(files), (
      f"over {LINE_BUDGET} lines: {_over_budget(files)}; split the file by idea "
      "(docs/architecture.md, the map of csrc/) instead of growing it")
  assert len(files) >= 30, [p.name for p in files]   # the check saw the directory


def test_the_budget_check_sees_a_merged_file(tmp_path):
  merged = tmp_path / "tcp.cc"
  parts = ("tcp.cc", "tcp_handshake.cc", "tcp_accept.cc", "tcp_pump.cc")
  merged.write_text("".join((TRANSPORT / n).read_text() for n in parts))
  assert _over_budget([merged]) == {"tcp.cc": len(merged.read_text().splitlines())}


def test_every_transport_file_says_what_it_is():
  silent = [p.name for p in _transport_files() if not p.read_text().startswith("// ")]
  assert not silent, f"no header comment saying what the file is: {silent}"


def test_each_idea_is_defined_in_its_own_file():
  sources = {p.name: p.read_text() for p in _transport_files() if p.suffix == ".cc"}
  assert set(IDEAS) <= set(sources), sorted(set(IDEAS) - set(sources))
  misplaced = {}
  for home, definitions in IDEAS.items():
    for d in definitions:
      where = sorted(n for n, text in sources.items() if re.search(r"(?m)^" + d, text))
      if where != [home]:
        misplaced[d] = where
  assert not misplaced, f"definitions not (only) in their idea's file {IDEAS}: {misplaced}"


# --- the build sees every source ------------------------------------------------------------------

def _cmake(root):
  return (root / "CMakeLists.txt").read_text()


def _built_sources(root) -> set[pathlib.Path]:
  """The .cc/.cu files CMakeLists.txt at `root` compiles: its file(GLOB ...) patterns under
  ${CMAKE_SOURCE_DIR}, with ${feature} expanded over DTENJAX_FEATURES."""
  text = _cmake(root)
  features = re.search(r"set\(DTENJAX_FEATURES ([^)]*)\)", text).group(1).split()
  found = set()
  for pattern in re.findall(r'"\$\{CMAKE_SOURCE_DIR\}/([^"]+)"', text):
    for f in features if "${feature}" in pattern else [""]:
      found |= set(root.glob(pattern.replace("${feature}", f)))
  return {p for p in found if p.suffix in (".cc", ".cu")}


def _orphans(root) -> list[str]:
  on_disk = {p for d in ("csrc", "custom_calls") for p in (root / d).rglob("*")
             if p.suffix in (".cc", ".cu")}
  return sorted(str(p.relative_to(root)) for p in on_disk - _built_sources(root))


def test_every_native_source_is_built():
  built = _built_sources(ROOT)
  for name in IDEAS:
    assert TRANSPORT / name in built, name
  assert ROOT / "csrc" / "p2p" / "kernels_bf16.cu" in built
  assert not _orphans(ROOT), (f"not compiled by CMakeLists.txt: {_orphans(ROOT)}; add the feature "
                              "to DTENJAX_FEATURES (its globs are not recursive)")


def test_the_orphan_check_sees_an_unbuilt_file(tmp_path):
  (tmp_path / "CMakeLists.txt").write_text(_cmake(ROOT))
  for rel in ("csrc/transport/tcp.cc", "csrc/transport/tcp/pump.cc", "csrc/newfeature/x.cc",
              "custom_calls/transport/bindings.cc"):
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text("")
  assert _orphans(tmp_path) == ["csrc/newfeature/x.cc", "csrc/transport/tcp/pump.cc"]


def _includes(path: pathlib.Path) -> list[str]:
  return re.findall(r'(?m)^#include [<"]([^>"]+)[>"]', path.read_text())


def _needs_verbs(path: pathlib.Path, root=ROOT, seen=None) -> bool:
  """Whether `path` includes <infiniband/verbs.h>, itself or through the repository's headers."""
  seen = set() if seen is None else seen
  for inc in _includes(path):
    if inc == "infiniband/verbs.h":
      return True
    header = root / inc
    if header.is_file() and header not in seen:
      seen.add(header)
      if _needs_verbs(header, root, seen):
        return True
  return False


def _verbs_only(root) -> set[pathlib.Path]:
  """The files CMakeLists.txt compiles only where <infiniband/verbs.h> is found."""
  text = _cmake(root)
  (regex,) = re.findall(r'list\(FILTER _host EXCLUDE REGEX "([^"]*verbs[^"]*)"\)', text)
  regex = regex.replace("\\\\", "\\")   # a CMake string: \\ is one backslash
  return {p for p in _built_sources(root) if re.search(regex, str(p))}


def test_verbs_only_files_are_exactly_those_that_need_verbs_headers():
  verbs_only = _verbs_only(ROOT)
  need = {p for p in _built_sources(ROOT) if _needs_verbs(p)}
  assert len(verbs_only) == 5, sorted(p.name for p in verbs_only)
  # Needing the headers but built without them breaks builds without libibverbs-dev; built only
  # with them but not needing them drops code from those builds.
  assert need == verbs_only, {
      "need verbs.h, always built": sorted(str(p) for p in need - verbs_only),
      "built only with verbs": sorted(str(p) for p in verbs_only - need)}


def test_the_verbs_check_follows_includes(tmp_path):
  (tmp_path / "a.h").write_text("#pragma once\n#include <infiniband/verbs.h>\n")
  (tmp_path / "b.cc").write_text('#include "a.h"\n')
  (tmp_path / "c.cc").write_text("#include <vector>\n")
  assert _needs_verbs(tmp_path / "b.cc", tmp_path)
  assert not _needs_verbs(tmp_path / "c.cc", tmp_path)


def _private_header_leaks(root) -> dict[str, list[str]]:
  """*_impl.h headers of csrc/transport included by a file outside their provider (tcp_impl.h:
  tcp*.cc only)."""
  sources = [p for d in ("csrc", "custom_calls") for p in (root / d).rglob("*")
             if p.suffix in (".cc", ".cu", ".h", ".cuh")]
  leaks = {}
  for header in sorted((root / "csrc" / "transport").glob("*_impl.h")):
    prefix = header.name[:-len("_impl.h")]
    users = [p for p in sources if f"csrc/transport/{header.name}" in _includes(p)]
    bad = [str(p.relative_to(root)) for p in users if not p.name.startswith(prefix)]
    if bad or len(users) < 2:
      leaks[header.name] = bad or [f"{len(users)} users"]
  return leaks


def test_private_headers_stay_private():
  assert {p.name for p in TRANSPORT.glob("*_impl.h")} == {"tcp_impl.h", "verbs_impl.h"}
  assert not _private_header_leaks(ROOT)


def test_the_private_header_check_sees_a_leak(tmp_path):
  (tmp_path / "csrc" / "transport").mkdir(parents=True)
  (tmp_path / "custom_calls").mkdir()
  (tmp_path / "csrc" / "transport" / "tcp_impl.h").write_text("#pragma once\n")
  for name in ("tcp.cc", "tcp_pump.cc", "comm.cc"):
    (tmp_path / "csrc" / "transport" / name).write_text('#include "csrc/transport/tcp_impl.h"\n')
  assert _private_header_leaks(tmp_path) == {"tcp_impl.h": ["csrc/transport/comm.cc"]}


# --- the kernels' vector types --------------------------------------------------------------------

def _vec_copies(text: str) -> list[str]:
  """What is written more than once in the kernels' vector types: every 16-bit float must be
  Vec16<T> (one template), the vector code (Pair, Pack, the word conversions) defined once for
  them and once for float."""
  problems = []
  for name, most in (("Pair", 1), ("Pack", 1), ("WordToF32", 2), ("WordFromF32", 2)):
    n = len(re.findall(r"__device__ __forceinline__ static \w+ " + name + r"\(", text))
    if n != most:
      problems.append(f"{name} defined {n} times (expected {most})")
  for t in ("__nv_bfloat16", "__half"):
    if not re.search(r"template <> struct Vec<" + t + r"> : Vec16<" + t + r"> \{\};", text):
      problems.append(f"Vec<{t}> is not Vec16<{t}>")
  return problems


def test_one_definition_of_the_16_bit_vector():
  text = (ROOT / "csrc" / "p2p" / "allreduce.cuh").read_text()
  assert len(re.findall(r"(?m)^struct Vec16 \{", text)) == 1
  assert not _vec_copies(text)


def test_the_vector_check_sees_a_copy():
  text = (ROOT / "csrc" / "p2p" / "allreduce.cuh").read_text()
  body = re.search(r"(?ms)^struct Vec16 \{\n(.*?)^\};", text).group(1)
  copy = "template <> struct Vec<__half> {\n" + body.replace("T x", "__half x") + "};"
  copied = text.replace("template <> struct Vec<__half> : Vec16<__half> {};", copy)
  assert copied != text
  assert _vec_copies(copied) == ["Pair defined 2 times (expected 1)",
                                 "Pack defined 2 times (expected 1)",
                                 "WordToF32 defined 3 times (expected 2)",
                                 "WordFromF32 defined 3 times (expected 2)",
                                 "Vec<__half> is not Vec16<__half>"]


# --- the map of csrc/ in docs/architecture.md -----------------------------------------------------

def _mapped_transport_stems(doc: str) -> set[str]:
  """The names the map lists under csrc/transport/ (indented rows until the block ends)."""
  block = re.search(r"(?ms)^csrc/transport/ .*?\n(.*?)^```", doc)
  assert block, "docs/architecture.md has no csrc/transport/ row in its map of csrc/"
  return set(re.findall(r"(?m)^  (\w+) ", block.group(1)))


def test_the_map_of_csrc_names_every_transport_file():
  mapped = _mapped_transport_stems((ROOT / "docs" / "architecture.md").read_text())
  on_disk = {p.stem for p in _transport_files()}
  assert mapped == on_disk, {"not in the map": sorted(on_disk - mapped),
                             "mapped but not on disk": sorted(mapped - on_disk)}


def test_the_map_names_every_csrc_directory():
  doc = (ROOT / "docs" / "architecture.md").read_text()
  dirs = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.is_dir())
  assert "transport" in dirs and "p2p" in dirs
  missing = [d for d in dirs if not re.search(rf"(?m)^csrc/{d}/ ", doc)]
  assert not missing, f"csrc/ directories missing from docs/architecture.md's map: {missing}"
