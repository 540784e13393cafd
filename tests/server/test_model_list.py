"""MODELS: several models' entries, each error naming the entry and its field; each model's
Settings is the pod's with its entry's model settings."""

from __future__ import annotations

import json

import pytest

from embedserve import model_list
from embedserve.config import Settings
from embedserve.env_reader import ConfigError


def settings(models, **env) -> Settings:
    return Settings.from_env({"MODELS": json.dumps(models), **env})


def test_each_model_gets_the_pods_settings_with_its_own():
    s = settings([{"name": "dense", "model": "BAAI/bge-small-en-v1.5", "modelRevision": "v1", "task": "embed",
                   "pooling": {"strategy": "CLS", "normalize": False, "excludeTokens": ["[CLS]", " "]}},
                  {"name": "rerank", "model": "/models/ce"}], MAX_DRAIN_TIME_MS="300")
    dense, rerank = model_list.each(s)
    assert (dense.model_path, dense.model_revision, dense.task, dense.pooling, dense.normalize, dense.exclude_tokens,
            dense.served_model_name) == ("BAAI/bge-small-en-v1.5", "v1", "embed", "cls", False, ("[CLS]",), "dense")
    assert (rerank.model_path, rerank.task, rerank.pooling, rerank.normalize, rerank.served_model_name) == \
        ("/models/ce", "auto", "", None, "rerank")
    assert dense.max_drain_time_ms == rerank.max_drain_time_ms == 300
    assert model_list.each(Settings()) == [Settings()]  # one model: the pod's own


@pytest.mark.parametrize("models, env, says", [
    ("[]", {}, "non-empty JSON list"),
    ("{", {}, "not JSON"),
    ([{"model": "x"}], {}, "MODELS[0].name"),
    ([{"name": "a/b", "model": "x"}], {}, "MODELS[0].name='a/b'"),
    ([{"name": "a"}], {}, "MODELS[0].model"),
    ([{"name": "a", "model": "x"}, {"name": "a", "model": "y"}], {}, "'a' is given to more than one model"),
    ([{"name": "a", "model": "x", "task": "chat"}], {}, "MODELS[0].task='chat'"),
    ([{"name": "a", "model": "x", "pooling": {"strategy": "median"}}], {}, "MODELS[0].pooling.strategy"),
    ([{"name": "a", "model": "x", "pooling": {"normalize": "yes"}}], {}, "MODELS[0].pooling.normalize"),
    ([{"name": "a", "model": "x", "revision": "main"}], {}, "unknown field 'revision'"),
    ([{"name": "a", "model": "x"}], {"MODEL_PATH": "/m"}, "MODELS is set beside MODEL_PATH"),
])
def test_a_bad_entry_is_named(models, env, says):
    with pytest.raises(ConfigError, match=None) as e:
        Settings.from_env({"MODELS": models if isinstance(models, str) else json.dumps(models), **env})
    assert says in str(e.value)


def test_a_request_naming_no_model_gets_the_first_and_an_unknown_name_the_list():
    from embedserve.errors import UnknownModel

    models = {"a": 1, "b": 2}
    assert model_list.addressed(models, None) == 1 and model_list.addressed(models, "b") == 2
    with pytest.raises(UnknownModel, match="'zz' is not served here; this server serves 'a', 'b'"):
        model_list.addressed(models, "zz")
