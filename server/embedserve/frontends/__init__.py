"""FRONTENDS > 1: front-end processes (frontend.py) serve the ports, shape and tokenize requests,
for one model process, the only one touching the device, which answers them (door.py) over a
ZeroMQ link (ipc.py). Admission, batching and the estimator keep their one home in the model
process; with FRONTENDS=1 none of this runs.

May import: embedserve.config, embedserve.model_list, embedserve.errors, embedserve.lifecycle, embedserve.metrics, embedserve.tracing, embedserve.logs, embedserve.transports, embedserve.admission, embedserve.batching, embedserve.model
"""
