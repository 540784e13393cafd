"""Transports: the gRPC and HTTP listeners of a serving process (listeners.py, grpc_server.py,
http_server.py), the JSON API (http_api.py: OpenAI, TEI-style, classify; http_tei.py: TEI's
/tokenize, /decode, /similarity and root route), the vectors as a request asks for them
(encodings.py: dimensions, quantization, base64, for gRPC and HTTP alike; http_quantization.py:
the int8/uint8 ranges a server uses), what a request leaves
behind besides metrics (outcomes.py: its span and its log line) and the Hub they serve from
(hub.py: the one process's Server, or a front end's link to the model process). They turn
requests into calls of the service and its errors into statuses, and decide nothing about
admission or batching.

May import: embedserve.config, embedserve.errors, embedserve.lifecycle, embedserve.metrics, embedserve.tracing, embedserve.logs, embedserve.admission, embedserve.batching, embedserve.model
"""
