"""A cross-encoder's activation (TASK=rerank): which one its authors declared, found as
sentence-transformers' CrossEncoder finds its default; a classifier's (TASK=classify), found as
transformers' text-classification pipeline finds it (`for_classifier`); and the activation
itself on float32 logits in numpy (the scores are formed where the answer is: in a front end
too, which has no torch).

CrossEncoder 6.2, loading a directory with no activation passed, takes the first of:
config_sentence_transformers.json's `activation_fn` (what `CrossEncoder.save` writes, read when
the directory declares a CrossEncoder), config.json's `sentence_transformers.activation_fn`, the
legacy `sbert_ce_default_activation_function`, then Sigmoid for one label (Identity for several).
A path outside torch is code from the model repository: sentence-transformers skips it without
trust_remote_code (a warning) and goes on to the next; so does this server, always (it runs only
torch.nn's own activations), saying so in the log.
"""

from __future__ import annotations

import numpy as np


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|, unlike 1 / (1 + exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:  # nn.Softmax() on [rows, labels]: over the labels
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


# torch.nn activation classes with no arguments, as numpy functions of float32 logits.
ACTIVATIONS = {
    "Identity": lambda x: x,
    "Sigmoid": _sigmoid,
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, 0),
    "LogSigmoid": lambda x: -np.logaddexp(0, -x),
    "Softplus": lambda x: np.logaddexp(0, x),
    "Softsign": lambda x: x / (1 + np.abs(x)),
    "Softmax": _softmax,
}


class ActivationError(ValueError):
    """A declared torch activation this server cannot compute."""


def _class_name(path: str) -> str | None:
    """A torch.nn class path (torch.nn.Sigmoid, torch.nn.modules.activation.Sigmoid) → its class
    name; None for a path outside torch."""
    if not path.startswith("torch."):
        return None
    name = path.rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise ActivationError(f"the model declares the activation {path!r}; this server computes "
                              f"{', '.join('torch.nn.' + n for n in ACTIVATIONS)}")
    return name


def resolve(st_config: dict, hf_config: dict, num_labels: int) -> tuple[str, list[str]]:
    """(config_sentence_transformers.json, config.json as a dict, labels) → (the activation's
    class name, log lines). Pure."""
    notes = []
    declared = []
    if st_config.get("model_type") == "CrossEncoder" and st_config.get("activation_fn"):
        declared.append(("config_sentence_transformers.json activation_fn", st_config["activation_fn"]))
    st_in_config = hf_config.get("sentence_transformers") or {}
    if isinstance(st_in_config, dict) and st_in_config.get("activation_fn"):
        declared.append(("config.json sentence_transformers.activation_fn", st_in_config["activation_fn"]))
    elif hf_config.get("sbert_ce_default_activation_function"):
        declared.append(("config.json sbert_ce_default_activation_function",
                         hf_config["sbert_ce_default_activation_function"]))
    for where, path in declared:
        name = _class_name(str(path))
        if name is not None:
            notes.append(f"rerank activation: torch.nn.{name} ({where})")
            return name, notes
        notes.append(f"rerank activation: {where} names {path!r}, not a torch.nn class: not run "
                     "(as sentence-transformers without trust_remote_code); the next declaration or the default")
    name = "Sigmoid" if num_labels == 1 else "Identity"
    notes.append(f"rerank activation: torch.nn.{name} (CrossEncoder's default for {num_labels} label(s))")
    return name, notes


def for_classifier(problem_type: str | None, num_labels: int, function_to_apply: object = None) -> tuple[str, str]:
    """A sequence classifier's config.json (`problem_type`, `num_labels`, `function_to_apply`) →
    (the activation's class name, why), as transformers' TextClassificationPipeline picks its
    default: `regression` → none; `multi_label_classification`, or one label → sigmoid (each
    label's own probability: softmax over one label is always 1); `single_label_classification`,
    or several labels → softmax; else the config's `function_to_apply`, else none. Pure."""
    if problem_type == "regression":
        return "Identity", "problem_type regression: the logits as they are"
    if problem_type == "multi_label_classification" or num_labels == 1:
        why = "problem_type multi_label_classification" if problem_type == "multi_label_classification" else "one label"
        return "Sigmoid", f"{why}: each label's sigmoid"
    if problem_type == "single_label_classification" or num_labels > 1:
        return "Softmax", f"{num_labels} labels, one true: softmax over them"
    declared = {"sigmoid": "Sigmoid", "softmax": "Softmax", "none": "Identity"}.get(str(function_to_apply).lower())
    if declared:
        return declared, f"function_to_apply {function_to_apply}"
    return "Identity", "no labels declared: the logits as they are"


def apply(name: str, logits: np.ndarray) -> np.ndarray:
    """The activation on float32 logits ([rows] or [rows, labels]) → float32 scores."""
    return np.asarray(ACTIVATIONS[name](np.asarray(logits, dtype=np.float32)), dtype=np.float32)
