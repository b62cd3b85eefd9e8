"""Process groups, autograd-aware collectives, mode kernels and the training engine."""

from autopar.runtime.collectives import AxisGroup, CommLog, CommRecord, Redistribute, bind

__all__ = ["AxisGroup", "CommLog", "CommRecord", "Redistribute", "bind"]
