"""MODELS: several models served by one pod on one device. A JSON list whose entries have the
shape of the EmbeddingService's `spec.models` entries (the operator renders it as one env value):

    [{"name": "dense", "model": "BAAI/bge-small-en-v1.5", "modelRevision": "main", "task": "embed",
      "pooling": {"strategy": "cls", "normalize": true, "excludeTokens": ["[CLS]"]}},
     {"name": "rerank", "model": "/models/ms-marco-MiniLM-L6-v2"}]

Each entry is one model with the per-model settings a one-model server reads from MODEL_PATH,
MODEL_REVISION, TASK, POOLING, NORMALIZE and EXCLUDE_TOKENS; `name` is its id on every transport
(SERVED_MODEL_NAME's role). The first is the default: what a request naming no model gets. Every
other setting is the pod's, shared by its models. Read by config.Settings.from_env; `each` turns
the pod's settings into one Settings per model, so everything downstream of the settings (the
model's files, its warm-up, its admission) is what a one-model server runs."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Mapping

from embedserve.env_reader import ConfigError, EnvReader
from embedserve.errors import UnknownModel

# TASK's values, and a MODELS entry's `task`; auto: read from the model's files (prepare).
TASKS = ("auto", "embed", "classify", "rerank", "sparse", "multivector", "bgem3")

# What a name may be: it appears in URL paths (/models/<name>/...), gRPC fields, metric labels.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# The one-model variables an entry replaces: set beside MODELS, they would be silently ignored.
PER_MODEL_ENV = ("MODEL_PATH", "MODEL_REVISION", "TASK", "POOLING", "NORMALIZE", "EXCLUDE_TOKENS", "SERVED_MODEL_NAME")
_FIELDS = {"name", "model", "modelRevision", "task", "pooling"}
_POOLING_FIELDS = {"strategy", "normalize", "excludeTokens"}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model of MODELS."""

    name: str
    model: str
    revision: str = ""
    task: str = "auto"
    pooling: str = ""
    normalize: bool | None = None
    exclude_tokens: tuple[str, ...] = ()


def parse(raw: str, env: Mapping[str, str], pooling_modes: tuple[str, ...],
          pooling_aliases: Mapping[str, str]) -> tuple[ModelEntry, ...]:
    """MODELS' value → its entries (empty: unset). Every error names the entry and the field."""
    if not raw.strip():
        return ()
    given = [name for name in PER_MODEL_ENV if (env.get(name) or "").strip()]
    if given:
        raise ConfigError(f"MODELS is set beside {', '.join(given)}: with MODELS each model's settings are in its "
                          "entry (model, modelRevision, task, pooling); unset them")
    try:
        items = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"MODELS is not JSON: {e}") from None
    if not isinstance(items, list) or not items:
        raise ConfigError("MODELS: expected a non-empty JSON list of models ({\"name\": ..., \"model\": ...})")
    entries = tuple(_entry(item, i, pooling_modes, pooling_aliases) for i, item in enumerate(items))
    names = [e.name for e in entries]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"MODELS: the name {twice[0]!r} is given to more than one model; names must be unique")
    return entries


def _entry(item, i: int, pooling_modes, pooling_aliases) -> ModelEntry:
    where = f"MODELS[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with name and model")
    if unknown := sorted(set(item) - _FIELDS):
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(_FIELDS))})")
    name, model = item.get("name"), item.get("model")
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"{where}.name={name!r}: expected 1-63 letters, digits, '.', '_' or '-', starting with a "
                          "letter or digit")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"{where}.model: expected the model (a directory, a hub repo id or an s3:// URI)")
    revision, task = item.get("modelRevision", ""), item.get("task", "auto")
    if not isinstance(revision, str):
        raise ConfigError(f"{where}.modelRevision={revision!r}: expected a string")
    if task not in TASKS:
        raise ConfigError(f"{where}.task={task!r}: expected one of {', '.join(TASKS)}")
    pooling = item.get("pooling") or {}
    if not isinstance(pooling, dict) or (unknown := sorted(set(pooling) - _POOLING_FIELDS)):
        raise ConfigError(f"{where}.pooling: expected an object of {', '.join(sorted(_POOLING_FIELDS))}")
    strategy, normalize = pooling.get("strategy", ""), pooling.get("normalize")
    exclude = pooling.get("excludeTokens", [])
    if normalize is not None and not isinstance(normalize, bool):
        raise ConfigError(f"{where}.pooling.normalize={normalize!r}: expected true or false")
    if not isinstance(exclude, list) or not all(isinstance(t, str) for t in exclude):
        raise ConfigError(f"{where}.pooling.excludeTokens: expected a list of token strings")
    field = f"{where}.pooling.strategy"  # checked as POOLING is, the error naming the entry's field
    strategy = EnvReader({field: strategy if isinstance(strategy, str) else repr(strategy)}).pooling(
        field, pooling_modes, pooling_aliases)
    return ModelEntry(name, model.strip(), revision.strip(), task, strategy, normalize,
                      tuple(t.strip() for t in exclude if t.strip()))


def each(settings) -> list:
    """One config.Settings per model served, the default first: the pod's own for one model
    (MODELS unset), else the pod's with each entry's model settings."""
    if not settings.models:
        return [settings]
    return [dataclasses.replace(settings, model_path=e.model, model_revision=e.revision, task=e.task,
                                pooling=e.pooling, normalize=e.normalize, exclude_tokens=e.exclude_tokens,
                                served_model_name=e.name, models=())
            for e in settings.models]


def addressed(models: dict, name: str | None):
    """The model a request names among a pod's `models` (by name, the default first): none, the
    default; UnknownModel (404, NOT_FOUND) naming the served ones."""
    if not name:
        return next(iter(models.values()))
    model = models.get(name)
    if model is None:
        raise UnknownModel(name, list(models))
    return model
