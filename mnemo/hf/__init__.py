"""Hugging Face interop: import and export of ``transformers`` checkpoints, the ``transformers``
model class for mnemo checkpoints, and the lm-evaluation-harness adapter.

Everything here needs the optional extra ``pip install "mnemo[hf]"`` (``transformers``,
``tokenizers``, ``datasets``, ``lm-eval``) — except the checkpoint converters
(:mod:`mnemo.hf.convert`, torch and safetensors only), which ``import mnemo.hf`` registers with
:meth:`mnemo.models.LanguageModel.from_pretrained`. The core package never imports this module.
"""

from . import convert  # noqa: E402,F401  (registers the checkpoint converters with LanguageModel.from_pretrained)

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
