"""The ``mnemo`` sub-commands that are not core (``mnemo.cli`` holds train, eval, generate, models
and bench). Each module exposes ``add_commands(subparsers)``, listed in
``mnemo.cli._COMMAND_MODULES``:

- :mod:`mnemo.commands.sweep`: ``mnemo sweep``, ``mnemo report``, ``mnemo tasks``
- :mod:`mnemo.commands.continual`: ``mnemo continual`` (in-context continual learning of the CMS)
- :mod:`mnemo.commands.probe`: ``mnemo probe`` (circuit scores, time scales, training curves)
- :mod:`mnemo.commands.verify`: ``mnemo verify`` (the equivalence contract of every op)

They sit at the top of the dependency order (next to ``cli``): they may import every other
package, and nothing but ``mnemo.cli`` imports them.
"""
