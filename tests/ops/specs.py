"""Moved to :mod:`mnemo.testing.specs`; re-exported for old imports (``from tests.ops.specs import
SPECS``). The per-op parameters (selective_scan's and ssd's ``A``, ``D``, biases) are inputs of their own
(``OpSpec.static``): moving the inputs to a device moves them too."""

from mnemo.testing.specs import SPECS, get_spec, spec_names  # noqa: F401
