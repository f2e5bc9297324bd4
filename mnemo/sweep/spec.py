"""Sweep specifications: a YAML grid of :class:`~mnemo.train.TrainConfig` runs.

A sweep file looks like::

    name: mqar                       # names the database rows and the default output paths
    description: ...                 # free text (optional)
    metric: val_acc                  # chooses the best run of each cell (higher is better)
    base:                            # TrainConfig fields shared by every run
      task: mqar
      seq_len: 128
      task_options: {num_pairs: 8}
      model_overrides: {d_model: 64, n_layers: 2}
    models:                          # registry names, or mappings of TrainConfig fields + label
      - transformer                  # (a mapping may hold its own ``grid:`` axes, e.g. m3_eps)
      - label: gated_deltanet-h1     # a variant: its own row in the table, its own point in plots
        model: gated_deltanet
        model_overrides: {mixer_options: {gated_deltanet: {n_heads: 1}}}
    grid:                            # the cross product of these axes; dotted keys reach nested
      task_options.num_pairs: [8, 16]     # dicts (task_options, model_overrides)
      lr: [1.0e-3, 3.0e-3, 1.0e-2]
    tune: [lr]                       # axes whose best value is kept per cell (default [lr])
    seeds: [0, 1, 2, 3]              # every run once per seed (or ``seeds: 4`` = [0, 1, 2, 3])
    select_lr_on_seed: 0             # choose the tuned values (lr) on this seed only; report the rest
    selection: staged                # staged (default): other seeds only at the chosen values; all
    recipe: standard                 # refuse a sweep below the recipe standard (mnemo.sweep.recipe)
    claims:                          # judged per cell in the report: reproduced / not reproduced /
      - {name: gating helps, better: gated_deltanet-h1, than: transformer}   # not testable here

Every run's config is ``base`` ← model entry ← grid point (deep-merged in that order) and is
validated as a ``TrainConfig`` before anything runs. ``{seed}`` in ``init_from`` becomes the
run's seed: ``init_from: runs/pretrain/seed{seed}`` fine-tunes each seed from its own pretrained
run (docs/results/context_extension.md). A **cell** is one model entry and one value of
every grid axis not in ``tune``; the report keeps each cell's best tuned values (the papers' "best
learning rate per point") and summarises the seeds run there (:func:`mnemo.sweep.report.cell_stats`).
A run is identified by a hash of its full config, so editing the file adds runs without
invalidating finished ones.

**Grid axes.** A dotted axis (``task_options.num_pairs``) sets that one entry of the run's config,
whatever ``base`` or the model entry give for the rest of the dict and in whatever order the keys
are written. The models are the ``models:`` list: a grid axis ``model`` is refused (it would train
another model under the entry's label; list each model, or a labelled mapping, under ``models:``),
and so are two axes of which one sets a part of the other (``task_options`` and
``task_options.num_pairs``: which value a run trains with would depend on the order of the keys).

**Relative paths.** A relative path in a sweep file (``data``, a ``tokenizer`` file or folder,
``init_from``, in ``base``, a model entry or a grid axis; the top-level ``db`` and ``out``) is read
against the sweep file's project folder: the nearest folder above the file holding
``pyproject.toml`` or ``.git`` (where this repository's sweep files and their ``runs/`` live), else
the sweep file's own folder; never against the working directory, so a sweep started or resumed
from anywhere reads the same files (:meth:`SweepSpec.load`; ``~`` is the home folder). The runs
train on the absolute paths (:attr:`Run.train_config`); a run's id and its stored config are the
config as the file writes it, so a sweep stored before keeps its runs and its report.
:meth:`SweepSpec.from_dict` without ``root`` leaves paths as given. A path that names nothing
there but something under the working directory is refused before a sweep trains
(:func:`check_paths`). Without ``db``/``out`` the sweep writes ``runs/sweeps/NAME.sqlite`` and
``runs/sweeps/NAME/`` under the project folder too, so a sweep is stored, resumed and listed in
one place from any working directory; a database that an earlier version made there under the
working directory is continued where it is, with a warning
(:func:`mnemo.sweep.runner.default_paths`).

**Seeds.** ``seeds`` runs every grid point once per seed (it sets ``TrainConfig.seed``, which
seeds the weights, the training batches and a task's test set, so the spread over seeds covers all
three). The seed is not part of the cell: a cell's runs are its tuned values × its seeds, and each
run is stored with its seed. A run whose seed equals the config's own (``base.seed``, default 0)
keeps the config and id it had without ``seeds``, so adding ``seeds: 3`` to a finished single-seed
sweep runs only seeds 1 and 2; finished ``(cell, tuned value, seed)`` runs are never rerun.

**Held-out selection.** With ``select_lr_on_seed: S`` the report picks each cell's tuned values
(``tune``, default ``[lr]``) by the metric of seed ``S`` alone and reports the mean, interval and
threshold count of the *other* seeds at those values, never seed ``S`` itself: choosing the
learning rate on the reported seeds would bias the reported mean upwards (the maximum of noisy
means). ``S`` must be one of ``seeds``, with at least one other seed and at least one tuned axis.

**Staged selection.** With a held-out seed the runner by default (``selection: staged``) trains
seed ``S`` at every tuned value first and, as soon as a cell's seed-``S`` runs have finished, trains
the other seeds at that cell's chosen values only (:func:`mnemo.sweep.runner.run_sweep`): the
report reads nothing else, so the runs at the losing values would be spent for nothing. A grid of
``k`` learning rates and ``n`` seeds costs ``k + n - 1`` runs per cell instead of ``k n`` (3 rates
and 4 seeds: 6 instead of 12). ``selection: all`` trains the whole product (e.g. to plot every
seed's curve at every rate). Runs already finished are kept either way.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models import build_config
from ..train.config import TrainConfig, load_config_file

_SPEC_KEYS = {
    "name",
    "description",
    "metric",
    "base",
    "models",
    "grid",
    "tune",
    "seeds",
    "select_lr_on_seed",
    "selection",
    "db",
    "out",
    "recipe",
    "claims",
}
METRICS_HIGHER_IS_BETTER = {"val_acc": True, "val_seq_acc": True, "val_loss": False}


def deep_merge(a: dict, b: dict) -> dict:
    """``a`` updated by ``b``, recursing into dicts that both hold (neither input is modified)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def set_dotted(d: dict, key: str, value) -> dict:
    """``d`` with ``d[a][b][c] = value`` for ``key = "a.b.c"`` (creating dicts on the way)."""
    out = copy.deepcopy(d)
    parts = key.split(".")
    node = out
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"sweep grid key {key!r}: {p!r} is not a mapping")
    node[parts[-1]] = copy.deepcopy(value)
    return out


