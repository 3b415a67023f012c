"""kvcompat: a compatibility matrix for vLLM KV connectors (MultiConnector + Nixl + CPU offload)."""

__version__ = "0.1.0"
