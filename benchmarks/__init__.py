"""Side-by-side performance benchmarks of workbench (issue 6).

    python -m benchmarks            # full mode (~10-15 min on 2 CPU cores), writes benchmarks/results.json + RESULTS.md
    python -m benchmarks --quick    # CI-sized (well under 3 min on 2 cores)
    python -m benchmarks --quick --out /tmp/bench --only accounting,startup
    python -m benchmarks --render   # re-write RESULTS.md from results.json (no measuring)
    python -m benchmarks.candidates [--quick]   # candidate fixes for workbench vs the current code, printed

Run from the repository root: opacus installs an unrelated top-level ``benchmarks`` package into site-packages.

Every comparison is a ratio of two configurations measured in the same run, interleaved (round-robin, the order
reversed on every repeat) after a warm-up, each the median of several repeats. Every process runs one intra-op
thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``).

Figures (one key each in results.json):

- ``dp_vs_nonprivate``    DP (workbench GradientStep + SGD step) vs a plain ``loss.backward()`` loop, every
                           ``grad_sample_mode``, on the default MLP and SmallCNN; throughput and peak step memory.
- ``vs_opacus``            our trainer's step (Poisson sampler + loader + GradientStep + SGD) vs raw Opacus
                           ``PrivacyEngine.make_private`` (DPDataLoader Poisson sampling + DPOptimizer).
- ``distributed_scaling``  weak scaling over gloo (W=2 vs W=1, same per-rank batch) and one flattened all-reduce
                           vs one all-reduce per parameter (Opacus' distributed optimizer).
- ``scaling_vs_ddp``       W=2 weak scaling of our DP trainer on the compute-bound transformer preset beside
                           torch DDP's non-private scaling of the same model, in the same jobs; ours / DDP.
- ``accounting``           epsilon and sigma calibration for 10k / 100k Poisson steps, parallel Poisson W=2,4,8.
- ``tracking_overhead``    ``workbench.train`` on the default config, MLflow tracking on vs off.
- ``startup``              ``python -m workbench`` to its first training step.
"""
