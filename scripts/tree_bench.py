"""Tree vs chain speculation at equal draft budget (tree node budget = chain length), in-process services.

    .venv/bin/python scripts/tree_bench.py --target tiny --budgets 4,8
    .venv/bin/python scripts/tree_bench.py --target smollm2 --draft layers:4 --budgets 4,8 --max-new 48

Real gRPC services on loopback (target, one model draft, orchestrator with an in-memory session store), one
process, the same prompts for every configuration, configurations interleaved prompt by prompt. Reports
the mean accepted length (tokens committed per verify step) and tokens/s (client-side wall time).
``--draft layers:N`` uses the target's first N decoder layers (+ its final norm and head) as the draft;
otherwise ``--draft`` is a model spec for specdec.models.load_model (default: smollm2-draft when cached).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time

import torch

TINY_TARGET = "tiny:vocab=64,layers=2,hidden=64,seed=0,std=0.3"
TINY_DRAFT = "tiny:vocab=64,layers=1,hidden=64,seed=0,std=0.3"  # the target's first layer


def truncated(loaded, layers: int):
    """The target's first `layers` decoder layers as a draft (shares nothing; a deep copy, then truncated)."""
    m = copy.deepcopy(loaded.model)
    m.model.layers = m.model.layers[:layers]
    m.config.num_hidden_layers = layers
    if hasattr(m.config, "layer_types") and m.config.layer_types:
        m.config.layer_types = m.config.layer_types[:layers]
    return dataclasses.replace(loaded, model=m, name=f"{loaded.name}[:{layers} layers]")


def load_pair(target_spec: str, draft_spec: str | None):
    from specdec.models import load_model, models_dir

    target_spec = TINY_TARGET if target_spec == "tiny" else target_spec
    target = load_model(target_spec, device="cpu", dtype="float32")
    if draft_spec is None:
        if target_spec == TINY_TARGET:
            draft_spec = TINY_DRAFT
        elif (models_dir() / "smollm2-draft" / "config.json").is_file():
            draft_spec = "smollm2-draft"
        else:
            draft_spec = "layers:4"
    if draft_spec.startswith("layers:"):
        draft = truncated(target, int(draft_spec.split(":", 1)[1]))
    else:
        draft = load_model(draft_spec, device="cpu", dtype="float32")
    return target, draft


def start(target, draft, cfg):
    from draft_service.proposers.model import ModelProposer
    from draft_service.server import build_server as build_draft_server
    from orchestrator.replicas.clients import TargetClient
    from orchestrator.replicas.draft_pool import DraftPool
    from orchestrator.api.server import Connections, OrchestratorServicer
    from orchestrator.settings import OrchestratorSettings, ServerSettings
    from orchestrator.api.server import build_server as build_orchestrator_server
    from orchestrator.store.session_store import open_store
    from specdec.client import SpecdecClient
    from specdec.core.kv_cache import SessionCacheStore
    from specdec.v1 import common_pb2
    from target_service.engines.torch import TargetEngine
    from target_service.server import build_server as build_target_server

    engine = TargetEngine(target, SessionCacheStore(), max_draft_len=64)
    tsrv = build_target_server(engine, "127.0.0.1:0").start()
    info = common_pb2.ModelInfo(model_name=draft.name, vocab_size=draft.vocab_size,
                                tokenizer_fingerprint=draft.fingerprint, max_context=draft.max_context,
                                eos_token_ids=draft.eos_token_ids, strategy="model")
    dsrv = build_draft_server(ModelProposer(draft, SessionCacheStore()), info, "127.0.0.1:0", max_draft_len=64)
    dsrv.start()
    tc = TargetClient(tsrv.address)
    servicer = OrchestratorServicer(OrchestratorSettings(ServerSettings(max_new_tokens_limit=4096), cfg),
                                    Connections(tc, DraftPool([dsrv.address]), open_store("memory"), target.tokenizer,
                                                tc.info()))
    osrv = build_orchestrator_server(servicer, "127.0.0.1:0").start()
    client = SpecdecClient(osrv.address, timeout_s=600)

    def stop():
        client.close()
        servicer.pool.close()
        for s in (osrv, dsrv, tsrv):
            s.stop(0)

    return servicer, client, stop


