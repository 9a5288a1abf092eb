"""Distillation of a DSpark drafter (`lingls.model.dspark`, the published layout) from a frozen target."""
