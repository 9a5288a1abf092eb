"""Reproduces the embedded ling-nano model: data, tokenizer, training, evaluation, model card.

Entry point: `python -m training.reproduce --out DIR` (see training/README.md).
"""
