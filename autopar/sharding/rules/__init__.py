"""The catalog's rule families, one file each; `autopar.sharding.catalog` dispatches to them.

    context    what a rule sees (`RuleContext`) and the helpers every family shares
    registry   the catalog's tables, which each family fills with `decides`
    linear     Megatron 1D linears, activation matmuls
    vocab      vocabulary-parallel embedding and cross-entropy
    norm       layer and RMS norms (1D)
    attention  heads or batch split; ring and Ulysses over cp
    pointwise  elementwise, softmax, dropout, reductions, concatenation, narrow
    views      views and reshapes
    grid       2D, 2.5D and 3D linears, norms, embeddings and loss
    tokens     per-token ops whose input is split on tokens over cp
    experts    MoE layers: each expert's FFN split over 1D tp (grouped matmuls whole)

Importing this package imports every module in it, so each family's `decides` rows are in
the tables before the catalog reads them: a new family is a new file here, nothing else.
"""

import importlib
import pkgutil

FAMILIES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")