def run_id(config: dict) -> str:
    """A stable id of a run: the SHA-1 of its canonical config JSON (first 16 hex digits)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Run:
    """One run of a sweep: its id, config (TrainConfig fields), model label and cell."""

    run_id: str
    label: str
    config: dict[str, Any]
    cell: dict[str, Any]  # label + the non-tuned grid values
    tuned: dict[str, Any]  # the tuned grid values (e.g. {"lr": 0.003})
    seed: int = 0  # TrainConfig.seed of the run (one of the sweep's ``seeds``)
    root: str | None = None  # the folder its relative paths are read against (SweepSpec.root)

    @property
    def train_config(self) -> dict[str, Any]:
        """:attr:`config` (as the sweep file writes it: hashed into :attr:`run_id` and stored) with
        its relative paths read against :attr:`root`: the config the run trains with."""
        return _absolute_config(self.root, self.config)

    @property
    def cell_key(self) -> str:
        return json.dumps(self.cell, sort_keys=True)


@dataclass
class SweepSpec:
    """A parsed sweep file; :meth:`runs` expands it. See the module docstring for the format."""

    name: str
    base: dict[str, Any] = field(default_factory=dict)
    models: list[Any] = field(default_factory=list)
    grid: dict[str, list] = field(default_factory=dict)
    tune: list[str] = field(default_factory=lambda: ["lr"])
    metric: str = "val_acc"
    description: str = ""
    seeds: list[int] | None = None  # None: one run per grid point, at the config's own seed
    select_lr_on_seed: int | None = None
    selection: str = "staged"  # "staged" | "all": see the module docstring
    db: str | None = None
    out: str | None = None
    recipe: str | None = None  # "standard": checked against mnemo.sweep.recipe's standard
    claims: list[dict] = field(default_factory=list)  # [{"name", "better", "than"}] judged in reports
    root: str | None = None  # the folder relative paths are read against (None: as given)

    @classmethod
    def from_dict(cls, d: dict, source: str = "sweep", root: str | Path | None = None) -> SweepSpec:
        """Validate and build (raises ``ValueError`` naming the offending key). ``root``: the
        folder a relative path of the file is read against (module docstring; ``None``: as given)."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: a sweep file must hold a mapping")
        unknown = sorted(set(d) - _SPEC_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown sweep key(s) {unknown}; known keys: {sorted(_SPEC_KEYS)}")
        name = d.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "/\\ ") or name in (".", ".."):
            raise ValueError(
                f"{source}: 'name' must be a non-empty string without spaces or slashes, other than '.' "
                f"and '..' (it names folders: runs/sweeps/NAME/), got {name!r}"
            )
        base = d.get("base") or {}
        if not isinstance(base, dict):
            raise ValueError(f"{source}: 'base' must be a mapping of TrainConfig fields")
        models = d.get("models") or ([base["model"]] if "model" in base else [])
        if not isinstance(models, list) or not models:
            raise ValueError(f"{source}: 'models' must be a non-empty list of model names or mappings")
        grid = d.get("grid") or {}
        if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
            raise ValueError(f"{source}: 'grid' must map keys to non-empty lists of values")
        tune = d.get("tune", ["lr"])
        if not isinstance(tune, list):
            raise ValueError(f"{source}: 'tune' must be a list of grid keys")
        grid_keys = set(d.get("grid") or {}) if isinstance(d.get("grid") or {}, dict) else set()
        for m in models:  # a model entry's own axes (``grid:`` inside the entry) may be tuned too
            if isinstance(m, dict) and isinstance(m.get("grid"), dict):
                grid_keys |= set(m["grid"])
        untuned = [t for t in tune if t not in grid_keys]
        if "tune" in d and untuned:  # (the default ['lr'] may name no axis: then nothing is tuned)
            raise ValueError(
                f"{source}: 'tune' names {untuned}, which are not grid keys (grid: {sorted(grid_keys)})"
            )
        metric = d.get("metric", "val_acc")
        if metric not in METRICS_HIGHER_IS_BETTER:
            raise ValueError(
                f"{source}: 'metric' must be one of {sorted(METRICS_HIGHER_IS_BETTER)}, got {metric!r}"
            )
        seeds = _parse_seeds(d.get("seeds"), source)
        if seeds is not None and "seed" in grid:
            raise ValueError(f"{source}: give the seeds either as 'seeds' or as a grid axis 'seed', not both")
        select = d.get("select_lr_on_seed")
        if select is not None:
            tuned_axes = [t for t in tune if t in grid_keys]  # (a model entry's own axes count)
            if isinstance(select, bool) or not isinstance(select, int):
                raise ValueError(f"{source}: 'select_lr_on_seed' must be an int seed, got {select!r}")
            if seeds is None:
                raise ValueError(
                    f"{source}: 'select_lr_on_seed' {select!r} needs a 'seeds' list (or count) that holds it"
                )
            if select not in seeds:
                raise ValueError(
                    f"{source}: 'select_lr_on_seed' must be one of the sweep's seeds {seeds}, got {select!r}"
                )
            if len(seeds) < 2:
                raise ValueError(
                    f"{source}: 'select_lr_on_seed' needs at least 2 seeds (the held-out one and one "
                    f"to report), got seeds {seeds}"
                )
            if not tuned_axes:
                raise ValueError(
                    f"{source}: 'select_lr_on_seed' needs a tuned grid axis (tune {tune} matches none "
                    f"of the grid keys {sorted(grid_keys)})"
                )
        selection = d.get("selection", "staged")
        if selection not in ("staged", "all"):
            raise ValueError(f"{source}: 'selection' must be 'staged' or 'all', got {selection!r}")
        if "selection" in d and select is None:
            raise ValueError(
                f"{source}: 'selection: {selection}' needs 'select_lr_on_seed' (the held-out seed whose runs "
                "choose the tuned values)"
            )
        recipe = d.get("recipe")
        if recipe not in (None, "standard"):
            raise ValueError(f"{source}: 'recipe' must be 'standard' (or absent), got {recipe!r}")
        if recipe == "standard":
            from .recipe import recipe_problems

            problems = recipe_problems(grid.get("lr") if "lr" in tune else None, seeds, select)
            if "lr" in tune and all(
                isinstance(m, dict)
                and isinstance(m.get("grid"), dict)
                and isinstance(m["grid"].get("lr"), list)
                for m in models
            ):  # every model entry has its own lr axis (each checked below): none is needed at the top
                problems = [p for p in problems if not p.startswith("'grid' has no tuned 'lr' axis")]
            for m in models:  # a model entry's own lr axis replaces the sweep's: held to the same
                own = m.get("grid") if isinstance(m, dict) else None
                if isinstance(own, dict) and isinstance(own.get("lr"), list) and "lr" in tune:
                    label = m.get("label", m.get("model"))
                    where = f"models[{label}].grid.lr"
                    problems += [p for p in recipe_problems(own["lr"], seeds, select, where) if where in p]
            if problems:
                raise ValueError(
                    f"{source}: 'recipe: standard' is not met: "
                    + "; ".join(problems)
                    + " (docs/results/README.md: the recipe standard)"
                )
        claims = _parse_claims(d.get("claims"), models, source)
        for key in ("db", "out"):  # (a number or a list would reach Path() as a TypeError)
            value = d.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(
                    f"{source}: {key!r} must be a path (a non-empty string; relative: under the project "
                    f"folder), got {value!r}"
                )
        spec = cls(
            name=name,
            base=base,
            models=models,
            grid=grid,
            tune=[t for t in tune if t in grid_keys],
            metric=metric,
            description=str(d.get("description", "")),
            seeds=seeds,
            select_lr_on_seed=select,
            selection=selection,
            db=_under(root, d.get("db")),
            out=_under(root, d.get("out")),
            recipe=recipe,
            claims=claims,
            root=None if root is None else str(root),
        )
        spec.runs()  # validates every run's TrainConfig now, before anything is trained
        return spec

    @classmethod
    def load(cls, path: str | Path) -> SweepSpec:
        d = load_config_file(
            path, kind="sweep file", holds="sweep keys (name, models, grid, ...)", empty_ok=True
        )
        if not d:
            raise ValueError(f"{path}: the sweep file is empty (it needs at least 'name' and 'models')")
        return cls.from_dict(d, source=str(path), root=project_folder(path))

    def _model_entries(self) -> list[tuple[str, dict]]:
        entries, labels = [], set()
        for i, m in enumerate(self.models):
            if isinstance(m, str):
                label, fields = m, {"model": m}
            elif isinstance(m, dict) and isinstance(m.get("model"), str):
                fields = {k: v for k, v in m.items() if k != "label"}
                label = str(m.get("label", m["model"]))
            else:
                raise ValueError(
                    f"sweep {self.name!r}: models[{i}] must be a model name or a mapping with "
                    f"'model', got {m!r}"
                )
            if label in labels:
                raise ValueError(f"sweep {self.name!r}: duplicate model label {label!r} (give each a label)")
            labels.add(label)
            entries.append((label, fields))
        return entries

    def meta(self) -> dict[str, Any]:
        """What the report needs to know about the sweep beyond its rows (stored in the database)."""
        return {
            "metric": self.metric,
            "tune": self.tune,
            "seeds": self.seeds,
            "select_lr_on_seed": self.select_lr_on_seed,
            "selection": self.selection,
            "recipe": self.recipe,
            "claims": self.claims,
        }

    def runs(self) -> list[Run]:
        """Every run of the grid, in a stable order (model entries outermost, then grid axes, then
        seeds)."""
        out = []
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        for label, fields in self._model_entries():
            own = fields.pop("grid", None) or {}  # this model's own axes (e.g. m3_eps for M3 only)
            if not isinstance(own, dict) or any(not isinstance(v, list) or not v for v in own.values()):
                raise ValueError(
                    f"sweep {self.name!r}, model {label!r}: 'grid' must map keys to non-empty lists of values"
                )
            if "seed" in own and self.seeds is not None:
                raise ValueError(
                    f"sweep {self.name!r}, model {label!r}: give the seeds either as 'seeds' or as a grid "
                    "axis 'seed', not both"
                )
            grid = {**self.grid, **own}
            keys = list(grid)
            _check_axes(self.name, label, keys)
            for values in itertools.product(*(grid[k] for k in keys)):
                cfg = deep_merge(self.base, fields)
                point = dict(zip(keys, values))
                for k, v in point.items():
                    if k.split(".")[0] not in known:
                        raise ValueError(f"sweep {self.name!r}: grid key {k!r} is not a TrainConfig field")
                    cfg = set_dotted(cfg, k, v)
                try:  # as the run trains: its paths read against the project folder, not the cwd
                    tc = TrainConfig.from_dict(_absolute_config(self.root, cfg))
                    task = tc.build_task()
                    build_config(tc.model, vocab_size=task.vocab_size if task else 256, **tc.model_overrides)
                except (ValueError, TypeError) as e:
                    raise ValueError(
                        f"sweep {self.name!r}, model {label!r}, grid point {point}: {e}"
                    ) from None
                if task is None and self.metric != "val_loss":
                    raise ValueError(
                        f"sweep {self.name!r}, model {label!r}: metric {self.metric!r} is measured on a "
                        "task's supervised positions, and this run trains on text (no task): use "
                        "metric: val_loss"
                    )
                cell = {"label": label, **{k: v for k, v in point.items() if k not in self.tune}}
                tuned = {k: v for k, v in point.items() if k in self.tune}
                own_seed = cfg.get("seed", 0)
                for seed in self.seeds if self.seeds is not None else [own_seed]:
                    # the config's own seed keeps the config (and id) it has without ``seeds``
                    c = cfg if seed == own_seed else {**cfg, "seed": seed}
                    if isinstance(c.get("init_from"), str) and "{seed}" in c["init_from"]:
                        c = {**c, "init_from": c["init_from"].replace("{seed}", str(seed))}
                    # the id: the config as the file writes it (stored sweeps keep their runs)
                    out.append(Run(run_id(c), label, c, cell, tuned, seed, self.root))
        ids = [r.run_id for r in out]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sweep {self.name!r}: two model entries or grid points give identical runs")
        return out


