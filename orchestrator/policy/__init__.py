"""Decisions the orchestrator makes from measurements, kept apart from the calls they steer.

    admission.py     how many generations decode at once; the rest wait in a bounded FIFO queue
    draft_length.py  how many tokens to draft per step: fixed, heuristic, or goodput from the target's cost profile
"""
