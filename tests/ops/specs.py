"""Moved to :mod:`mnemo.testing.specs`; re-exported for old imports (``from tests.ops.specs import
SPECS``). Patch ``mnemo.testing.specs._fixed``, not this module's, to move fixed parameters."""

from mnemo.testing.specs import SPECS, get_spec, spec_names  # noqa: F401
