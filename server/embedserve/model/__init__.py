"""The model: where its files come from (source.py), how its authors declared it is served
(declared.py), the shapes and batches it runs (shapes.py, batches.py), the encoder on its device
(encoder.py, with pooling.py, varlen.py for packed rows and cuda_graphs.py), the worker thread that
warms it up and runs batches (worker.py), and a simulated device (simulated.py). It knows nothing
of requests, queues or admission.

May import: embedserve.config
"""
