"""What the rewritten graph calls: collectives with backward, sharded modules, multi-D and
sequence-parallel kernels. The passes emit these; the runtime binds their groups."""
