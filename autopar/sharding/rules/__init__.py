"""The catalog's rule families, one file each; `autopar.sharding.catalog` dispatches to them.

    context    what a rule sees (`RuleContext`) and the helpers every family shares
    linear     Megatron 1D linears, activation matmuls
    vocab      vocabulary-parallel embedding and cross-entropy
    norm       layer and RMS norms (1D)
    attention  heads or batch split; ring and Ulysses over cp
    pointwise  elementwise, softmax, dropout, reductions, concatenation, narrow
    views      views and reshapes
    grid       2D, 2.5D and 3D linears, norms, embeddings and loss
    tokens     per-token ops whose input is split on tokens over cp
"""
