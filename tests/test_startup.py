"""What a fresh interpreter pays to start: `import autopar` and the planner's command line
(`autopar --help`, `autopar explain` on a zoo model) import neither the runtime nor the
parts of torch only the runtime uses (pipelining, distributed checkpoint), nor
transformers; `autopar.parallelize` brings the runtime in when it is first asked for.
Planning offline in seconds is what the command line promises, and every interpreter a
user or the suite starts pays its imports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar

ROOT = Path(__file__).resolve().parents[1]

# the runtime's own imports: a planner-only path that loads one of them pays for it
RUNTIME_ONLY = ("autopar.runtime", "torch.distributed.pipelining",
                "torch.distributed.checkpoint", "transformers")

# one interpreter for every step: each step adds to what the one before loaded
_STEPS = r"""
import json, sys
HEAVY = json.loads(sys.argv[1])
def loaded():
    return sorted({h for h in HEAVY for m in sys.modules if m == h or m.startswith(h + ".")})
seen = {}
import autopar
seen["import autopar"] = loaded()
seen["import autopar: torch._dynamo"] = "torch._dynamo" in sys.modules
from autopar.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
seen["autopar --help"] = loaded()
seen["autopar --help: torch._dynamo"] = "torch._dynamo" in sys.modules
main(["explain", "gpt-tiny", "--world", "4", "--device", "cpu", "--batch", "8"])
seen["autopar explain"] = loaded()
from autopar import parallelize
import autopar.api
seen["parallelize is the api's"] = parallelize is autopar.api.parallelize
seen["after parallelize"] = loaded()
print(json.dumps(seen))
"""


def test_planning_paths_do_not_import_the_runtime():
    done = subprocess.run([sys.executable, "-c", _STEPS, json.dumps(RUNTIME_ONLY)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["import autopar"] == []
    assert seen["import autopar: torch._dynamo"] is False
    assert seen["autopar --help"] == []
    assert seen["autopar --help: torch._dynamo"] is False
    assert seen["autopar explain"] == []
    assert seen["parallelize is the api's"] is True
    assert seen["after parallelize"] == ["autopar.runtime", "torch.distributed.checkpoint",
                                         "torch.distributed.pipelining"]


def test_every_public_name_is_importable_from_autopar():
    namespace = {}
    exec("from autopar import *", namespace)  # noqa: S102  (what a user's star import gets)
    assert set(autopar.__all__) <= set(namespace)
    assert set(autopar.__all__) <= set(dir(autopar))
    from autopar.api import parallelize
    assert autopar.parallelize is parallelize and namespace["parallelize"] is parallelize
    with pytest.raises(AttributeError, match="^module 'autopar' has no attribute 'nope'$"):
        autopar.nope  # noqa: B018
