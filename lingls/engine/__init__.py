"""The engines the language server and `lingls serve` call: the Engine protocol (`protocol.py`), a model in this
process (`local.py`), one over HTTP (`remote.py`), the tokenizer and token healing.

Importing this package (and `protocol.py`) never imports torch: the language server starts without it.
"""
