"""The n-gram datastore drafter: table building, lookup order, save/load, tokenizer check, exactness end to end."""

import numpy as np
import pytest

from draft_service.proposers.datastore import NgramDatastore
from draft_service.proposers.ngram import NgramProposer
from draft_service.build import open_datastore
from draft_service.server import build_server
from tests.harness import TARGET, model, start_stack


def test_build_keeps_the_most_frequent_follower_longest_ngram_first():
    seqs = [([1, 2, 3, 4], 0), ([1, 2, 3, 4], 0), ([9, 2, 3, 5], 0)]
    store = NgramDatastore.build(seqs, max_n=3)
    assert store.next_token([2, 3]) == 4          # 4 followed (2, 3) twice, 5 once
    assert store.next_token([9, 2, 3]) == 5       # the longer n-gram wins
    assert store.next_token([7]) is None
    assert store.continuation([1, 2], 5) == [3, 4]  # chained: stops where the table has nothing
    assert store.meta["sequences"] == 3 and store.entries == len(store.tables[1]) + len(store.tables[2]) + len(store.tables[3])


def test_start_position_excludes_the_prompt():
    store = NgramDatastore.build([([5, 6, 7, 8], 3)], max_n=2)  # only token 8 (index 3) is a continuation
    assert store.next_token([6]) is None
    assert store.next_token([7]) == 8


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 50, 40).tolist(), 5) for _ in range(20)]
    store = NgramDatastore.build(seqs, max_n=4, target="x", tokenizer_fingerprint="f")
    path = tmp_path / "t.npz"
    store.save(path)
    back = NgramDatastore.load(path)
    assert back.tables == store.tables
    assert back.meta["target"] == "x" and back.meta["entries"] == store.entries


def test_proposer_prefers_the_context_then_the_datastore():
    store = NgramDatastore.build([([1, 2, 3, 40, 41, 42, 7, 8, 50], 0)], max_n=2)
    p = NgramProposer(vocab_size=64, datastore=store)
    # The context repeats (7, 8): prompt lookup continues it, although the datastore knows (7, 8) too.
    assert p.lookup([7, 8, 9, 10, 7, 8], 3) == [9, 10, 7]
    assert p.lookup([20, 3, 11, 3], 2) == [11, 3]  # a single-token context match still comes first
    # No match in the context: the datastore continues (3 -> 40 41 42 ...).
    assert p.lookup([5, 6, 3], 3) == [40, 41, 42]
    assert NgramProposer(vocab_size=64).lookup([5, 6, 3], 3) == []


def test_open_datastore_checks_the_tokenizer(tmp_path):
    path = tmp_path / "t.npz"
    NgramDatastore.build([([1, 2, 3], 0)], tokenizer_fingerprint="abc", target="t").save(path)
    assert open_datastore(str(path), "t", "abc", 64).entries > 0
    with pytest.raises(ValueError, match="another tokenizer"):
        open_datastore(str(path), "t", "other", 64)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        open_datastore(str(path), "t", "abc", 3)
    assert open_datastore("none", "t", "abc", 64) is None


def test_greedy_speculation_with_a_datastore_equals_target_only(redis_url):
    """The tiny target's own replies fill the table: the drafts are often right, the output never changes."""
    loaded = model(TARGET)
    prompts = [[1, 5, 9, 12, 5, 9], [7, 7, 7, 30, 31, 32, 7, 7], list(range(1, 40, 3)), [3, 4, 5]]
    s = start_stack(redis_url, draft=None)
    try:
        refs = [s.client.generate(p, max_new_tokens=40, speculation=False, ignore_eos=True).token_ids for p in prompts]
    finally:
        s.stop()
    store = NgramDatastore.build([(p + r, len(p) - 1) for p, r in zip(prompts[:2], refs[:2])], max_n=4)
    proposer = NgramProposer(vocab_size=loaded.vocab_size, datastore=store)
    from specdec.v1 import common_pb2

    dsrv = build_server(proposer, common_pb2.ModelInfo(model_name="ngram", strategy="ngram"), "127.0.0.1:0").start()
    s = start_stack(redis_url, draft=None)
    try:
        from orchestrator.replicas.draft_pool import DraftPool

        s.servicer.pool = DraftPool([dsrv.address])
        for prompt, ref in zip(prompts, refs):
            for k in (2, 5):
                got = s.client.generate(prompt, max_new_tokens=40, speculation=True, max_draft_len=k, ignore_eos=True)
                assert got.token_ids == ref
                assert got.stats["fallback_steps"] == 0
        seen = s.client.generate(prompts[0], max_new_tokens=40, speculation=True, max_draft_len=4, ignore_eos=True)
        assert seen.stats["acceptance_rate"] > 0.5  # a reply the table holds is drafted well
    finally:
        s.stop()
        dsrv.stop(0)


def test_datastore_command_quick(tmp_path, capsys):
    """`specdec datastore --quick` on the tiny target: writes a loadable table and the held-out report."""
    import json

    from offline.datastore_build import main

    out = tmp_path / "tiny-datastore.npz"
    assert main(["--target-model", TARGET, "--quick", "--no-teacher-cache", "--no-progress", "--out", str(out),
                 "--train-prompts", "6", "--heldout-prompts", "3", "--gen-max-new", "24"]) == 0
    summary = json.loads(capsys.readouterr().out)
    store = NgramDatastore.load(out)
    assert store.entries == summary["entries"] > 0
    assert store.meta["tokenizer_fingerprint"] == model(TARGET).fingerprint
    for key in ("prompt_lookup", "prompt_lookup_and_datastore"):
        assert all(r["tokens_per_step"] >= 1.0 for r in summary[key])


def test_benchmark_prompts_stay_out_of_the_table():
    from specdec.eval_prompts import PROMPTS
    from offline.datastore_build import TableSettings, build_from_teacher_data, overlapping_benchmark
    from offline.distill import TeacherData
    import torch

    assert overlapping_benchmark([PROMPTS[0].text + " Thanks.", "An unrelated question about gardens."]) == [
        PROMPTS[0].text + " Thanks."]
    data = TeacherData()
    for prompt, reply in (([1, 2], [10, 11, 12]), ([3, 4], [20, 21, 22])):
        seq = torch.tensor(prompt + reply)
        data.add(seq, len(prompt) - 1, torch.zeros(len(reply), 30), 2, "gen")
    store, report = build_from_teacher_data(data, data, TableSettings("t", "f", 30), exclude_prompts=[[3, 4]])
    assert report["excluded_replies"] == 1 and report["replies"] == 1
    assert store.next_token([10]) == 11 and store.next_token([20]) is None
