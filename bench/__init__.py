"""specdec benchmark: `python -m bench [--quick] [--json]`.

Runs, on one machine, with the same prompts and greedy decoding, side by side: target-only decoding
through the specdec services, Hugging Face in-process anchors (assisted generation with the same draft,
prompt lookup, plain target), specdec speculative sequential (fixed draft lengths and adaptive),
pipelined, and a concurrency sweep; reports ratios measured in the one run, compares the measured
speedups with the analytical model of Leviathan et al., and writes bench/results/quick|full/latest.{json,md,png}.
`python -m bench --serving [--quick] [--json]` is the serving benchmark instead (bench/serving.py: 1-64 streams and
Poisson arrivals against the `specdec up` stack). See docs/benchmark.md.
"""
