"""The catalog's tables are filled by the rule families themselves (`rules.registry.decides`):
every family file under sharding/rules/ is loaded, every op kind an op can compute has a
rule, and two rules cannot claim one key."""

import ast
from pathlib import Path

import pytest
import torch

from autopar.graph.analysis import OpKind
from autopar.sharding import catalog, rules
from autopar.sharding.rules import grid, pointwise, registry

RULES_DIR = Path(rules.__file__).parent
aten = torch.ops.aten


def test_every_family_file_is_loaded():
    files = {p.stem for p in RULES_DIR.glob("*.py")} - {"__init__"}
    assert set(rules.FAMILIES) == files


def test_the_catalog_reads_the_families_tables():
    assert catalog.RULES is registry.RULES and catalog.MODE_RULES is registry.MODE_RULES
    assert catalog.TARGET_RULES is registry.TARGET_RULES
    computing = set(OpKind) - {OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT, OpKind.SYMBOLIC,
                               OpKind.OTHER}
    assert set(catalog.RULES) == computing
    assert catalog.MODE_RULES == {OpKind.LINEAR: grid.grid_linear, OpKind.NORM: grid.grid_norm,
                                  OpKind.EMBEDDING: grid.grid_embedding,
                                  OpKind.LOSS: grid.grid_loss}
    assert catalog.TARGET_RULES == {aten.cat.default: pointwise.concat,
                                    aten.narrow.default: pointwise.narrow}


def test_rules_register_only_through_decides():
    """A family's rules reach the catalog by `decides`, not by writing the tables."""
    for path in RULES_DIR.glob("*.py"):
        if path.stem == "registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                assert ast.unparse(node.value) not in ("RULES", "MODE_RULES", "TARGET_RULES"), \
                    f"{path.name}:{node.lineno} writes a catalog table; use decides"


def test_two_rules_for_one_kind_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"two catalog rules for OpKind.NORM: .*grid_norm and "
                                         r".*impostor"):
        @registry.decides(OpKind.NORM, grid=True)
        def impostor(ctx):
            return None
    assert catalog.MODE_RULES[OpKind.NORM] is grid.grid_norm


def test_a_grid_rule_is_found_by_kind():
    with pytest.raises(ValueError, match="by op kind, not by target"):
        registry.decides(aten.cat.default, grid=True)(pointwise.concat)
