"""Exact data position: the rollback point is the global sample count of a step.

``ResumableSampler`` maps (position, rank) to the exact samples a rank reads; it
lives in ``data/sampler.py`` (its shuffle is the O(1)-memory permutation of
``data/permutation.py``) and is re-exported here, its historical import path.
"""

from __future__ import annotations

from ..data.sampler import ResumableSampler

__all__ = ["ResumableSampler"]
