"""
The benchmark suite: the paper's claims measured side by side with their baselines.

    python -m flashrt_ros.bench [--quick] [--only fig1,fig3] [--model ...] [--device ...]
    python -m flashrt_ros.bench.measure         restore vs copy, decode, TTFT at a glance
    python -m flashrt_ros.bench.measure_policy  policy mode: control step, restore, cold path
    python -m flashrt_ros.bench.restore_floor   how low a full restore can go behind Python
    bash flashrt_ros/bench/run_gpu.sh           set-up and the suite on an NVIDIA GPU
    bash flashrt_ros/bench/gpu_probe.sh         the first GPU run: environment, CUDA tests,
                                                figures (no network, no ROS; --dry-run: CPU)
    python -m flashrt_ros.bench.gpu_env         torch, device capability, kernels, SDPA

Results go to build/bench-results. See docs/benchmarks.md for what each figure measures
and the latest results.
"""
