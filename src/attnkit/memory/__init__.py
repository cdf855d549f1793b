"""Memory-based attention (Soydaner Sec. 3; Brauwers 3.3.2): mechanisms that attend over an
external memory — the end-to-end memory network (Sukhbaatar et al. 2015) and the neural Turing
machine (Graves et al. 2014)."""

from attnkit.memory import ntm
from attnkit.memory.memn2n import EndToEndMemoryNetwork, MemN2NOutput, position_encoding
from attnkit.memory.ntm import NeuralTuringMachine, NTMOutput

__all__ = [
    "EndToEndMemoryNetwork",
    "MemN2NOutput",
    "NTMOutput",
    "NeuralTuringMachine",
    "ntm",
    "position_encoding",
]
