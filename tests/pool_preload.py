"""Imported once by the fork server that DistPool's workers are forked from (see
tests/distributed.py): what the workers import, so that each starts with it instead of
importing it again (torch alone is about two seconds of CPU a process, torch's tracer and
what its first trace loads as much again).

Nothing here may fail: a module that does not import (an edit in progress, another torch
version) is left to the workers, which import it themselves and report the error where a
test needs it.
"""

import importlib
import pkgutil

_MODULES = (
    "torch", "torch.distributed", "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    # torch.export and what a first trace imports lazily
    "torch.export._trace", "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._export.passes.replace_autocast_with_hop_pass", "torch._inductor.sizevars",
    "torch._inductor.compiler_bisector", "torch._inductor.fx_passes.dedupe_symint_uses",
    "torch._subclasses.schema_check_mode", "torch.fx.experimental.validator",
    "torch.utils.serialization", "sympy.combinatorics", "sympy.physics.units",
    "pytest", "autopar", "equivalence",
)

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:
        pass

try:  # every module of autopar (the runtime's are imported on demand)
    import autopar

    for _info in pkgutil.walk_packages(autopar.__path__, "autopar."):
        try:
            importlib.import_module(_info.name)
        except Exception:
            pass
except Exception:
    pass

try:  # the models tests/equivalence.py builds from transformers
    from transformers import BertForMaskedLM, GPT2LMHeadModel  # noqa: F401
except Exception:
    pass
