"""Loading a checkpoint never runs code from its files, and names the file it refuses.

A checkpoint's `.metadata` replaced by a crafted pickle (bare, or hidden inside otherwise
valid DCP metadata) whose unpickling would create a marker file is refused by every load
path (`engine.load`, `load_full_state_dict`, `load_full_optimizer_state`) with a
CheckpointError naming the file, and the marker never appears; so is a data file whose
tensor pickle would. Truncated or unreadable files (metadata, record, data, pointer) are
CheckpointErrors naming the file. Checkpoints written by DCP's own writer, as before the
safe reader existed, read back exactly. Plans and hardware profiles are bounded JSON.
A scan of the package finds no unsafe deserialisation.
"""

import builtins
import functools
import io
import os
import pickle
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest
import torch
from equivalence import build

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
BATCH = 8
PACKAGE = Path(__file__).resolve().parent.parent / "autopar"


def _engine(seed: int = 0):
    import autopar

    model, inputs, _, loss_fn = build(GPT, BATCH, seed=seed)
    return autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                               loss_fn=loss_fn, plan={"data": 1},
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, 64, (BATCH, 16), generator=gen),
            torch.randint(0, 64, (BATCH, 16), generator=gen))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of an engine after two steps (written once), and that engine."""
    engine = _engine()
    for s in range(2):
        engine.train_step(*_batch(s))
    return Path(engine.save(tmp_path_factory.mktemp("saved") / "ckpt")), engine


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the saved checkpoint directory, for a test to tamper with."""
    copy = tmp_path / "ckpt" / saved[0].name
    shutil.copytree(saved[0], copy)
    return copy


@pytest.fixture(scope="module")
def loader():
    """A second engine of the same model: what engine.load fills."""
    return _engine(seed=1)


def _load_paths(loader):
    from autopar.runtime.checkpoint import load_full_optimizer_state, load_full_state_dict

    return {"engine.load": loader.load, "load_full_state_dict": load_full_state_dict,
            "load_full_optimizer_state": load_full_optimizer_state}


PATHS = ["engine.load", "load_full_state_dict", "load_full_optimizer_state"]


class _Payload:
    """Pickles as a call of `fn(*args)`: what a crafted file would run."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: Path) -> dict:
    return {"os.system": _Payload(os.system, f"touch {marker}"),
            "builtins.open": _Payload(builtins.open, str(marker), "w"),
            "builtins.eval": _Payload(builtins.eval, f"open({str(marker)!r}, 'w')"),
            "builtins.exec": _Payload(builtins.exec, f"open({str(marker)!r}, 'w')"),
            "subprocess.call": _Payload(subprocess.call, ["touch", str(marker)]),
            "torch.save": _Payload(torch.save, {}, str(marker))}


def _dcp_metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:  # a file this test wrote: trusted
        return pickle.load(f)


def _write_metadata(ckpt: Path, metadata) -> None:
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("hidden", [False, True], ids=["bare", "inside-valid-metadata"])
@pytest.mark.parametrize("payload", ["os.system", "builtins.open", "builtins.eval",
                                     "builtins.exec", "subprocess.call", "torch.save"])
@pytest.mark.parametrize("path", PATHS)
def test_crafted_metadata_runs_nothing_on_any_load_path(ckpt, loader, tmp_path, path,
                                                        payload, hidden):
    from autopar.errors import CheckpointError

    marker = tmp_path / "marker"
    crafted = _payloads(marker)[payload]
    if hidden:  # a real checkpoint's metadata with the payload where DCP keeps plain data
        metadata = _dcp_metadata(ckpt)
        metadata.planner_data = {"model/wte.weight": crafted}
        crafted = metadata
    _write_metadata(ckpt, crafted)
    with pytest.raises(CheckpointError) as raised:
        _load_paths(loader)[path](ckpt)
    assert str(ckpt / ".metadata") in str(raised.value)
    pickled_as = {"os.system": "posix.system", "builtins.open": "io.open",
                  "torch.save": "torch.serialization.save"}.get(payload, payload)
    assert f"refers to {pickled_as}, which DCP metadata never holds" in str(raised.value)
    assert "refused without running anything" in str(raised.value)
    assert not marker.exists()


def test_the_pickle_cannot_reach_real_classes(ckpt, loader):
    """Every class the metadata may name becomes a plain class made for this read: a
    pickle that sets attributes on it leaves DCP's classes untouched, and one that asks
    torch for a function or module is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    from autopar.errors import CheckpointError
    from autopar.runtime.safe_metadata import read_metadata

    # GLOBAL Metadata, then BUILD with (None, {"__eq__": None}): setattr on the class itself
    build_on_class = (b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
                      + b"N}\x8c\x06__eq__Ns\x86b.")
    (ckpt / ".metadata").write_bytes(build_on_class)
    with pytest.raises(CheckpointError, match="has a type where the top level should be a "
                                              "Metadata, so it was refused"):
        read_metadata(str(ckpt))
    assert Metadata.__eq__ is not None and "__eq__" in Metadata.__dict__
    for name in ("load", "save", "Tensor", "ops"):  # torch functions and modules
        (ckpt / ".metadata").write_bytes(b"\x80\x04ctorch\n" + name.encode() + b"\n.")
        with pytest.raises(CheckpointError, match=f"refers to torch.{name}, which"):
            loader.load(ckpt)


