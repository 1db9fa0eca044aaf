"""Draft strategy names shared by the launcher, the draft service and the benchmark."""

MODEL_STRATEGIES = ("model", "hybrid", "quantized")  # draft strategies that load a draft model
QUANTIZED = "quantized"  # the target's own weights in int8 as the draft (draft_service/int8_draft.py)
LOCAL_NGRAM = "local-ngram"  # the orchestrator drafts in process (`--draft local:ngram`)
