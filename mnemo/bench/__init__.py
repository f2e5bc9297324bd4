"""Benchmarks (scripts that print tables; never asserted in tests)."""

from __future__ import annotations


def dumps_json(obj, indent: int | None = 2) -> str:
    """``obj`` as strict JSON in the convention of every mnemo command
    (:func:`mnemo.train.sinks.dumps_record`): a non-finite float is ``null`` and named in a
    ``"nonfinite"`` map. A dict gets one map at its top level; a list (a table of rows) gives each
    of its dict rows a map of its own (a non-finite value directly in the list is only ``null``).
    :func:`loads_json` restores the floats. Indented by ``indent=2``."""
    import json

    from ..train.sinks import dumps_record

    def strict(value):
        return json.loads(dumps_record(value)) if isinstance(value, dict) else _nulls(value)

    value = [strict(v) for v in obj] if isinstance(obj, (list, tuple)) else strict(obj)
    return json.dumps(value, indent=indent, allow_nan=False)


def _nulls(value):
    """``value`` with every non-finite float as ``None`` (nested dicts, lists and tuples)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_nulls(v) for v in value]
    if isinstance(value, dict):
        return {k: _nulls(v) for k, v in value.items()}
    return value


def loads_json(text: str):
    """The object of a :func:`dumps_json` text (or of a file written before it, with bare
    ``null`` or ``NaN``) with the non-finite floats its ``"nonfinite"`` maps name restored."""
    import json

    from ..train.sinks import loads_record

    obj = json.loads(text)
    if isinstance(obj, list):
        return [loads_record(json.dumps(v)) if isinstance(v, dict) else v for v in obj]
    return loads_record(json.dumps(obj)) if isinstance(obj, dict) else obj


def write_json(path, obj) -> None:
    """Write a suite's result to ``path`` as strict JSON (:func:`dumps_json`: a non-finite value is
    ``null``, named in a ``"nonfinite"`` map that :func:`loads_json` reads back), replacing the file
    atomically."""
    from ..train.checkpoint import atomic_write_text

    atomic_write_text(path, dumps_json(obj))
