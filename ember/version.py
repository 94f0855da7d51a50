"""ember's version, in a module of its own so that writers of files can name it without importing the engine."""

__version__ = "0.1.0"
