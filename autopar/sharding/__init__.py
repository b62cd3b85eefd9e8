"""Layouts on a mesh, the strategy catalog, and the solver that propagates layouts."""
