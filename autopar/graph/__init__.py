"""Tracing a model into an fx graph and analysing it (op kinds, layers, repeated layers)."""

from autopar.graph.analysis import Layer, NodeInfo, OpKind, analyse
from autopar.graph.ir import TracedGraph
from autopar.graph.trace import trace

__all__ = ["Layer", "NodeInfo", "OpKind", "TracedGraph", "analyse", "trace"]
