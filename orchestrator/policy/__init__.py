"""Decisions the orchestrator makes from measurements, kept apart from the calls they steer.

    admission.py     how many generations decode at once; the rest wait in a bounded FIFO queue
    draft_length.py  how many tokens to draft per step: goodput from the target's cost profile, or fixed_length's
    fixed_length.py  the draft length without a cost model: fixed, or transformers' heuristic
"""
