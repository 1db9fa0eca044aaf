"""Which proposer a draft serves, built from its settings: a model (float or int8), the n-gram drafter with its
datastore, or both (hybrid); with the ModelInfo the service reports. Used by server.py and by the orchestrator's
in-process drafter."""

from __future__ import annotations

import logging
import pathlib

from draft_service.proposers.base import Proposer
from draft_service.settings import DraftSettings
from specdec.v1 import common_pb2

log = logging.getLogger("specdec.draft")


def build_proposer(settings: DraftSettings) -> tuple[Proposer, common_pb2.ModelInfo]:
    """The proposer the settings' strategy names, and its ModelInfo."""
    from specdec.core.kv_cache import SessionCacheStore
    from specdec.models import load_model, load_tokenizer

    strategy, model, vocab_from, datastore = settings.strategy, settings.model, settings.vocab_from, settings.datastore
    if strategy == "ngram":
        return build_ngram_proposer(load_tokenizer(vocab_from) if vocab_from else None, vocab_from, datastore)
    if strategy == "suffix":
        return build_suffix_proposer(load_tokenizer(vocab_from) if vocab_from else None)
    from draft_service.proposers.model import ModelProposer, limit_draft_vocab
    from specdec.core.strategies import MODEL_STRATEGIES

    if strategy not in MODEL_STRATEGIES:
        raise ValueError(f"unknown draft strategy {strategy!r} (model, ngram, suffix, hybrid or quantized)")
    quantize = settings.quantize
    if strategy == "quantized":  # --model (the target) with its weights rounded to int8
        quantize = "int8"
    if quantize not in ("none", "int8"):
        raise ValueError(f"quantize must be none or int8, not {quantize!r}")
    # int8 replaces the linear layers: no oneDNN-packed float copies of them first
    loaded = load_model(model, device=settings.device, dtype=settings.dtype,
                        prepack="off" if quantize == "int8" else settings.prepack)
    store = SessionCacheStore(max_sessions=settings.max_sessions, max_bytes=settings.max_cache_mb * 1024 * 1024)
    info = common_pb2.ModelInfo(
        model_name=loaded.name, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.fingerprint,
        max_context=loaded.max_context, eos_token_ids=loaded.eos_token_ids, device=str(loaded.device),
        dtype=str(loaded.dtype).replace("torch.", ""), strategy=strategy,
    )
    lm = None
    if quantize == "int8":
        from draft_service.int8_draft import int8_draft

        lm = int8_draft(loaded, store, batch_rows=settings.batch_rows)  # the full vocabulary: its head is the target's, in int8
        info.model_name = f"{loaded.name}[int8]"
        info.dtype = "int8"
        if getattr(lm, "kv_dims", None) is not None:  # the lean runtime takes the target's prompt KV
            info.kv_fingerprint = loaded.kv_fingerprint
    elif limit_draft_vocab(loaded, settings.draft_vocab):
        info.model_name = f"{loaded.name}[vocab<{settings.draft_vocab}]"
    proposer = ModelProposer(loaded, store, lm)
    info.drafts_trees = proposer.drafts_trees
    if strategy == "hybrid":
        from draft_service.proposers.hybrid import HybridProposer
        from draft_service.proposers.ngram import NgramProposer

        store = open_datastore(datastore, vocab_from or model, loaded.fingerprint, loaded.vocab_size)
        info.model_name = f"{ngram_model_name(store)}+{info.model_name}"
        info.kv_fingerprint = ""  # the hybrid's n-gram side drafts too: it takes no KV
        info.drafts_trees = False
        return HybridProposer(NgramProposer(vocab_size=loaded.vocab_size, datastore=store), proposer,
                              settings.hybrid_model_max_len), info
    return proposer, info


def build_ngram_proposer(tokenizer, target: str | None, datastore: str,
                         vocab_size: int | None = None) -> tuple[Proposer, common_pb2.ModelInfo]:
    """The n-gram drafter and its ModelInfo. A model-free drafter still answers to the target's tokenizer, for the
    start-up compatibility check; ``vocab_size`` defaults to the tokenizer's (the orchestrator's in-process
    drafter passes the target's)."""
    from draft_service.proposers.ngram import NgramProposer
    from specdec.models import tokenizer_fingerprint

    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 2**31)
    fingerprint = "" if tokenizer is None else tokenizer_fingerprint(tokenizer)
    store = open_datastore(datastore, target, fingerprint, vocab)
    info = common_pb2.ModelInfo(model_name=ngram_model_name(store), vocab_size=0 if tokenizer is None else vocab,
                                tokenizer_fingerprint=fingerprint, strategy="ngram", drafts_trees=True)
    return NgramProposer(vocab_size=vocab, datastore=store), info


def build_suffix_proposer(tokenizer, vocab_size: int | None = None) -> tuple[Proposer, common_pb2.ModelInfo]:
    """The suffix-tree drafter (draft_service/proposers/suffix.py) and its ModelInfo; arguments as
    build_ngram_proposer's. It advertises the longest draft a Verify may carry: its drafts follow the match."""
    from draft_service.proposers.suffix import SuffixProposer
    from specdec.core.settings import LONG_DRAFT_LEN
    from specdec.core.strategies import suffix_tree_missing
    from specdec.models import tokenizer_fingerprint

    missing = suffix_tree_missing()
    if missing:
        raise ValueError(f"the suffix drafter needs arctic-inference's suffix tree (scripts/bootstrap.sh installs "
                         f"it): {missing}")
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 2**31)
    fingerprint = "" if tokenizer is None else tokenizer_fingerprint(tokenizer)
    info = common_pb2.ModelInfo(model_name="suffix(arctic-inference)", vocab_size=0 if tokenizer is None else vocab,
                                tokenizer_fingerprint=fingerprint, strategy="suffix", max_draft_len=LONG_DRAFT_LEN)
    return SuffixProposer(vocab_size=vocab), info


def ngram_model_name(store) -> str:
    return "ngram(prompt-lookup" + (f"+datastore[{store.entries}])" if store else ")")


def open_datastore(choice: str, target: str | None, fingerprint: str, vocab_size: int):
    """--datastore: none; a path; or auto: the table `specdec datastore` wrote for the target, if there is one.
    A table from another tokenizer would only propose wrong tokens: refused (auto: ignored with a warning)."""
    from draft_service.proposers.datastore import NgramDatastore, datastore_path

    if choice in ("", "none"):
        return None
    path = datastore_path(target) if choice == "auto" and target else pathlib.Path(choice).expanduser()
    if choice == "auto" and (not target or not path.is_file()):
        log.info("no n-gram datastore; prompt lookup only (`specdec datastore` builds one)",
                 extra={"path": str(path) if target else None})
        return None
    store = NgramDatastore.load(path)
    problem = None
    if fingerprint and store.meta.get("tokenizer_fingerprint") != fingerprint:
        problem = f"datastore {path} was built for another tokenizer ({store.meta.get('target')!r})"
    elif store.max_token() >= vocab_size:
        problem = f"datastore {path} holds token ids beyond the vocabulary of {vocab_size}"
    if problem and choice == "auto":
        log.warning(problem + "; not used", extra={"path": str(path)})
        return None
    if problem:
        raise ValueError(problem)
    log.info("n-gram datastore loaded", extra={"path": str(path), "entries": store.entries})
    return store
