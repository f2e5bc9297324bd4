"""Hugging Face interop: import and export of ``transformers`` checkpoints, the ``transformers``
model class for mnemo checkpoints, and the lm-evaluation-harness adapter.

Everything here needs the optional extra ``pip install "mnemo[hf]"`` (``transformers``,
``tokenizers``, ``datasets``, ``lm-eval``); the core package never imports this module.
"""

# ``transformers`` classes, loaded on first use so that importing ``mnemo.hf`` (or its
# transformers-free converters) does not import ``transformers``. ``import mnemo.hf.modeling``
# (or touching any of these names, or ``mnemo.hf.register()``) registers ``model_type = "mnemo"``
# with ``AutoConfig`` / ``AutoModelForCausalLM``.
_LAZY = {
    "MnemoConfig": "modeling",
    "MnemoForCausalLM": "modeling",
    "MnemoCache": "modeling",
    "register": "modeling",
    "MnemoLM": "harness",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
