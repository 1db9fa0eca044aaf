"""Tree verification on the target: the new context tokens and the whole token tree in ONE forward pass
(float tree attention mask, explicit position ids), multi-branch verification, then only the accepted
path's KV entries are kept, so the next step continues from an ordinary cache."""

from __future__ import annotations

import time

from specdec.core import sampling
from specdec.core import tree
from specdec.core.sampling import TreeVerifyResult
from target_service.engines.jobs import VerifyOutcome


def verify_tree_job(engine, job) -> None:
    """Fill ``job.result`` (or ``job.error``) for a VerifyJob whose task's draft_tokens form a tree."""
    t0 = time.perf_counter()
    task = job.task
    try:
        sess = engine.store.get(task.session_id)
    except Exception as e:  # noqa: BLE001
        job.error = e
        return
    with sess.lock:
        try:
            parents = tree.check_parents(task.tree_parents, len(task.draft_tokens))
            new = engine.lm.sync(sess, task.prefix_len, task.delta)
        except Exception as e:  # noqa: BLE001 - reported to this job's caller
            job.error = e
            return
        context_len = len(sess.tokens) + len(new)
        try:
            logits = tree.extend_tree(engine.lm, sess, new, task.draft_tokens, parents)
        except Exception as e:  # noqa: BLE001 - extend_tree left the cache as it was
            job.error = e
            return
        try:
            # Row 0: the root (after the last context token); row i + 1: after node i.
            rows = logits[len(new) - 1:]
            gen = None if task.params.is_greedy else sampling.make_generator(task.seed, task.step, "verify")
            result: TreeVerifyResult = sampling.verify_tree(rows, task.draft_tokens, parents, task.draft_probs,
                                                            task.params, gen)
            tree.keep_tree_path(sess, result.path, task.draft_tokens)
            engine.store.update_size(sess)
            job.result = VerifyOutcome(result.num_accepted, int(result.next_token), len(sess.tokens),
                                       (time.perf_counter() - t0) * 1e3, 1, tuple(result.path))
        except Exception as e:  # noqa: BLE001
            tree.drop_tree_kv(sess)
            engine.lm.crop(sess, min(context_len, len(sess.tokens)))
            job.error = e
