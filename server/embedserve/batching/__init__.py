"""Batching: a request into token rows (shaping.py, tokenization.py, infer_decode.py), rows waiting
to be tokenized together (intake.py), the bucket queues (queues.py), the batcher's pure decisions
(decisions.py) and the engine (engine.py) that forms padded or packed batches (packing.py), hands
them to the model worker, routes their results and feeds the estimator. It builds what the model
runs (embedserve.model.batches); the model never reaches back into it.

May import: embedserve.config, embedserve.errors, embedserve.threads, embedserve.admission, embedserve.model
"""
