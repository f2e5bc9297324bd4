"""The mixer registry: a mixer registers itself, in its own file, with :func:`register_mixer`.

``MIXERS`` maps a mixer name (as used in :class:`~mnemo.models.ModelConfig` ``mixer`` /
``pattern`` / ``layers``) to a constructor ``(d_model, **options) -> Mixer``. :mod:`mnemo.layers`
imports each built-in mixer module explicitly; a mixer defined elsewhere is registered when its
module is imported (import it before building a model that names it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

MIXERS: dict[str, Callable] = {}


def register_mixer(name: str, constructor: Callable | None = None, **defaults):
    """Class decorator: register ``cls`` under ``name``, with ``defaults`` as preset constructor
    options (stack several to register variants of one class: ``@register_mixer("retnet",
    gate="retnet")``). ``register_mixer(name, constructor)`` registers a constructor directly.
    Raises ``ValueError`` if ``name`` is taken by another constructor."""
    if constructor is not None:
        return register_mixer(name, **defaults)(constructor)

    def deco(cls):
        ctor = partial(cls, **defaults) if defaults else cls
        old = MIXERS.get(name)
        same = old is cls or (
            isinstance(old, partial) and old.func is cls and old.keywords == defaults and not old.args
        )
        if old is not None and not same:
            raise ValueError(f"mixer {name!r} is already registered (by {getattr(old, 'func', old)!r})")
        MIXERS[name] = ctor
        return cls

    return deco
