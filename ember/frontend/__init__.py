"""The front end: tokenizing, validation, detokenizing and output streams, behind EngineClient."""

from ember.frontend.client import EngineClient

__all__ = ["EngineClient"]
