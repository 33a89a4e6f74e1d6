"""Importing ``bm25s`` without letting it take a GPU (see :func:`import_bm25s`)."""

from __future__ import annotations

import os
import sys

__all__ = ["import_bm25s"]


def import_bm25s():
    """``bm25s``, imported so that it leaves the GPUs alone.

    When JAX is installed, importing bm25s runs one JAX operation (to choose its top-k backend), and
    JAX's first operation on a GPU machine claims 75% of the GPU's memory for its own allocator. On
    an H200 each process that imported bm25s held 106 GB that way, and torch beside it in the same
    process, or a second trainer on the same GPU, ran out of memory. The search never calls bm25s'
    top-k (:func:`spader_pipeline.retrieval.bm25.top_k` is ours), so JAX is kept on the CPU (``JAX_PLATFORMS=cpu``), unless the
    process chose JAX's platforms itself or imported JAX before.
    """
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s
