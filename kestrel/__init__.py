"""Kestrel: an engine and RL trainer for the Kimi hybrid model family."""

from kestrel.version import KESTREL_VERSION as __version__

__all__ = ["__version__"]
