"""embedserve: the embedfleet serving image (gRPC + HTTP embedding server)."""

__version__ = "0.3.0"
