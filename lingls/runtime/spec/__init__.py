"""Speculative decoding: the round (`round.py`: draft, verify, accept, commit), its drafters, the rejection rule
and the drafter's reduced vocabulary (`draft_vocab.py`)."""
