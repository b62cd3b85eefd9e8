"""Process groups, autograd-aware collectives, mode kernels and the training engine."""

from autopar.kernels.collectives import AxisGroup, CommLog, CommRecord, Redistribute, bind

__all__ = ["AxisGroup", "CommLog", "CommRecord", "Redistribute", "bind"]
