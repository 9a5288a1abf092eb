"""Ling-3.0 model: config, forward pass, checkpoint loading."""

from lingls.model.config import ConfigError, LingConfig
from lingls.model.ling import InferenceState, LingForCausalLM, Parallel
from lingls.model.loader import CheckpointError, load_model, save_checkpoint

__all__ = ["CheckpointError", "ConfigError", "InferenceState", "LingConfig", "LingForCausalLM", "Parallel",
           "load_model", "save_checkpoint"]
