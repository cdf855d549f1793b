"""Memory-based attention (Soydaner Sec. 3; Brauwers 3.3.2): mechanisms that attend over an
external memory — the end-to-end memory network (Sukhbaatar et al. 2015), the neural Turing
machine (Graves et al. 2014), the LSTMN (Cheng et al. 2016) and coverage (Tu et al. 2016; See
et al. 2017)."""

from attnkit.memory import ntm
from attnkit.memory.coverage import (
    CoverageAttention,
    CoverageOutput,
    coverage_loss,
    doubly_stochastic_penalty,
)
from attnkit.memory.lstmn import LSTMN, LSTMNOutput
from attnkit.memory.memn2n import EndToEndMemoryNetwork, MemN2NOutput, position_encoding
from attnkit.memory.memnet import MemoryNetwork, MemoryNetworkOutput
from attnkit.memory.ntm import NeuralTuringMachine, NTMOutput

__all__ = [
    "LSTMN",
    "CoverageAttention",
    "CoverageOutput",
    "EndToEndMemoryNetwork",
    "LSTMNOutput",
    "MemN2NOutput",
    "MemoryNetwork",
    "MemoryNetworkOutput",
    "NTMOutput",
    "NeuralTuringMachine",
    "coverage_loss",
    "doubly_stochastic_penalty",
    "ntm",
    "position_encoding",
]
