"""Draft strategy names shared by the launcher, the draft service and the benchmark."""

MODEL_STRATEGIES = ("model", "hybrid", "quantized")  # draft strategies that load a draft model
QUANTIZED = "quantized"  # the target's own weights in int8 as the draft (draft_service/int8_draft.py)
LOCAL_NGRAM = "local-ngram"  # the orchestrator drafts in process (`--draft local:ngram`)
LOCAL_SUFFIX = "local-suffix"  # the orchestrator drafts in process with suffix trees (`--draft local:suffix`)
# strategies without a draft process -> the orchestrator's --draft address of their in-process drafter
LOCAL_DRAFTS = {LOCAL_NGRAM: "local:ngram", LOCAL_SUFFIX: "local:suffix"}


def suffix_tree_missing() -> str | None:
    """Why arctic-inference's suffix tree (the suffix drafter's, draft_service/proposers/suffix.py) cannot be imported
    here, or None; scripts/bootstrap.sh installs it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError as e:
        return str(e)
    return None
