import os

import pytest

from embedserve.config import PACKAGED_MODEL, ConfigError, Settings


def test_defaults_match_the_design_contract():
    s = Settings.from_env({})
    assert s.model_path == PACKAGED_MODEL
    assert (s.grpc_port, s.http_port) == (50051, 8001)
    assert (s.max_batch_size, s.max_tokens_per_batch) == (512, 32768)
    assert s.buckets == (16, 32, 64, 128, 256, 512)
    assert s.deadline_wait_ms == 50 and s.gpu_queue_maxsize == 4
    assert s.backpressure_throughput and not s.backpressure_latency
    assert (s.pooling, s.normalize, s.exclude_tokens) == ("", None, ())  # as the model declares
    assert (s.max_connection_age_s, s.reservation_horizon_ms) == (30, 10_000)
    # Texts of the largest bucket at 16 characters of 4 bytes, +1 MiB; HTTP twice that, at most 32 MiB
    assert s.max_message_bytes == 512 * 512 * 16 * 4 + 2**20 and s.http_max_body_bytes == 32 * 2**20
    assert (s.truncate, s.max_texts_per_request) == (True, 512)
    assert (s.compile, s.dtype, s.task, s.trust_remote_code) == ("auto", "auto", "auto", False)


def test_values_are_parsed():
    s = Settings.from_env({
        "BUCKETS": "8, 64,128", "EXCLUDE_TOKENS": "[a],[b]", "NORMALIZE": "false",
        "BATCH_CAPS": "8:4,64:2", "POOLING": "CLS", "TRUST_REMOTE_CODE": "1", "GRPC_MAX_MESSAGE_BYTES": "4096",
    })
    assert s.buckets == (8, 64, 128)
    assert s.exclude_tokens == ("[a]", "[b]")
    assert s.normalize is False and s.trust_remote_code is True
    assert s.batch_caps == {8: 4, 64: 2}
    assert s.pooling == "cls"
    assert (s.max_message_bytes, s.http_max_body_bytes) == (4096, 8192)
    assert Settings.from_env({"POOLING": "cls+Mean"}).pooling == "cls+mean"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"GRPC_PORT": "abc"}, "GRPC_PORT='abc': expected an integer"),
        ({"POOLING": "maxi"}, "POOLING='maxi': expected one of cls, mean, max, lasttoken"),
        ({"POOLING": "mean+"}, "POOLING='mean\\+': expected one of"),
        ({"BUCKETS": "64,32"}, "BUCKETS"),
        ({"NORMALIZE": "maybe"}, "NORMALIZE='maybe'"),
        ({"MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE=0: must be >= 1"),
        ({"TOKENIZATION_WORKERS": "0"}, "TOKENIZATION_WORKERS=0: must be >= 1"),
        ({"COMPILE": "reduce-overhead"}, "COMPILE='reduce-overhead': expected one of auto, graphs, true, false"),
        ({"BATCH_CAPS": "16"}, "BATCH_CAPS"),
        ({"LATENCY_SOFT_MS": "900", "LATENCY_HARD_MS": "100"}, "LATENCY_SOFT_MS"),
        ({"FRONTEND_UNRESPONSIVE_S": "0"}, "FRONTEND_UNRESPONSIVE_S=0.0: must be >= 1"),
        ({"FRONTEND_UNRESPONSIVE_S": "nan"}, "FRONTEND_UNRESPONSIVE_S=nan: expected a finite number"),
        # NaN passed every comparison, infinity most; the watchdog ticks every floor / 4 s: a floor
        # of 0 ticked every 0 s, and one of 0.0001 as good as.
        ({"WATCHDOG_FLOOR_S": "0"}, "WATCHDOG_FLOOR_S=0.0: must be >= 1"),
        ({"WATCHDOG_FLOOR_S": "0.0001"}, "WATCHDOG_FLOOR_S=0.0001: must be >= 1"),
        ({"WATCHDOG_MULTIPLE": "NaN"}, "WATCHDOG_MULTIPLE=NaN: expected a finite number"),
        ({"MAX_DRAIN_TIME_MS": "inf"}, "MAX_DRAIN_TIME_MS=inf: expected a finite number"),
        ({"LATENCY_WINDOW_S": "0"}, "LATENCY_WINDOW_S=0.0: must be > 0"),
        ({"SHUTDOWN_GRACE_S": "-inf"}, "SHUTDOWN_GRACE_S=-inf: expected a finite number"),
        ({"DEADLINE_WAIT_MS": "-1"}, "DEADLINE_WAIT_MS=-1.0: must be >= 0"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Settings.from_env(env)


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import embedserve.config as mod

    tree = ast.parse(inspect.getsource(mod.Settings))
    body = tree.body[0].body
    fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    documented = {
        body[i].target.id for i in range(len(body) - 1)
        if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)
    }
    assert set(fields) == documented


def test_a_simulated_rate_must_be_a_positive_number():
    from embedserve.model import simulated

    for bad in ("sim:0", "sim:nan", "sim:-5", "sim:fast"):
        with pytest.raises(ValueError, match="MODEL_PATH"):
            simulated.parse(bad)
    assert simulated.parse("sim:2e4") == 20_000.0


def test_a_watchdog_floor_of_one_second_is_accepted():
    assert Settings.from_env({"WATCHDOG_FLOOR_S": "1"}).watchdog_floor_s == 1.0


@pytest.mark.parametrize("env, message", [
    ({"API_KEYS": ""}, "API_KEYS is set but holds no key"),
    ({"API_KEYS": " , ,"}, "API_KEYS is set but holds no key"),
    ({"API_KEYS_FILE": "{missing}"}, "API_KEYS_FILE='.*/missing': cannot read it"),
    ({"TLS_CERT_FILE": "{file}"}, "TLS_CERT_FILE is set without TLS_KEY_FILE"),
    ({"TLS_KEY_FILE": "{file}"}, "TLS_KEY_FILE is set without TLS_CERT_FILE"),
    ({"TLS_CLIENT_CA_FILE": "{file}"}, "TLS_CLIENT_CA_FILE is set without TLS_CERT_FILE"),
    ({"TLS_CERT_FILE": "{file}", "TLS_KEY_FILE": "{unreadable}"}, "TLS_KEY_FILE='.*': cannot read it"),
    ({"METRICS_PORT": "8001"}, "HTTP_HEALTH_PORT and METRICS_PORT are the same port"),
], ids=["API_KEYS empty", "API_KEYS commas", "unreadable key file", "cert without key", "key without cert",
        "client CA without cert", "unreadable key", "metrics port taken"])
def test_guards_configured_wrong_name_the_variable(tmp_path, env, message):
    """Who may call is configured wrong: a start-up error, never a server open by mistake."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "unreadable").mkdir()  # opening a directory fails, as root too
    paths = {"missing": tmp_path / "missing", "file": tmp_path / "file", "unreadable": tmp_path / "unreadable"}
    with pytest.raises(ConfigError, match=message):
        Settings.from_env({k: v.format(**paths) for k, v in env.items()})


def test_guards_are_off_by_default_and_the_metrics_port_is_8002():
    s = Settings.from_env({})
    assert s.metrics_port == 8002
    assert (s.api_keys, s.api_keys_file, s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file) == ((), "", "", "", "")
    assert Settings.from_env({"API_KEYS": "a, b"}).api_keys == ("a", "b")
    assert Settings.from_env({"METRICS_PORT": "0", "HTTP_HEALTH_PORT": "0"}).metrics_port == 0  # ephemeral: apart


def test_a_server_given_unusable_tls_files_exits_at_once_naming_the_variable(tmp_path):
    """Checked in the process that starts front ends, before any: a front end would die young,
    restarted with backoff for ever, the pod never ready and never saying why."""
    import subprocess
    import sys

    from tests.server.mounted_secret import Pki

    files = Pki(tmp_path).server_files()
    (tmp_path / "tls.crt").write_bytes(files["tls.crt"])
    (tmp_path / "tls.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    env = {**os.environ, "TLS_CERT_FILE": str(tmp_path / "tls.crt"), "TLS_KEY_FILE": str(tmp_path / "tls.key"),
           "FRONTENDS": "2", "MODEL_PATH": "sim:1000"}
    out = subprocess.run([sys.executable, "-m", "embedserve"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "configuration error: TLS_KEY_FILE=" in out.stderr, out.stderr


@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, True),
    # A protocol the traces' own variable overrides, as the SDK reads them.
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, True),
])
def test_tracing_is_on_with_an_otlp_endpoint_unless_the_sdk_or_its_exporter_is_off(env, on):
    assert Settings.from_env(env).tracing is on


@pytest.mark.parametrize("env, message", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP\\(_TRACES\\)_PROTOCOL='grpc': this server exports OTLP over HTTP"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "zipkin"},
     "OTEL_TRACES_EXPORTER='zipkin': this server exports otlp"),
    ({"LOG_FORMAT": "logfmt"}, "LOG_FORMAT='logfmt': expected one of text, json"),
    ({"ACCESS_LOG": "sometimes"}, "ACCESS_LOG='sometimes'"),
])
def test_traces_and_logs_settings_that_cannot_work_fail_start_up_naming_them(env, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


def test_logs_default_to_text_without_an_access_log():
    s = Settings.from_env({})
    assert (s.log_format, s.access_log, s.tracing) == ("text", False, False)
    assert Settings.from_env({"LOG_FORMAT": "JSON"}).log_format == "json"


@pytest.mark.parametrize("value, calibrated, r", [("calibrated", True, 1.0), ("Calibrated", True, 1.0),
                                                  ("0.3", False, 0.3), ("", False, 1.0)])
def test_quantize_range_is_a_positive_number_or_calibrated(value, calibrated, r):
    s = Settings.from_env({"QUANTIZE_RANGE": value})
    assert (s.quantize_calibrated, s.quantize_range) == (calibrated, r)


@pytest.mark.parametrize("env", [{"QUANTIZE_RANGE": "calibrate"}, {"QUANTIZE_RANGE": "0"},
                                 {"COMPILE_CACHE": "everywhere"}])
def test_quantize_range_and_compile_cache_name_themselves_when_wrong(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        Settings.from_env(env)
