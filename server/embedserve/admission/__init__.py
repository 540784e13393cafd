"""Admission: the shared signal (estimator.py: service rate, arrival rate, backlog and P95, in real
tokens), the decisions made on it (policy.py, pure), the gate that counts each offer and admits,
holds, books or refuses it (gate.py), and the room booked for requests that find none yet
(reservations.py). The autoscaler reads the same signal through /metrics: one signal, two uses.

May import: embedserve.errors
"""
