"""The gateway: an OpenAI-compatible endpoint per rollout that records exact token ids."""

from tracetrain.gateway.app import Gateway, create_app

__all__ = ["Gateway", "create_app"]