def _check_axes(name: str, label: str, keys: list[str]) -> None:
    """Refuse a grid axis ``model`` (the models are the ``models:`` list) and two axes of which one
    sets a part of the other (``task_options`` and ``task_options.num_pairs``): ``ValueError``
    naming them."""
    if "model" in keys:
        raise ValueError(
            f"sweep {name!r}, model {label!r}: 'grid' has an axis 'model', which would train another "
            f"model than the entry {label!r} names (and report it under that label): list the models "
            "under 'models:' instead (a mapping with 'label' and 'model' for a variant)"
        )
    for whole in keys:
        for part in keys:
            if part.startswith(whole + "."):
                raise ValueError(
                    f"sweep {name!r}, model {label!r}: the grid axes {whole!r} and {part!r} both set "
                    f"{part!r} (the one as a part of a whole {whole!r}), so which value a run trains "
                    f"with would depend on the order of the keys: give {part!r} inside the values of "
                    f"{whole!r}, or drop one of the two axes"
                )


def check_paths(spec: SweepSpec) -> None:
    """Before a sweep trains: refuse a relative path of its runs (``data``, ``tokenizer``,
    ``init_from``) that names nothing under the project folder but a file or folder under the
    working directory (a sweep file written for the old reading, or for a folder without
    ``pyproject.toml`` or ``.git``): every run would fail on a path the file never wrote."""
    import os

    from ..data.corpus import BUNDLED

    for run in spec.runs():
        for key in ("data", "tokenizer", "init_from"):
            written = run.config.get(key)
            names = {"data": BUNDLED, "tokenizer": ("char", "byte")}.get(key, ())  # names, not paths
            if not isinstance(written, str) or written in names:
                continue
            # where the file's rule reads it (a tokenizer name such as ``mytok``, kept as written
            # when the project folder holds none, too: the runs would read it from the cwd)
            value = _under(spec.root, written)
            if value == written or _exists(value) or not _exists(written):
                continue
            raise ValueError(
                f"sweep {spec.name!r}: {key} {written!r} is read against the sweep file's project folder "
                f"{spec.root} (the nearest folder above the file with pyproject.toml or .git, else its own), "
                f"where {value} does not exist; the working directory holds {os.path.abspath(written)}: "
                "write the path relative to the project folder, or absolute"
            )


