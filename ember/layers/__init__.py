"""Layers built once and shared by every model family."""
