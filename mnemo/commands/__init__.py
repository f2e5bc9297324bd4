"""The ``mnemo`` sub-commands. Each module exposes ``add_commands(subparsers)``; ``mnemo.cli``
calls the core ones first (``train``, ``evaluate``: eval and generate, ``bench``; ``models`` is in
``mnemo.cli`` itself), then those listed in ``mnemo.cli._COMMAND_MODULES``:

- :mod:`mnemo.commands.sweep`: ``mnemo sweep``, ``mnemo report``, ``mnemo tasks``
- :mod:`mnemo.commands.continual`: ``mnemo continual`` (in-context continual learning of the CMS)
- :mod:`mnemo.commands.probe`: ``mnemo probe`` (circuit scores, time scales, training curves)
- :mod:`mnemo.commands.verify`: ``mnemo verify`` (the equivalence contract of every op)

They sit at the top of the dependency order (next to ``cli``): they may import every other
package, and nothing but ``mnemo.cli`` imports them.
"""
