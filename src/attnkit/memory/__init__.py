"""Memory-based attention (Soydaner Sec. 3; Brauwers 3.3.2): mechanisms that attend over an
external memory — the end-to-end memory network (Sukhbaatar et al. 2015)."""

from attnkit.memory.memn2n import EndToEndMemoryNetwork, MemN2NOutput, position_encoding

__all__ = ["EndToEndMemoryNetwork", "MemN2NOutput", "position_encoding"]
