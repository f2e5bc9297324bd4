"""With fla-core installed (the ``[dev]`` extra brings it), ``transformers`` binds fla's Triton
kernels into Qwen3-Next whatever the device; without a GPU they fail. The reference models of
these tests then run ``transformers``' own PyTorch forms (see
:func:`mnemo.hf.qwen3_next.transformers_reference_kernels_off_gpu`)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(autouse=True, scope="session")
def _transformers_reference_kernels():
    if importlib.util.find_spec("transformers") is not None:
        from mnemo.hf.qwen3_next import transformers_reference_kernels_off_gpu

        transformers_reference_kernels_off_gpu()
    yield
