"""embedop: the embedfleet operator (EmbeddingService → GPU Deployments, Services, autoscaling)."""

__version__ = "0.2.0"
