"""The speculative loop: draft proposes, target verifies, the orchestrator commits and stores each block.

    generation.py  a session's generation: the parts below put together; stats_message
    step.py        one step: propose -> verify -> accept, or fall back to target-only decoding
    draft_call.py  the draft side: replica, deadline, Propose, failures
    target_call.py the target side: Verify and Decode on the session's target replica, moving on when it fails
    prefetch.py    pipelining: the next block drafted while the target verifies this one
    handover.py    a new session's prompt: parallel prefill, or the target's KV handed to the draft
    tree.py        tree speculation, the step's strategy in place of the chain
    accounting.py  what a verify or a decode counts (stats, acceptance window, metrics, draft length)
    validate.py    the one check of a draft's reply
    stream.py      the stepper thread, stop conditions, store-then-send
    text.py        incremental detokenisation and stop strings: the text a client may see
    state.py       what the parts share
"""

from orchestrator.loop.generation import Generation, stats_message
from orchestrator.loop.state import (AcceptanceWindow, Backends, Chunk, GenerationError, Measurements, StepTimer,
                                     StreamControl)
from orchestrator.settings import LoopConfig

__all__ = ["AcceptanceWindow", "Backends", "Chunk", "Generation", "GenerationError", "LoopConfig", "Measurements",
           "StepTimer", "StreamControl", "stats_message"]
