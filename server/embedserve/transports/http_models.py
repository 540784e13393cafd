"""Which model an HTTP request addresses (MODELS). OpenAI's and Cohere's payloads name it
(`model`); TEI's name none, so with several models each model's whole API is also served under
`/models/<name>/` (a TEI-shaped client, or huggingface_hub's InferenceClient, is given that URL
as its base); every other path is the default model's, the first listed. A route is installed
for a model as a one-model server installs it, through `Addressed`: the hub seen through that
model."""

from __future__ import annotations

from embedserve.errors import NotReady, UnknownModel

PREFIX = "/models/"
MODEL_KEY = "embedfleet.model"  # the scope's note of the model a request was resolved to (its metrics' label)


class Addressed:
    """A hub seen through one of its models: what a route installed for that model reads (the
    model's task, head, service...; the pod's settings and metrics)."""

    def __init__(self, hub, model):
        self.hub, self._model = hub, model

    settings = property(lambda self: self.hub.settings)
    metrics = property(lambda self: self.hub.metrics)
    started_at = property(lambda self: self.hub.started_at)
    draining = property(lambda self: self.hub.draining)
    served_name = property(lambda self: self._model.served_name)
    service = property(lambda self: self._model.service)
    task = property(lambda self: self._model.task)
    labels = property(lambda self: self._model.labels)
    activation = property(lambda self: self._model.activation)
    head = property(lambda self: self._model.head)
    model_dimension = property(lambda self: self._model.model_dimension)
    quantization = property(lambda self: self._model.quantization)

    def model(self, name: str | None, request=None) -> "Addressed":
        """The model a payload names (none: this one); UnknownModel naming the served ones (and
        `request`'s metrics then name no model: a caller's unknown name is no series)."""
        if name is None or name == self.served_name:
            return self
        if request is not None:
            request.scope[MODEL_KEY] = ""
        if not name:  # a payload that names "" names no served model (gRPC's empty field is unset)
            raise UnknownModel(name, list(self.hub.models))
        return Addressed(self.hub, self.hub.model(name))


def names(hub) -> list[str]:
    """The served models' names whose prefixes exist: none for one model (its paths are as ever)."""
    served = list(hub.models)
    return served if len(served) > 1 else []


def api_paths(paths: frozenset[str], served: list[str]) -> frozenset[str]:
    """`paths` and each of them under every model's prefix (`served`: `names`), "/" also as the
    prefix alone (a client's base URL)."""
    return paths | {PREFIX + name + path for name in served for path in paths} | \
        {PREFIX + name for name in served if "/" in paths}


def model_of(scope, served: list[str], default: str) -> str:
    """The model a request was served by, for its metrics: the one a payload named (MODEL_KEY),
    else the prefix's, else the default."""
    if MODEL_KEY in scope:
        return scope[MODEL_KEY]
    path = scope["path"]
    if path.startswith(PREFIX):
        name = path[len(PREFIX):].split("/", 1)[0]
        return name if name in served else ""
    return default


def service_of(view):
    """() → the view's service, NotReady while its model warms up."""
    def service():
        if view.service is None:
            raise NotReady("server is warming up")
        return view.service

    return service


def use(request, view: Addressed, task: str):
    """The service of the model a payload names, for `task`: noted as the request's model (its
    metrics), refused if warming up (NotReady) or of another task (WrongTask)."""
    request.scope[MODEL_KEY] = view.served_name
    service = service_of(view)()
    service.require_task(task)
    return service
