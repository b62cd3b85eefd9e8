"""The strategy search: mesh factorisations, per-layer choice, pipeline partition, ranking."""
