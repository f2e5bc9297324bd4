"""Hugging Face interop: import and export of ``transformers`` checkpoints, the ``transformers``
model class for mnemo checkpoints, and the lm-evaluation-harness adapter.

Everything here needs the optional extra ``pip install "mnemo[hf]"`` (``transformers``,
``tokenizers``, ``datasets``, ``lm-eval``); the core package never imports this module.
"""