def _rewrite(ckpt: Path, change) -> None:
    metadata = _dcp_metadata(ckpt)
    change(metadata)
    _write_metadata(ckpt, metadata)


def test_entries_autopar_never_writes_are_refused(ckpt, loader):
    """Pickled-bytes entries (DCP's default planner would unpickle them with code allowed),
    data files outside the checkpoint directory, and stream transforms."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from autopar.errors import CheckpointError

    def bytes_entry(md):
        md.state_dict_metadata["model/extra"] = BytesStorageMetadata()

    def outside(md):
        for info in md.storage_data.values():
            info.relative_path = "../../elsewhere/data.distcp"

    def transform(md):
        next(iter(md.storage_data.values())).transform_descriptors = ["zstd/1"]

    def huge(md):  # a size far beyond the data file, so no huge allocation is attempted
        md.state_dict_metadata["model/wte.weight"].size = torch.Size([10**9, 32])

    def overlapping(md):  # as many elements as the tensor, but rows 4..7 twice, 12..15 never
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

        md.state_dict_metadata["model/wpe.weight"].chunks = [
            Chunk(torch.Size([0, 0]), torch.Size([8, 32])),
            Chunk(torch.Size([4, 0]), torch.Size([8, 32]))]

    expected = {bytes_entry: "refers to torch.distributed.checkpoint.metadata."
                             "BytesStorageMetadata",
                outside: "names the data file '../../elsewhere/data.distcp'",
                transform: "asks for stream transforms ['zstd/1']",
                huge: "do not cover its size",
                overlapping: "has chunks of model/wpe.weight that do not cover its size "
                             "(16, 32) once"}
    original = (ckpt / ".metadata").read_bytes()
    for change, message in expected.items():
        _rewrite(ckpt, change)
        for path in PATHS:
            with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
                _load_paths(loader)[path](ckpt)
            assert str(ckpt / ".metadata") in str(raised.value)
        (ckpt / ".metadata").write_bytes(original)


def test_a_crafted_data_file_runs_nothing(ckpt, loader, tmp_path):
    """A data file whose tensor pickle would run code is read with weights_only: refused,
    naming the data file."""
    from autopar.errors import CheckpointError

    marker = tmp_path / "marker"
    evil = io.BytesIO()
    torch.save(_Payload(os.system, f"touch {marker}"), evil)
    crafted = evil.getvalue()
    (ckpt / "evil.distcp").write_bytes(crafted)

    def point_at_evil(md):
        for info in md.storage_data.values():
            info.relative_path, info.offset, info.length = "evil.distcp", 0, len(crafted)

    _rewrite(ckpt, point_at_evil)
    for path in PATHS:
        with pytest.raises(CheckpointError, match=re.escape(
                f"the checkpoint data file {ckpt / 'evil.distcp'} is truncated or "
                "unreadable (UnpicklingError: Weights only load failed")):
            _load_paths(loader)[path](ckpt)
    assert not marker.exists()


def test_unreadable_or_truncated_files_are_named(ckpt, loader):
    from autopar.errors import CheckpointError

    metadata = ckpt / ".metadata"
    record = ckpt / "autopar.json"
    data = next(ckpt.glob("*.distcp"))
    good = {p: p.read_bytes() for p in (metadata, record, data)}
    cases = [(metadata, good[metadata][:len(good[metadata]) // 2],
              "is truncated or is not DCP metadata"),
             (metadata, b"", "is truncated or is not DCP metadata"),
             (record, good[record][:len(good[record]) // 2], "is not valid JSON"),
             (record, b"[1, 2]", "is not an autopar checkpoint"),
             (record, good[record].replace(b'"step": 2', b'"step": "two"'),
              "has a malformed 'step'"),
             (data, good[data][:len(good[data]) // 2], "is truncated ("),
             (data, bytes(len(good[data])), "is truncated or unreadable (")]
    for path in PATHS:
        for target, content, message in cases:
            target.write_bytes(content)
            with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
                _load_paths(loader)[path](ckpt)
            assert str(target) in str(raised.value), (path, message)
            assert "EOFError: )" not in str(raised.value)
            target.write_bytes(good[target])
    data.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"data file {data} could not be "
                                                        "read (No such file")):
        loader.load(ckpt)


def test_the_latest_pointer_names_only_a_checkpoint_beside_it(saved, tmp_path):
    """A pointer naming a directory elsewhere is ignored: the newest complete checkpoint
    under the root is loaded."""
    from autopar.runtime.checkpoint import resolve

    root = tmp_path / "root"
    shutil.copytree(saved[0], root / saved[0].name)
    shutil.copytree(saved[0], tmp_path / "elsewhere")
    (root / "latest").write_text("../elsewhere\n")
    assert resolve(root) == str(root / saved[0].name)


def test_dcp_metadata_reads_back_exactly(saved):
    """The metadata DCP's writer pickles (the format of every checkpoint, before this reader
    too) reads back equal to what pickle gives, field by field."""
    from autopar.runtime.safe_metadata import read_metadata

    ckpt = saved[0]
    ours, theirs = read_metadata(str(ckpt)), _dcp_metadata(ckpt)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert all(ours.storage_data[k] == v for k, v in theirs.storage_data.items())
    assert ours.storage_meta.checkpoint_id == str(theirs.storage_meta.checkpoint_id)
    assert (ours.planner_data, ours.version) == (theirs.planner_data, theirs.version)


def test_save_load_train_equals_the_uninterrupted_run(saved, loader):
    """After the safe load (into an engine that other tests' refused loads left as they
    left it), training goes on exactly as the engine that saved: same losses, bit-equal
    final weights."""
    path, engine = saved
    losses = [engine.train_step(*_batch(s)) for s in (2, 3)]
    loader.load(path)
    assert loader.steps == 2
    assert [loader.train_step(*_batch(s)) for s in (2, 3)] == losses
    final, reference = loader.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_plans_and_profiles_are_bounded_json(tmp_path):
    """Plan files and hardware profiles are read as JSON with a size and a depth bound;
    each refusal names the file."""
    from autopar.cost.hardware import load_hardware
    from autopar.errors import PlanError, WorldError
    from autopar.json_file import MAX_DEPTH, read_json
    from autopar.plans import Plan

    deep, deeper, truncated = (tmp_path / "deep.json", tmp_path / "deeper.json",
                               tmp_path / "truncated.json")
    deep.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    deeper.write_text("[" * 100_000 + "]" * 100_000)  # past the parser's own recursion
    truncated.write_text('{"version": 1, "mesh": {"dp": ')
    for path, message in ((deep, f"nests deeper than {MAX_DEPTH} levels"),
                          (deeper, f"nests deeper than {MAX_DEPTH} levels"),
                          (truncated, "is not valid JSON")):
        with pytest.raises(PlanError, match=re.escape(f"the plan file {path} {message}")):
            Plan.load(str(path))
        with pytest.raises(WorldError, match=re.escape(f"the hardware profile {path} "
                                                       f"{message}")):
            load_hardware(str(path))
    nested: list = []
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert read_json(deep, "plan file", PlanError, "fix it", max_depth=MAX_DEPTH + 1) == nested
    (tmp_path / "big.json").write_text("[" + "0, " * 100 + "0]")
    with pytest.raises(PlanError, match="is larger than 64 bytes"):
        read_json(tmp_path / "big.json", "plan file", PlanError, "fix it", max_bytes=64)


# (file, pattern) -> why the use is safe; anything else the scan finds fails the test
ALLOWED = {
    ("autopar/runtime/safe_metadata.py", "Unpickler"):
        "the restricted unpickler: every global is an inert record of the read",
    ("autopar/graph/trace.py", "exec("):
        "defines a forward(self, a0, ..., aN) built from an argument count, no file text",
}
UNSAFE = {
    "pickle.load": r"\bpickle\.loads?\(", "Unpickler": r"\bUnpickler\b",
    "torch.load": r"\btorch\.load\(", "weights_only=False": r"weights_only\s*=\s*False",
    "eval(": r"(?<![\w.])eval\(", "exec(": r"(?<![\w.])exec\(",
    "FileSystemReader(": r"\bFileSystemReader\(", "marshal": r"\bmarshal\.loads?\(",
    "shelve": r"\bshelve\.open\(", "yaml": r"\byaml\.(unsafe_)?load\(",
    "allow_pickle": r"allow_pickle\s*=\s*True", "jit.load": r"\bjit\.load\(",
    "dill/cloudpickle": r"\b(dill|cloudpickle|jsonpickle)\b",
}


def _code_lines(text: str) -> list[str]:
    """The lines of a Python source with its strings and comments blanked out."""
    lines = [list(line) for line in text.splitlines()]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = lines[r - 1]
            lo, hi = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
            row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in lines]


def _call(lines: list[str], row: int, pattern: str) -> str:
    """The text of the call `pattern` starts on line `row`, to its closing parenthesis."""
    text = "\n".join(lines[row:])
    start = re.search(pattern, text).end()
    depth = 1
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return text[start:]


def test_the_package_deserialises_nothing_unsafely():
    """No pickle, eval or exec on file contents, no torch.load without weights_only=True,
    no DCP reader but the safe one, anywhere in autopar/ (outside the allowances above)."""
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        lines = _code_lines(path.read_text())
        for number, code in enumerate(lines, 1):
            for name, pattern in UNSAFE.items():
                if not re.search(pattern, code):
                    continue
                if name == "torch.load" and re.search(r"weights_only\s*=\s*True",
                                                      _call(lines, number - 1, pattern)):
                    continue
                if (rel, name) in ALLOWED:
                    used.add((rel, name))
                    continue
                found.append(f"{rel}:{number}: {name}: {code.strip()}")
    assert found == [], "\n".join(found)
    assert used == set(ALLOWED), f"stale allowances: {set(ALLOWED) - used}"
