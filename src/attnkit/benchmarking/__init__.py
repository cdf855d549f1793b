"""Benchmarks as ratios against baselines measured in the same run (DESIGN 5).

``attnkit bench`` runs the quick versions; ``benchmarks/*.py`` the full ones.
"""

__all__: list[str] = []
