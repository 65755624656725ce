"""Speculative decoding's torch-free parts: its configuration and the n-gram proposer.

The executor proposes after each step (``ModelRunner.propose``, with this package's n-gram
lookup or ``executor/draft_proposer.py``), the scheduler reserves lookahead slots for the
proposals (``core/lookahead.py``), the executor verifies them (``executor/spec_verify.py``).
See docs/speculative.md.
"""
