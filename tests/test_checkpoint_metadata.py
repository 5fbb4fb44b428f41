"""A checkpoint is untrusted input: one hostile fixture per attack class, each built from a real
save (dtenjax's layout, or orbax's) and then tampered with. Every one must end in a
CheckpointError that names the file (and the field), never in outside bytes, a crash, or a raw
Python error; orbax-written checkpoints still restore, with a warning that nothing is verified."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax
import dtenjax.checkpoint as ckpt

MANIFEST = os.path.join("_dtenjax", "checkpoint.json")
PROC0 = os.path.join("_dtenjax", "process_0.json")


def _w():
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  ref = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
  return ref, jax.make_array_from_callback(ref.shape, NamedSharding(mesh, P("a", "b")),
                                           lambda i: ref[i])


@pytest.fixture
def saved(tmp_path):
  """(checkpoint dir, outside dir holding a second, different copy of leaf 'w')."""
  ref, w = _w()
  ckpt.save(tmp_path / "c", {"w": w, "step": 3}, block_bytes=4096)
  outside = tmp_path / "outside"
  ckpt.save(outside, {"w": jax.device_put(w * 0 + 666.0, w.sharding), "step": 4},
            block_bytes=4096)
  return tmp_path / "c", outside


def _edit(path, fn):
  doc = json.loads(path.read_text())
  path.write_text(json.dumps(fn(doc)))


def _rename_leaf(ck, new):
  def manifest(doc):
    for leaf in doc["leaves"]:
      if leaf["keys"] == [["w", 2]]:
        leaf["keys"] = [[new, 2]]
    return doc
  _edit(ck / MANIFEST, manifest)
  _edit(ck / PROC0, lambda d: {**d, "chunks": {(new if k == "w" else k): v
                                               for k, v in d["chunks"].items()}})


def _leaf(ck, **fields):
  def fn(doc):
    for leaf in doc["leaves"]:
      if leaf["keys"] == [["w", 2]]:
        leaf.update(fields)
    return doc
  _edit(ck / MANIFEST, fn)


def _restore_refused(ck, *patterns, **kw):
  with pytest.raises(dtenjax.CheckpointError) as e:
    ckpt.restore(ck, **kw)
  msg = str(e.value)
  for p in patterns:
    assert p in msg, (p, msg)
  return msg


# --- paths leaving the checkpoint ----------------------------------------------------------------

@pytest.mark.parametrize("key", ["../outside/w", "..", "/abs/outside/w", "a/../../outside/w"])
def test_a_leaf_key_naming_a_path_outside_is_refused(saved, key):
  ck, outside = saved
  _rename_leaf(ck, key)
  _restore_refused(ck, str(ck / MANIFEST), repr(key), "not a plain name")
  with pytest.raises(dtenjax.CheckpointError):      # verify=False does not open the way either
    ckpt.restore(ck, verify=False)


def test_a_leaf_directory_symlinked_outside_is_refused(saved):
  ck, outside = saved
  shutil.rmtree(ck / "w")
  os.symlink(outside / "w", ck / "w")
  _restore_refused(ck, str(ck / "w"), "symbolic link", str(outside / "w"), "outside")
  with pytest.raises(dtenjax.CheckpointError, match="symbolic link"):
    ckpt.restore(ck, verify=False)


def test_a_chunk_file_symlinked_outside_is_refused(saved):
  ck, outside = saved
  os.unlink(ck / "w" / "1.3")
  os.symlink(outside / "w" / "1.3", ck / "w" / "1.3")
  _restore_refused(ck, str(ck / "w" / "1.3"), "outside the checkpoint")


def test_a_symlink_inside_the_checkpoint_is_followed(saved):
  ck, _ = saved
  os.rename(ck / "w" / "1.3", ck / "w" / "moved")
  os.symlink("moved", ck / "w" / "1.3")
  ref, _ = _w()
  np.testing.assert_array_equal(np.asarray(ckpt.restore(ck)["w"]), ref)


# --- digests that disappear ------------------------------------------------------------------------

def test_deleting_the_digests_does_not_downgrade_to_an_unverified_restore(saved):
  ck, _ = saved
  f = ck / "w" / "0.0"
  data = bytearray(f.read_bytes())
  data[0] ^= 1
  f.write_bytes(bytes(data))
  shutil.rmtree(ck / "_dtenjax")
  _restore_refused(ck, "written by dtenjax", "digests", "verify=False")
  with pytest.warns(dtenjax.DtenjaxWarning, match="digests .* are missing"):
    out = ckpt.restore(ck, verify=False)               # on request: read without digests
  assert np.asarray(out["w"]).view(np.uint32)[0, 0] == 1


def test_orbax_checkpoints_restore_with_a_warning_that_nothing_is_verified(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ref, w = _w()
  ocp.PyTreeCheckpointer(use_ocdbt=False).save(str(tmp_path / "o"), {"w": w})
  with pytest.warns(dtenjax.DtenjaxWarning, match="orbax-checkpoint, which keeps no digests"):
    out = ckpt.restore(tmp_path / "o")
  np.testing.assert_array_equal(np.asarray(out["w"]), ref)


# --- dtypes, shapes, grids -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,why", [("|O", "only bool, integer"), ("<U4", "only bool, integer"),
                                       ("<M8[ns]", "only bool, integer"),
                                       ("|V16", "only bool, integer"),
                                       ("bogus_dtype", "not a dtype"), (7, "not str")])
def test_only_numeric_and_bool_dtypes_are_accepted(saved, dtype, why):
  ck, _ = saved
  _leaf(ck, dtype=dtype)
  _restore_refused(ck, str(ck / MANIFEST), "leaves[", ".dtype", why)


@pytest.mark.parametrize("fields,why", [
    ({"shape": [-4]}, "shape[0] is -4"),
    ({"shape": [2**40, 2**40], "chunks": [2**40, 2**40]}, "more than 2**50"),
    ({"shape": [2**20, 2**20], "chunks": [4, 16]}, "chunk files"),      # 4 TiB declared
    ({"chunks": [4, 32]}, "chunk files"),                               # another grid
    ({"chunks": [0, 16]}, "chunks[0] is 0"),
    ({"shape": [8]}, "another rank"),
    ({"shape": "8x64"}, "not list"),
])
def test_shapes_and_grids_are_checked_against_the_files_before_allocating(saved, fields, why):
  ck, _ = saved
  _leaf(ck, **fields)
  _restore_refused(ck, why)


@pytest.mark.parametrize("edit,field,why", [
    (lambda d: {**d, "block_bytes": 0}, "'block_bytes'", "not an integer in"),
    (lambda d: {**d, "leaves": None}, "'leaves'", "not list"),
    (lambda d: {**d, "digest": "md5"}, "'digest'", "not one of"),
    (lambda d: {**d, "processes": "1"}, "'processes'", "not int"),
    (lambda d: [d], "top level", "not an object"),
    (lambda d: {k: v for k, v in d.items() if k != "leaves"}, "'leaves'", "is missing"),
])
def test_hostile_manifest_fields_name_the_file_and_field(saved, edit, field, why):
  ck, _ = saved
  _edit(ck / MANIFEST, edit)
  _restore_refused(ck, str(ck / MANIFEST), field, why)


def test_too_few_digests_and_bad_process_manifests(saved):
  ck, _ = saved
  _edit(ck / PROC0, lambda d: {**d, "chunks": {**d["chunks"], "w": {
      k: {**v, "digests": v["digests"][:0]} for k, v in d["chunks"]["w"].items()}}})
  _restore_refused(ck, str(ck / PROC0), "digests", "has 0 entries")
  _edit(ck / PROC0, lambda d: {**d, "chunks": {"w": {"../../x": {"size": 1, "digests": ["0"]}}}})
  _restore_refused(ck, str(ck / PROC0), "'../../x'", "not a plain name")


@pytest.mark.parametrize("content", [b"", b"{\"format\": ", b"\xff\xfe not json", b"null"])
def test_truncated_or_non_json_metadata_is_one_clear_error(saved, content):
  ck, _ = saved
  for rel in (MANIFEST, PROC0, "_sharding"):
    original = (ck / rel).read_bytes()
    (ck / rel).write_bytes(content)
    _restore_refused(ck, str(ck / rel))
    (ck / rel).write_bytes(original)


def test_a_hostile_sharding_entry_is_named_and_can_be_bypassed(saved):
  ck, _ = saved
  doc = json.loads((ck / "_sharding").read_text())
  key = next(iter(doc))
  entry = json.loads(doc[key])
  entry["device_mesh"] = {"mesh": [["x"]]}
  entry["axis_types"] = ["AxisType.Nope"]
  doc[key] = json.dumps(entry)
  (ck / "_sharding").write_text(json.dumps(doc))
  _restore_refused(ck, str(ck / "_sharding"), "'w'", "shardings=")
  ref, w = _w()
  out = ckpt.restore(ck, shardings=w.sharding)           # the user's own sharding needs no file
  np.testing.assert_array_equal(np.asarray(out["w"]), ref)


# --- orbax's layout --------------------------------------------------------------------------------

@pytest.fixture
def orbax_saved(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  _, w = _w()
  ocp.PyTreeCheckpointer(use_ocdbt=False).save(str(tmp_path / "o"), {"w": w, "v": w + 1})
  return tmp_path / "o"


def test_orbax_metadata_naming_an_absolute_path_is_refused(orbax_saved, tmp_path):
  ck = orbax_saved
  outside = tmp_path / "elsewhere"
  shutil.copytree(ck / "v", outside)
  def fn(doc):
    entry = doc["tree_metadata"].pop("('w',)")
    entry["key_metadata"][0]["key"] = str(outside)
    doc["tree_metadata"][str((str(outside),))] = entry
    return doc
  _edit(ck / "_METADATA", fn)
  _restore_refused(ck, str(ck / "_METADATA"), "not a plain name")


def test_orbax_chunk_symlinked_outside_is_refused(orbax_saved, tmp_path):
  ck = orbax_saved
  (tmp_path / "secret").write_bytes(b"\0" * 64)
  chunk = next(p for p in (ck / "w").iterdir() if not p.name.startswith("."))
  chunk.unlink()
  os.symlink(tmp_path / "secret", chunk)
  _restore_refused(ck, str(chunk), "outside the checkpoint")


@pytest.mark.parametrize("fields,why", [
    ({"shape": [2**40, 2**40]}, "more than 2**50"),           # tensorstore aborted on this
    ({"shape": [2**24, 2**24], "chunks": [2**24, 2**24]}, "more than this host's memory"),
    ({"shape": [2**24, 2**24], "chunks": [4, 16]}, "host memory"),   # sparse zarr: no file bound
    ({"dtype": "|O"}, "only bool, integer"),
    ({"chunks": None}, "not list"),
])
def test_orbax_zarray_is_validated_before_tensorstore_opens_it(orbax_saved, fields, why):
  ck = orbax_saved
  _edit(ck / "w" / ".zarray", lambda d: {**d, **fields})
  _restore_refused(ck, why)


def test_orbax_ocdbt_zarray_is_validated_too(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ts = pytest.importorskip("tensorstore")
  _, w = _w()
  ocp.PyTreeCheckpointer().save(str(tmp_path / "o"), {"w": w})
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / 'o'}"}).result()
  doc = json.loads(kv.read("w/.zarray").result().value)
  doc["shape"] = [2**40, 2**40]
  kv.write("w/.zarray", json.dumps(doc).encode()).result()
  _restore_refused(tmp_path / "o", "w/.zarray", "more than 2**50")
