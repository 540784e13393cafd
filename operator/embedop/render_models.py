"""spec.models → the servers' model list (MODELS, one JSON env value), what the fill Job fetches,
and the summary status keeps for the Model column. Pure: dicts in, dicts and strings out.

A spec names its model one of two ways (exactly one: the CRD's CEL rule, and problems() here):
`spec.model` with `modelRevision`, `task` and `pooling` beside it, rendered as MODEL_PATH and
friends exactly as before spec.models existed; or `spec.models`, a list of entries of that same
shape plus a `name`, rendered as MODELS and nothing else of the one-model settings (the server
refuses MODELS beside them)."""

from __future__ import annotations

import json

from embedop import crd

# MODELS' keys, in the order written: a spec entry's own, a pooling's own. Fixed, so that the
# rendered value does not depend on the order the API server hands the fields back in.
ENTRY_KEYS = ("name", "model", "modelRevision", "task", "pooling")
POOLING_KEYS = ("strategy", "normalize", "excludeTokens")
# The server's one-model settings: with MODELS, each model's are in its entry, and the server refuses
# them beside it (embedserve.model_list.PER_MODEL_ENV); MODELS itself is the operator's to render.
PER_MODEL_ENV = ("MODELS", "MODEL_PATH", "MODEL_REVISION", "TASK", "POOLING", "NORMALIZE", "EXCLUDE_TOKENS",
                 "SERVED_MODEL_NAME")
SUMMARY_WIDTH = 48  # the Model column's summary: names are cut to "+N" beyond this


def several(spec: dict) -> bool:
    """Whether the spec names its models as a list (spec.models), even a list of one."""
    return bool(spec.get("models"))


def entry(model: dict) -> dict:
    """One spec.models entry as MODELS has it: the set fields only, in ENTRY_KEYS order."""
    out = {k: model[k] for k in ENTRY_KEYS if k != "pooling" and model.get(k) not in (None, "")}
    pooling = {k: model["pooling"][k] for k in POOLING_KEYS
               if (model.get("pooling") or {}).get(k) not in (None, "", [])}
    return {**out, **({"pooling": pooling} if pooling else {})}


def env(spec: dict) -> dict:
    """{"MODELS": compact JSON} with spec.models; nothing with spec.model."""
    if not several(spec):
        return {}
    return {"MODELS": json.dumps([entry(m) for m in spec["models"]], separators=(",", ":"))}


def fetches(spec: dict) -> list[dict]:
    """What a fill Job downloads with spec.models, one entry per model in order: its MODEL_PATH
    and MODEL_REVISION (when set), as the settings prefetch reads. Empty with spec.model (the
    servers' own MODEL_PATH and MODEL_REVISION say it)."""
    if not several(spec):
        return []
    return [{"MODEL_PATH": m["model"], **({"MODEL_REVISION": m["modelRevision"]} if m.get("modelRevision") else {})}
            for m in spec["models"]]


def described(spec: dict) -> str:
    """The models a fill downloads, for a message: `source@revision`, or `name (source@revision), ...`."""
    def one(m: dict) -> str:
        return m["model"] + (f"@{m['modelRevision']}" if m.get("modelRevision") else "")
    if not several(spec):
        return one(spec)
    return ", ".join(f"{m['name']} ({one(m)})" for m in spec["models"])


def summary(spec: dict) -> str:
    """status.modelSummary, the Model column (a column cannot join a list): spec.model, or the
    count and as many names as fit SUMMARY_WIDTH, the rest counted ("+N")."""
    if not several(spec):
        return spec.get("model") or ""
    names = [m["name"] for m in spec["models"]]
    head = f"{len(names)} model{'s' if len(names) > 1 else ''}: "
    for shown in range(len(names), 0, -1):  # as many names as fit, at least one
        text = head + ", ".join(names[:shown]) + (f" +{len(names) - shown}" if shown < len(names) else "")
        if len(text) <= SUMMARY_WIDTH or shown == 1:
            return text
    return head


def wanted_tasks(spec: dict) -> dict[str, str | None]:
    """Each model's spec'd task by name (None: the server infers it), in spec.models' order."""
    return {m["name"]: m.get("task") for m in spec.get("models") or []}


def problems(spec: dict) -> list[str]:
    """The CRD's rules on model and models, repeated (a server without CEL, the emulator), and what
    the servers would refuse at start-up: a one-model setting in spec.env beside spec.models."""
    models = spec.get("models")
    if not spec.get("model") and not models:
        return [crd.MODEL_RULE]
    if not models:
        return (["env: MODELS beside model: the servers refuse MODELS beside MODEL_PATH; name several models in "
                 "spec.models (which renders MODELS)"] if _env(spec, ("MODELS",)) else [])
    out = [crd.MODEL_RULE] if spec.get("model") else []
    pooling = spec.get("pooling") or {}
    if "modelRevision" in spec or "task" in spec or any(k in pooling for k in POOLING_KEYS):  # as the CEL rule's has()
        out.append(crd.PER_MODEL_RULE)
    if (spec.get("modelCache") or {}).get("image"):
        out.append(crd.MODEL_IMAGE_RULE)
    names = [m.get("name") for m in models]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        out.append(f"{crd.UNIQUE_MODELS_RULE} ({', '.join(twice)} more than once)")
    mean_modes = ("mean", "weightedmean", "mean_sqrt_len_tokens")
    for m in models:
        p = m.get("pooling") or {}
        if p.get("excludeTokens") and p.get("strategy") and not any(s in mean_modes for s in p["strategy"].split("+")):
            out.append(f"models[{m.get('name')}].pooling.excludeTokens applies to mean pooling only, not {p['strategy']}")
    if clash := _env(spec, PER_MODEL_ENV):
        out.append(f"env: {', '.join(clash)}: with models, each model's settings are in its entry (the servers refuse "
                   "these beside MODELS); remove them from env")
    return out


def _env(spec: dict, names: tuple[str, ...]) -> list[str]:
    return sorted({e["name"] for e in spec.get("env") or []} & set(names))
