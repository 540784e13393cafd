"""Reading a service's pods: which pods count (pod_view, from what the API keeps) and their
/metrics, scraped concurrently with a short timeout and parsed into autoscale.PodSample (the
shared signal's series, one table). I/O only: what the readings mean is autoscale.decide's.

Where: a guarded service (keys, TLS, a NetworkPolicy) only on the plain metrics port, where its
probes are too (render.health_port). An unguarded one on the metrics port first and, for a pod
that refuses it or never lets a connection through, on the API port, remembered per pod
(ports() says why: the metrics port costs the server's event loop less and is not
where the API's clients queue; pods of server images from before it answer only on the API port).

How a failure reads: a scrape sent on a connection whose TCP handshake completed in this very
attempt (the pod's kernel took it just now) that got no answer within the timeout is `timed_out`
(the pod is there and too busy to answer: with a hot last reading, saturated); every other failure
(refused, no connection, an error status, an answer without the shared signal) is blind. Each
scrape opens a connection of its own (force_close): on a connection kept alive from an earlier
scrape a written request only says the local kernel buffered it, and a node that died without a
word, or a partition, would then read as saturated and grow the fleet by a step."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import errno
import ipaddress

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from embedop import autoscale, demand, render

# The shared signal: Prometheus sample name → demand.ModelSample field (one entry per metric). Each
# is read per model: by its `model` label (a server serving several), "" where it has none (a server
# from before the label); other labels are summed over.
METRICS = {
    "embedfleet_service_rate_tokens_per_second": "service_rate",
    "embedfleet_arrival_rate_tokens_per_second": "arrival_rate",
    "embedfleet_queued_tokens": "queued_tokens",
    "embedfleet_offered_tokens_total": "offered_total",
    "embedfleet_model_busy_seconds_total": "busy_seconds",
    "embedfleet_admission_backlog_limit_seconds": "backlog_limit_s",
}
MODEL_LABEL = "model"


# The series a server must export for its demand and capacity to be read (DESIGN's shared signal),
# for each model it serves; an answer without them (another program on the port, an incompatible
# version) is blind, not zero.
REQUIRED = ("service_rate", "arrival_rate", "queued_tokens")


# The info series that says what a server serves; its `task` label is reported in status.task (per
# model: by its `model` label).
MODEL_INFO, TASK_LABEL = "embedfleet_model_info", "task"


def read_models(text: str) -> dict[str, dict]:
    """The METRICS samples of a Prometheus text exposition by model (its `model` label; "" for a
    series without one), as demand.ModelSample fields, with each model's `task` from MODEL_INFO's
    labels. A server from before the model label exports its series unlabelled and its info with
    a `model` label of its own (the model's path): its one task goes to the unlabelled model."""
    out: dict[str, dict] = {}
    tasks: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                fields = out.setdefault(sample.labels.get(MODEL_LABEL, demand.OLD_SERVER), {})
                fields[METRICS[sample.name]] = fields.get(METRICS[sample.name], 0.0) + float(sample.value)
            elif sample.name == MODEL_INFO and sample.labels.get(TASK_LABEL):
                tasks[sample.labels.get(MODEL_LABEL, demand.OLD_SERVER)] = sample.labels[TASK_LABEL]
    for model, fields in out.items():
        task = tasks.get(model) or (next(iter(set(tasks.values()))) if model == demand.OLD_SERVER
                                    and len(set(tasks.values())) == 1 else None)
        if task:
            fields["task"] = task
    return out


def read_exposition(text: str) -> tuple[dict[str, float], str | None]:
    """→ (a pod's METRICS samples as PodSample fields, the task its MODEL_INFO labels or None):
    its one model's (the shape of a one-model pod); with several models their sums, which are no
    signal (decide reads each model: read_models)."""
    models = read_models(text)
    out: dict[str, float] = {}
    for fields in models.values():
        for field, value in fields.items():
            if field != "task":
                out[field] = out.get(field, 0.0) + value
    tasks = {f.get("task") for f in models.values()}
    return out, (tasks.pop() if len(tasks) == 1 else None)


def parse_metrics(text: str) -> dict[str, float]:
    """The METRICS samples of a Prometheus text exposition, as PodSample fields."""
    return read_exposition(text)[0]


def sample_of(base: dict, models: dict[str, dict]) -> autoscale.PodSample:
    """A scraped pod's sample: its readings per model, and with one model those readings in the
    sample's own fields too (a one-model pod reads as it always did)."""
    readings = tuple(demand.ModelSample(model, **fields) for model, fields in models.items())
    if len(readings) == 1:
        return autoscale.PodSample(scraped=True, **base, **models[readings[0].model], models=readings)
    return autoscale.PodSample(scraped=True, **base, models=readings)


def _time(value: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    ready: bool
    served: bool  # the API shows it has been Ready, though it is not now
    startup_s: float | None  # creation → Ready, when that Ready follows the container's start


# Ready's transition to False this long after the pod started is a flip, not the status the
# kubelet first writes (with status.startTime, give or take a moment).
FLIP_AFTER_START_S = 5.0


def pod_view(pod: dict, startup_allowance_s: float = render.STARTUP_ALLOWANCE_S) -> PodView | None:
    """What the autoscaler needs of a Pod, as the API keeps it (an operator restart forgets
    nothing): None for a pod being deleted (it leaves the fleet, whatever its state).

    A pod that is not Ready has served when its containers are `started` (the kubelet keeps that
    from the startup probe's success until a container restarts or the kubelet loses its state),
    or when Ready turned False after the pod started (the kubelet writes Ready=False at its first
    sync, with status.startTime; a later transition is a flip from True, and stays the first
    crash's through a crash loop): an overloaded pod, a node gone NotReady, a container that
    crashed and restarts. A pod that failed for good (evicted) is gone from the fleet. Start-up time is creation → Ready, measured
    only where that Ready is the container's first (no restart, and within the startup probe's
    allowance of the container's start): after a flap, Ready's lastTransitionTime is the flap's."""
    st = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or st.get("phase") in ("Failed", "Succeeded"):
        return None  # leaving, or gone for good (evicted: its model cache over its limit, a node shut down)
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
    ready = cond.get("status") == "True"
    containers = st.get("containerStatuses") or []
    created, changed = _time(pod["metadata"].get("creationTimestamp")), _time(cond.get("lastTransitionTime"))
    running = [_time(((c.get("state") or {}).get("running") or {}).get("startedAt")) for c in containers]
    began = _time(st.get("startTime"))
    flipped = changed is not None and began is not None and (changed - began).total_seconds() > FLIP_AFTER_START_S
    served = not ready and ((bool(containers) and all(c.get("started") for c in containers)) or flipped)
    first = not any(c.get("restartCount") for c in containers) and all(
        t is None or changed is None or (changed - t).total_seconds() <= startup_allowance_s for t in running)
    startup = (changed - created).total_seconds() if ready and first and created and changed else None
    return PodView(pod["metadata"]["name"], st.get("podIP"), ready, served, startup)


def metrics_url(ip: str, port: int) -> str:
    """An IPv6 literal goes in brackets (IPv6-only and IPv6-first dual-stack clusters)."""
    host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
    return f"http://{host}:{port}/metrics"


def ports(spec: dict, metrics_port: int = render.METRICS_PORT) -> tuple[int, ...]:
    """Where the autoscaler reads a service's pods, in order (Reader): the metrics port, and for
    an unguarded service the API port after it, for a pod that refuses the metrics port or lets no
    connection through there (remembered per pod).

    Why not simply render.health_port: an unguarded server's API port answers /metrics behind the
    API's middleware, on a listener whose connections the API's clients share (and which it closes
    every MAX_CONNECTION_AGE_S); the metrics port answers with nothing in front of it
    (transports/metrics_port.py), so under the overload autoscaling is for, its answer comes
    sooner (python -m bench.scrape_ports). Both share the server's one event loop: what keeps an
    overloaded fleet growing when neither answers is the saturated reading (autoscale.decide),
    not the port. Pods of a server image from before the metrics port refuse it at once and are
    read on the API port, as before; the probes stay on health_port, since a probe cannot fall
    back."""
    return (metrics_port,) if render.guarded(spec) else (metrics_port, render.HTTP_PORT)


class Reader:
    """One service's scrapes: one HTTP session for its pods (a new connection per scrape: see the
    module's docstring; one handshake per pod per interval) and, per pod, the port its /metrics
    answered on."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.ports: dict[str, int] = {}  # pod name → the port that answered (a pod's image never changes)

    async def __aenter__(self) -> "Reader":
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             trace_configs=[_connection_trace()])
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def scrape(self, pods: list[dict], ports: tuple[int, ...], timeout: float,
                     errors: dict[str, str] | None = None) -> list[autoscale.PodSample]:
        """Every pod that has served (Ready, or turned unready: it may still carry load) is scraped,
        on `ports` in order (ports()), each with `timeout`: the next one only after the pod refused
        the connection or let none through (a pod never read may so cost two timeouts, once), and
        then on the one that answered. `errors`, when given, gets each failed scrape's error by
        pod name."""
        views = [v for v in map(pod_view, pods) if v is not None]
        self.ports = {v.name: p for v in views if (p := self.ports.get(v.name)) in ports}
        return list(await asyncio.gather(*(self._one(v, ports, timeout, errors) for v in views)))

    async def _one(self, view: PodView, ports: tuple[int, ...], timeout: float,
                   errors: dict[str, str] | None) -> autoscale.PodSample:
        base = dict(name=view.name, ready=view.ready, served=view.served, startup_s=view.startup_s)
        if not (view.ready or view.served) or not view.ip:
            return autoscale.PodSample(scraped=False, **base)
        known = self.ports.get(view.name)
        failures, timed_out = [], False
        for port in (known,) if known is not None else ports:
            attempt: dict = {}
            try:
                async with self.session.get(metrics_url(view.ip, port), timeout=aiohttp.ClientTimeout(total=timeout),
                                            trace_request_ctx=attempt) as r:
                    r.raise_for_status()
                    models = read_models(await r.text())
                missing = sorted({f for fields in models.values() or [{}] for f in REQUIRED if f not in fields})
                if missing:
                    raise ValueError("no " + ", ".join(k for k, v in METRICS.items() if v in missing) +
                                     " in its /metrics" + (f" for every model ({', '.join(models)})" if len(models) > 1
                                                           else "") +
                                     ": not an embedfleet server, or an incompatible version")
                self.ports[view.name] = port
                return sample_of(base, models)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                sent = attempt.get("sent", False)
                timed_out = isinstance(e, asyncio.TimeoutError) and sent and attempt.get("connected", False)
                failures.append(f"port {port}: " + (f"{type(e).__name__}: {e}" if str(e) else
                                                    f"no answer within {timeout:g} s" if sent else
                                                    f"no connection within {timeout:g} s"))
                if not _unreachable(e, sent):
                    break  # something answers on this port: another would not be the pod's signal either
        if errors is not None:
            errors[view.name] = "; ".join(failures)
        return autoscale.PodSample(scraped=False, timed_out=timed_out, **base)


def _unreachable(error: Exception, sent: bool) -> bool:
    """Nothing took the connection: refused (nothing binds the port) or none within the timeout."""
    if isinstance(error, aiohttp.ClientConnectorError):  # no route to the host is no better on another port
        return getattr(error.os_error, "errno", None) == errno.ECONNREFUSED
    return isinstance(error, asyncio.TimeoutError) and not sent


def _connection_trace() -> aiohttp.TraceConfig:
    """Marks an attempt (its trace_request_ctx) `connected` once a TCP handshake of its own has
    completed, and `sent` once its request is written; a new connection (aiohttp's own retry of a
    stale one included) clears `sent`. Both together say the pod's kernel took this attempt: a
    connection reused from an earlier one (which force_close rules out) would never be `connected`."""
    trace = aiohttp.TraceConfig()

    async def connecting(_session, ctx, _params) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["sent"] = False

    async def connected(_session, ctx, _params) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["connected"] = True

    async def sent(_session, ctx, _params) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["sent"] = True

    trace.on_connection_create_start.append(connecting)
    trace.on_connection_create_end.append(connected)
    trace.on_request_headers_sent.append(sent)
    return trace


def unscraped(samples: list[autoscale.PodSample], errors: dict[str, str], ports: tuple[int, ...],
              saturated: int = 0) -> str | None:
    """Why no ready pod could be read on `ports` (ports()), or None when one was (or
    none is ready yet). Failed scrapes hold the count (autoscale.decide), unless `saturated` of
    them read as saturated (the fleet grows): said in status and an Event, not left to be noticed."""
    ready = sorted(s.name for s in samples if s.ready)
    if not ready or any(s.scraped for s in samples if s.ready):
        return None
    if saturated:
        return (f"none of the {len(ready)} ready pod(s) could be scraped on port {' or '.join(map(str, ports))} "
                f"/metrics ({ready[0]}: {errors.get(ready[0], 'failed')}); {saturated} of them took the scrape and did "
                f"not answer in time after a reading at or above target: saturated, so the fleet grows by a step "
                f"whenever none of its pods is still starting, until they answer")
    causes = ("a NetworkPolicy that keeps the operator from those ports" if render.HTTP_PORT in ports else
              "a NetworkPolicy that keeps the operator from the pods' metrics port, or a server image from "
              "before the metrics port (spec.auth, spec.tls and spec.networkPolicy need one that has it)")
    where = " or ".join(str(p) for p in ports)
    return (f"none of the {len(ready)} ready pod(s) could be scraped on port {where} /metrics "
            f"({ready[0]}: {errors.get(ready[0], 'failed')}); the replica count is held until one can be "
            f"({causes} does this)")
