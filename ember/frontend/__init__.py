"""The front end: tokenizing, validation, detokenizing and output streams, behind EngineClient."""

from ember.frontend.client import EngineClient, start_client

__all__ = ["EngineClient", "start_client"]