def _exists(path: str) -> bool:
    """``path`` (a file, a folder or a glob) names something."""
    import glob

    return Path(path).exists() or bool(glob.glob(path))


def _absolute_config(root, config: dict) -> dict:
    """``config`` with its relative paths (``data``, a ``tokenizer`` file, ``init_from``) read
    against ``root`` (module docstring); ``root=None``: as it is."""
    if root is None:
        return config
    from ..data.corpus import BUNDLED

    out = dict(config)
    if isinstance(out.get("data"), str) and out["data"] not in BUNDLED:
        out["data"] = _under(root, out["data"])
    tok = out.get("tokenizer")
    # a path (as TrainConfig tells one) read against root; a name such as "bpe" stays, refused as given
    if isinstance(tok, str) and tok not in ("char", "byte") and _looks_like_path(_under(root, tok), tok):
        out["tokenizer"] = _under(root, tok)
    if isinstance(out.get("init_from"), str):
        out["init_from"] = _under(root, out["init_from"])
    return out


def _looks_like_path(absolute: str, written: str) -> bool:
    """``written`` (a tokenizer setting) names a path: it exists read against the project folder
    (``absolute``), or is spelled as one (a separator, ``.json``; as TrainConfig tells one)."""
    return Path(absolute).exists() or "/" in written or "\\" in written or written.endswith(".json")


