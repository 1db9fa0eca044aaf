#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run of under 8 minutes (each step has its own time limit):
#   1. greedy output of the target on CUDA identical to the CPU's (float32, 4 bench prompts x 32 tokens);
#   2. `python -m bench --quick` with the target and the draft services on CUDA (it checks every speculative
#      configuration token for token against specdec target-only on the same card);
#   3. absolute tokens/s from that run: specdec target-only, HF generate target-only and HF assisted generation
#      on the same card (in-process), specdec speculative (the headline configuration).
# Without a CUDA device it stops at once with exit status 3 and says so. Needs the project's virtual environment
# (.venv, as scripts/bootstrap.sh makes it, or SPECDEC_PYTHON=/path/to/python) with the model already cached:
# the lent machine reaches no network. Results: $OUT (default /tmp/specdec-gpu-check): identity.json, bench/,
# summary.json.
#
#   bash scripts/gpu_check.sh
#   DRAFT_STRATEGY=ngram bash scripts/gpu_check.sh     # when no distilled draft model is cached
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${SPECDEC_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-/tmp/specdec-gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

# 0. A CUDA device, seen by torch (not only by the driver).
if ! cuda=$(timeout 120 "$PY" -c 'import torch, sys
ok = torch.cuda.is_available()
print(torch.cuda.get_device_name(0) if ok else f"torch {torch.__version__}, cuda build {torch.version.cuda}")
sys.exit(0 if ok else 3)' 2>&1); then
  fail "no CUDA device: torch.cuda.is_available() is False ($(echo "$cuda" | tail -1)); this script needs a machine with an NVIDIA GPU" 3
fi
echo "== CUDA device: $cuda"

# 1. CUDA greedy == CPU greedy, target only, float32 on both.
echo "== 1. greedy output on CUDA against the CPU (4 prompts x 32 tokens, float32)"
timeout 240 "$PY" - "$OUT/identity.json" <<'EOF' || fail "CUDA greedy output differs from the CPU's (or the check failed): see above"
import json, sys

from bench.hf import hf_generate
from specdec.eval_prompts import encode, select
from specdec.models import load_model

models = {d: load_model("smollm2", device=d, dtype="float32") for d in ("cpu", "cuda")}
tok = models["cpu"].tokenizer
rows, same = [], True
for p in select(4):
    ids = encode(p, tok, chat=True)
    out = {}
    for d, m in models.items():
        pad = m.model.generation_config.pad_token_id
        out[d] = hf_generate(m.model, ids, 32, m.eos_token_ids, pad if pad is not None else m.eos_token_ids[0]).tokens
    first_diff = next((i for i, (a, b) in enumerate(zip(out["cpu"], out["cuda"])) if a != b), None)
    ok = out["cpu"] == out["cuda"]
    same = same and ok
    rows.append({"prompt": p.name, "identical": ok, "first_difference_at": first_diff, "cpu": out["cpu"],
                 "cuda": out["cuda"]})
    print(f"  {p.name}: {'identical' if ok else f'DIFFERENT from token {first_diff}'} ({len(out['cpu'])} tokens)")
json.dump({"identical": same, "prompts": rows}, open(sys.argv[1], "w"), indent=2)
sys.exit(0 if same else 1)
EOF

# 2. The quick benchmark with the services on CUDA (and the HF anchors on the same card).
echo "== 2. python -m bench --quick on CUDA"
timeout 360 "$PY" -m bench --quick --json --no-progress --device cuda --hf-target-only \
  --draft-strategy "${DRAFT_STRATEGY:-auto}" --pin-cpus off --out-dir "$OUT/bench" > "$OUT/bench.json" \
  || fail "python -m bench --quick --device cuda failed (service logs: its --log-dir, or the temp dir it names)"

# 3. Absolute tokens/s on this card, and the output check of every speculative configuration.
echo "== 3. tokens/s on $cuda"
"$PY" - "$OUT/bench.json" "$OUT/summary.json" "$cuda" <<'EOF' || fail "speculative output differed from target-only on CUDA"
import json, sys

res = json.load(open(sys.argv[1]))
by = {c["name"]: c for c in res["configs"] if c.get("kind") != "sessions"}
tps = lambda n: by.get(n, {}).get("tokens_per_s") if by.get(n, {}).get("available") else None  # noqa: E731
summary = {"device": sys.argv[3], "draft": res["draft"]["strategy"],
           "specdec_target_only": tps("specdec-target-only"), "hf_target_only": tps("hf-target-only"),
           "hf_assisted": tps("hf-assisted"), "hf_prompt_lookup": tps("hf-prompt-lookup"),
           "specdec_speculative": res["tokens_per_s"], "specdec_config": res["headline_config"],
           "speedup_vs_target_only": res["speedup_vs_target_only"],
           "speedup_vs_hf_assisted": res["speedup_vs_hf_assisted"]}
mismatch = [c["name"] for c in by.values() if c.get("available") and c.get("output_matches_target_only") not in (None, 1.0)]
summary["outputs_identical_to_target_only"] = not mismatch
for k, v in summary.items():
    print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")
json.dump(summary, open(sys.argv[2], "w"), indent=2)
if mismatch:
    print("  speculative output differs from target-only in:", ", ".join(mismatch))
sys.exit(1 if mismatch else 0)
EOF
echo "gpu_check: passed ($OUT)"
