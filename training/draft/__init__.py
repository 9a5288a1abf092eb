"""Distillation of the DSpark-style block drafter (`lingls.model.draft`) from ling-nano."""
