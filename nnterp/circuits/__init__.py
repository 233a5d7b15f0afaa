"""Circuits across mixed components: edge attribution, path patching and faithfulness over attention heads,
recurrent mixer heads, convolutions and MLPs (`nnterp.circuits.nodes` defines the graph)."""

from .attribution import edge_attribution, logit_difference
from .faithfulness import Faithfulness, FaithfulnessCurve, faithfulness, faithfulness_curve
from .graph import Circuit, EdgeGraph
from .nodes import NODE_KINDS, NodeMap, node_map, support
from .patching import patch_edges

__all__ = [
    "NODE_KINDS", "NodeMap", "node_map", "support", "patch_edges", "edge_attribution", "logit_difference",
    "EdgeGraph", "Circuit", "faithfulness", "faithfulness_curve", "Faithfulness", "FaithfulnessCurve",
]