def prompts_for(target, n: int) -> list[list[int]]:
    if target.name == TINY_TARGET:
        return [[1, 5, 9, 12, 5, 9], [7, 7, 7, 30, 31, 32, 7, 7], list(range(1, 40, 3)), [2, 3, 5, 8, 13, 21],
                [60, 1, 60, 2, 60, 3], [11, 22, 33, 44]][:n]
    from specdec.eval_prompts import encode, select

    return [encode(p, target.tokenizer, chat=True) for p in select(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny", help="'tiny' or a model spec (e.g. smollm2)")
    p.add_argument("--draft", default=None, help="model spec or layers:N (default: see module doc)")
    p.add_argument("--budgets", default="4,8", help="chain lengths = tree node budgets")
    p.add_argument("--trees", default="2:0.75,3:0.5",
                   help="tree shapes to try, comma-separated branch:branch_below")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    from orchestrator.settings import LoopConfig

    target, draft = load_pair(a.target, a.draft)
    base = LoopConfig(max_draft_len=64, draft_timeout_floor_ms=60000, draft_first_call_timeout_ms=60000,
                      target_timeout_s=600)
    servicer, client, stop = start(target, draft, base)
    prompts = prompts_for(target, a.prompts)
    configs = []
    for b in [int(x) for x in a.budgets.split(",")]:
        configs.append((f"chain k={b}", dataclasses.replace(base, default_draft_len=b), b))
        for shape in a.trees.split(","):
            br, below = shape.split(":")
            configs.append((f"tree n={b} branch={br} below={below}",
                            dataclasses.replace(base, tree_budget=b, tree_branch=int(br),
                                                tree_branch_below=float(below)), b))
    configs.insert(0, ("target-only", base, 0))
    acc = {name: dict(tokens=0, wall=0.0, steps=0, accepted=0, proposed=0, outputs=[]) for name, _, _ in configs}
    try:
        # warm-up (first calls allocate)
        servicer.cfg = configs[1][1]
        client.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            for name, cfg, b in configs:
                servicer.cfg = cfg
                kw = dict(max_new_tokens=a.max_new, ignore_eos=True, temperature=a.temperature, seed=a.seed + i)
                t0 = time.perf_counter()
                if b == 0:
                    r = client.generate(prompt, speculation=False, **kw)
                else:
                    r = client.generate(prompt, max_draft_len=b if cfg.tree_budget == 0 else 0, **kw)
                dt = time.perf_counter() - t0
                s = acc[name]
                s["tokens"] += len(r.token_ids)
                s["wall"] += dt
                s["steps"] += r.stats["verify_steps"]
                s["accepted"] += r.stats["draft_tokens_accepted"]
                s["proposed"] += r.stats["draft_tokens_proposed"]
                s["outputs"].append(r.token_ids)
                print(f"  prompt {i} {name}: {len(r.token_ids)} tokens in {dt:.2f}s", file=sys.stderr)
    finally:
        stop()
    ref = acc["target-only"]["outputs"]
    rows = []
    for name, cfg, b in configs:
        s = acc[name]
        rows.append(dict(config=name, budget=b, tokens=s["tokens"], wall_s=round(s["wall"], 3),
                         tokens_per_s=round(s["tokens"] / s["wall"], 2),
                         mean_accepted_length=round((s["accepted"] + s["steps"]) / s["steps"], 3) if s["steps"] else None,
                         acceptance_per_node=round(s["accepted"] / s["proposed"], 3) if s["proposed"] else None,
                         identical_to_target_only=(s["outputs"] == ref) if a.temperature == 0 else None))
    print(f"target {target.name}, draft {draft.name}, {len(prompts)} prompts x {a.max_new} tokens, "
          f"temperature {a.temperature}, torch threads {a.threads}")
    print("| config | mean accepted length | tokens/s | accepted per drafted node | greedy == target-only |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['mean_accepted_length'] or '-'} | {r['tokens_per_s']} | "
              f"{r['acceptance_per_node'] if r['acceptance_per_node'] is not None else '-'} | "
              f"{'-' if r['identical_to_target_only'] is None else r['identical_to_target_only']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(target=target.name, draft=draft.name, args=vars(a), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
