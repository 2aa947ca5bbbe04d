"""Kestrel: an engine and RL trainer for the Kimi hybrid model family.

`from kestrel import LLM, SamplingParams` as from vLLM: the offline API, imported on first use (it loads torch)."""

from kestrel.version import KESTREL_VERSION as __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kestrel.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kestrel.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kestrel' has no attribute {name!r}")