def project_folder(path: str | Path) -> Path:
    """The folder a sweep file's relative paths are read against: the nearest folder above the
    file holding ``pyproject.toml`` or ``.git``, else the file's own folder (absolute)."""
    here = Path(path).expanduser().resolve().parent
    return next(
        (p for p in (here, *here.parents) if (p / "pyproject.toml").is_file() or (p / ".git").exists()), here
    )


def _under(root, value):
    """``value`` (a path of a sweep file) made absolute against ``root``; ``~`` expanded; an
    absolute path, a non-string and ``root=None`` as they are."""
    if root is None or not isinstance(value, str) or not value:
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else Path(root) / p)


def _parse_claims(value, models: list, source: str) -> list[dict]:
    """``claims: [{name: ..., better: LABEL, than: LABEL}, ...]``: each names two model labels of
    the sweep (judged per cell by :func:`mnemo.sweep.recipe.judge_claim`)."""
    if value is None:
        return []
    labels = {m if isinstance(m, str) else str(m.get("label", m.get("model"))) for m in models if m}
    if not isinstance(value, list):
        raise ValueError(f"{source}: 'claims' must be a list of mappings with 'better' and 'than'")
    out = []
    for i, c in enumerate(value):
        if not isinstance(c, dict) or set(c) - {"name", "better", "than"}:
            raise ValueError(
                f"{source}: claims[{i}] must be a mapping of 'name', 'better' and 'than', got {c!r}"
            )
        for key in ("better", "than"):
            if c.get(key) not in labels:
                raise ValueError(
                    f"{source}: claims[{i}].{key} must be a model label of the sweep ({sorted(labels)}), "
                    f"got {c.get(key)!r}"
                )
        if c["better"] == c["than"]:
            raise ValueError(f"{source}: claims[{i}] compares {c['better']!r} with itself")
        same = [j for j, d in enumerate(out) if (d["better"], d["than"]) == (c["better"], c["than"])]
        if same:  # one verdict, said twice in the report (or two names for one comparison)
            raise ValueError(
                f"{source}: claims[{i}] repeats claims[{same[0]}] ({c['better']!r} better than "
                f"{c['than']!r}): give each comparison once"
            )
        out.append({"name": str(c.get("name", f"{c['better']} beats {c['than']}")), **c})
    return out


def _parse_seeds(value, source: str) -> list[int] | None:
    """``seeds: N`` (a positive int: seeds ``0 … N−1``) or ``seeds: [s, …]`` (distinct ints)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{source}: 'seeds' must be a positive count or a list of ints, got {value!r}")
        return list(range(value))
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value)
    ):
        raise ValueError(
            f"{source}: 'seeds' must be a positive count or a non-empty list of ints >= 0, got {value!r}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"{source}: 'seeds' must not repeat a seed, got {value!r}")
    return list(value)
