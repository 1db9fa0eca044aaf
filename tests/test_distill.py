"""Fast tests of the draft distillation pipeline (offline/distill/) on a tiny random teacher."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from offline import distill
from specdec.models import build_tiny


def _tiny_teacher():
    # std 0.2 gives the random teacher peaked, structured next-token distributions.
    model, tok = build_tiny("tiny:vocab=64,hidden=64,layers=2,heads=4,kv_heads=2,inter=128,std=0.2,seed=3")
    model.eval().requires_grad_(False)
    return model, tok


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(1, 64)}" for _ in range(n))


def _sources():
    rng = random.Random(0)
    texts = [_words(rng, rng.randrange(20, 60)) for _ in range(30)]
    prompts = [_words(rng, rng.randrange(3, 9)) for _ in range(24)]
    heldout = [_words(rng, rng.randrange(3, 9)) for _ in range(8)]
    return texts, prompts, heldout


def _cfg(**kw) -> distill.DistillConfig:
    base = dict(
        layers=1, hidden=32, heads=2, kv_heads=2, intermediate=64, topk=16,
        text_tokens=1024, text_seq_len=32, text_batch=8, gen_max_new=24, gen_batch=8,
        steps=60, batch_tokens=256, lr=1e-2, embed_lr_mult=1.0, time_budget_s=0.0,
        save_dtype="float32", progress=False, seed=7, pre_steps=30, pre_batch_tokens=256,
    )
    base.update(kw)
    return distill.DistillConfig(**base)


def test_distill_tiny_teacher_end_to_end(tmp_path):
    teacher, tok = _tiny_teacher()
    texts, prompts, heldout = _sources()
    cfg = _cfg()
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    cache = tmp_path / "teacher.pt"

    sources = distill.DistillSources(texts, prompts, heldout)
    student, report = distill.run_distillation(
        teacher, tok, sources, cfg, distill.DistillRun(out_dir=out_a, teacher_cache=cache, early_exit=[1],
                                                       latency=False))
    h = report["heldout"]
    assert report["data"]["train_gen_positions"] > 0 and report["data"]["train_text_positions"] > 0
    assert report["data"]["heldout_positions"] > 0 and report["data"]["train_prompt_positions"] > 0
    assert report["train"]["steps"] == cfg.steps and not report["train"]["stopped_by_time_budget"]
    # distillation reduced the held-out KL to the teacher
    assert h["kl_final"] < 0.8 * h["kl_init"], h
    assert 0.0 <= h["float32"]["acceptance_rate"] <= 1.0
    assert 0.0 <= h["float32"]["mean_accepted_len"] <= cfg.gamma
    assert "1" in report["early_exit"]
    assert len(teacher.model.layers) == 2 and teacher.config.num_hidden_layers == 2  # left untouched
    assert cache.is_file()

    # saved atomically: a complete model dir + tokenizer + report, no temp dirs left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    on_disk = json.loads((out_a / distill.REPORT_NAME).read_text())
    assert on_disk["heldout"]["kl_final"] == pytest.approx(h["kl_final"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out_a), dtype=torch.float32)
    assert loaded.config.vocab_size == 64 and loaded.config.num_hidden_layers == cfg.layers
    assert loaded.config.tie_word_embeddings
    for (name, p), (name2, q) in zip(sorted(student.state_dict().items()), sorted(loaded.state_dict().items())):
        assert name == name2 and torch.equal(p, q), name
    tok2 = transformers.AutoTokenizer.from_pretrained(str(out_a))
    assert tok2.get_vocab() == tok.get_vocab()
    # the loaded student is still better than initialisation
    held = distill.build_teacher_data(teacher, tok, cfg, texts, prompts, heldout, cache)[1]
    assert distill.mean_kl(loaded, held, 0) == pytest.approx(h["kl_final"], rel=1e-4)

    # same seed -> identical weights (teacher data recomputed without the cache)
    student_b, report_b = distill.run_distillation(teacher, tok, sources, cfg,
                                                   distill.DistillRun(out_dir=out_b, latency=False))
    sa, sb = student.state_dict(), student_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert report_b["heldout"]["kl_final"] == report["heldout"]["kl_final"]

    # overwriting an existing output dir works (rename into place)
    distill.save_atomically(student_b, tok, out_a, torch.bfloat16, {"x": 1})
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out_a))
    assert reloaded.dtype == torch.bfloat16
    assert json.loads((out_a / distill.REPORT_NAME).read_text())["x"] == 1


def test_different_seed_gives_different_student():
    teacher, tok = _tiny_teacher()
    texts, prompts, heldout = _sources()
    sources, no_latency = distill.DistillSources(texts, prompts, heldout), distill.DistillRun(latency=False)
    a, _ = distill.run_distillation(teacher, tok, sources, _cfg(steps=3, seed=1), no_latency)
    b, _ = distill.run_distillation(teacher, tok, sources, _cfg(steps=3, seed=2), no_latency)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)


def test_topk_kl_matches_full_kl_and_tail_bin():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 50, generator=g) * 2
    t = torch.randn(5, 50, generator=g) * 2
    lp = torch.log_softmax(t, -1)
    full = (lp.exp() * (lp - torch.log_softmax(s, -1))).sum(-1)
    vals, idx = lp.topk(50, -1)
    assert torch.allclose(distill.topk_kl(s, idx, vals), full, atol=1e-5)
    # truncated: KL of the (k+1)-bin coarsening, which is <= the full KL and >= 0
    vals, idx = lp.topk(8, -1)
    part = distill.topk_kl(s, idx, vals)
    assert torch.all(part <= full + 1e-5) and torch.all(part >= -1e-6)
    # zero when student == teacher
    assert torch.allclose(distill.topk_kl(t, idx, vals), torch.zeros(5), atol=1e-5)


def test_acceptance_metrics():
    m = [torch.tensor([True, True, False, True, True, True, True, True, False])]
    r = distill.acceptance_metrics(m, gamma=4)
    assert r["acceptance_rate"] == pytest.approx(7 / 9)
    # rounds: accept 2 (mismatch at 2, target fixes it) | from 3: accept 4 | from 8: accept 0
    assert r["mean_accepted_len"] == pytest.approx((2 + 4 + 0) / 3)
    # leading-run lengths capped at 4 from each start: 2,1,0,4,4,3,2,1,0
    assert r["mean_accepted_len_any_start"] == pytest.approx(17 / 9)
    assert distill.acceptance_metrics([torch.ones(8, dtype=torch.bool)], 4)["mean_accepted_len"] == pytest.approx(
        (4 + 3) / 2)
    assert distill.expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)


def test_offline_text_and_prompts(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    prose = ("This module provides a simple way to read and write configuration files that are easy "
             "for people to edit by hand, with sections and keys separated by an equals sign. ")
    for i in range(12):
        (pkg / f"mod{i}.py").write_text(
            f'"""{prose * 2}Variant {i}."""\n\n'
            f"def function_{i}(a, b):\n    total = a + b\n    total *= 2\n    return total - {i}\n"
        )
        (pkg / f"README{i}.md").write_text(f"{prose}Number {i} of the readme files.\n\n{prose * 2}")
    corpus = distill.collect_offline_text(2000, seed=0, roots=[pkg], n_passages=4, n_heldout_passages=2,
                                          progress=False)
    assert corpus.texts and sum(map(len, corpus.texts)) >= 2000
    assert corpus.code_snippets
    again = distill.collect_offline_text(2000, seed=0, roots=[pkg], n_passages=4, n_heldout_passages=2,
                                         progress=False)
    assert again.texts == corpus.texts
    train = distill.build_prompts(40, 0, corpus)
    held = distill.build_prompts(10, 0, corpus, heldout=True)
    assert len(set(train)) == 40 and len(held) == 10
    assert not set(train) & set(held)
    assert distill.build_prompts(40, 0, corpus) == train


def test_latency_of_a_prepacked_teacher_in_bfloat16():
    """distill times the teacher in bf16 on a deep copy: that must work for oneDNN-prepacked models too."""
    import torch

    from offline.distill import decode_latency_ms
    from specdec.models import load_model

    teacher = load_model("tiny:vocab=64,layers=1,hidden=64,seed=0", prepack="on", prepack_min_elements=0).model
    assert decode_latency_ms(teacher, torch.bfloat16, prompt_len=8, n_tokens=4, repeats=1) > 0
    assert decode_latency_ms(teacher, torch.float32, prompt_len=8, n_tokens=4, repeats=1) > 0
