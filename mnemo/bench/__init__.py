"""Benchmarks (scripts that print tables; never asserted in tests)."""

from __future__ import annotations


def json_safe(obj):
    """``obj`` with every non-finite float (a time or ratio that does not apply: ``nan``, ``inf``)
    as ``None``, in nested dicts, lists and tuples: what strict JSON can hold."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path, obj) -> None:
    """Write a suite's result to ``path`` as strict JSON (``NaN``/``Infinity`` are not JSON: a value
    that does not apply is ``null``), replacing the file atomically."""
    import json

    from ..train.checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(json_safe(obj), indent=2, allow_nan=False))
