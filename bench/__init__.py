"""specdec benchmark: `python -m bench [--quick] [--json]`.

Runs, on one machine, with the same prompts and greedy decoding, side by side: target-only decoding
through the specdec services, Hugging Face in-process anchors (assisted generation with the same draft,
prompt lookup, plain target), specdec speculative sequential (fixed draft lengths and adaptive),
pipelined, and a concurrency sweep; reports ratios measured in the one run, compares the measured
speedups with the analytical model of Leviathan et al., and writes bench/results/quick|full/latest.{json,md,png}.
`python -m bench --serving [--quick] [--json]` is the serving benchmark instead (bench/serving.py: 1-64 streams and
Poisson arrivals against the `specdec up` stack). See docs/benchmark.md.

A run's path through the modules: runner (flags, and the run's phases over a run_state.BenchRun), configs (the
configurations), measure (step costs, one generation, a sessions level), summary (a row per configuration and
sessions level, the targets and why each was met or missed), result (the JSON dict), report (its markdown and
plot); machine says which CPU ran it. The serving benchmark: serving, serving_metrics, serving_report, with
request_loops' closed loop shared with llama_server.
"""
