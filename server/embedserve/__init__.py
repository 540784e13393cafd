"""embedserve: the embedfleet serving image (gRPC + HTTP embedding server)."""

__version__ = "0.1.0"
