"""The one config path: frozen dataclasses built once (`ModelConfig.from_hf`, `EngineConfig`, `TrainConfig`)."""

from kestrel.config.engine import EngineConfig
from kestrel.config.model import DENSE, KDA, MLA, MOE, ModelConfig, mxfp4_quantization_config
from kestrel.config.train import TrainConfig

__all__ = [
    "DENSE",
    "KDA",
    "MLA",
    "MOE",
    "EngineConfig",
    "ModelConfig",
    "TrainConfig",
    "mxfp4_quantization_config",
]
