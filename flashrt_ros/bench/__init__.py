"""
The benchmark suite: the paper's claims measured side by side with their baselines.

    python -m flashrt_ros.bench [--quick] [--only fig1,fig3] [--model ...] [--device ...]

See docs/benchmarks.md for what each figure measures and the latest results.
"""
