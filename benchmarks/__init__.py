"""Side-by-side performance benchmarks of workbench (issues 6, 9 and 10).

    python -m benchmarks            # full mode (~10-15 min on 2 CPU cores), writes benchmarks/results.json + RESULTS.md
    python -m benchmarks --quick    # CI-sized (about 2 min on 2 cores)
    python -m benchmarks --quick --out /tmp/bench --only accounting,startup
    python -m benchmarks --render   # re-write RESULTS.md from results.json (no measuring)

Run from the repository root: opacus installs an unrelated top-level ``benchmarks`` package into site-packages.

Every comparison is a ratio of two configurations measured in the same run, interleaved (round-robin, the order
reversed on every repeat) after a warm-up, each the median of several repeats. Every process runs one intra-op
thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``).

Figures (one key each in results.json); issue 10's targets are checked in the run, the others are rows without one:

- ``dp_vs_nonprivate``    the step on every preset (default MLP, images_resnet, text_classifier, lm_lora,
                           transformer; ``benchmarks/presets.py`` builds each as ``python -m workbench`` does):
                           non-private vs ours (``grad_sample_mode=auto``) vs raw Opacus ghost clipping; throughput and
                           peak step memory. Targets: DP / non-private >= 0.75x (transformer presets), >= 0.6x
                           (ResNet-GN), >= 0.7x (MLP); memory <= 1.3x; ours >= 2x Opacus ghost.
- ``vs_opacus``            our trainer's step (Poisson sampler + loader + GradientStep + SGD) vs raw Opacus
                           ``PrivacyEngine.make_private`` (DPDataLoader Poisson sampling + DPOptimizer), MLP and CNN.
- ``distributed_scaling``  weak scaling over gloo (W=2 vs W=1, same per-rank batch) and one flattened all-reduce
                           vs one all-reduce per parameter (Opacus' distributed optimizer).
- ``scaling_vs_ddp``       W=2 weak scaling of our DP trainer on the compute-bound transformer preset beside
                           torch DDP's non-private scaling of the same model, in the same jobs; target ours / DDP >= 0.95x.
                           ``python -m benchmarks.scaling``: the same for issue 24's MiniLM encoder preset, shrunk
                           (benchmarks/SCALING_MINILM.md).
- ``accounting``           epsilon and sigma calibration for 10k / 100k Poisson steps, parallel Poisson W=2,4,8.
- ``tracking_overhead``    ``workbench.train`` on the default config, MLflow tracking on vs off; and MLflow's
                           system-metrics sampler every 1 s vs off (tracking on in both, a longer job).
- ``startup``              ``python -m workbench`` to its first training step; target <= 3 s warm.
- ``end_to_end``           the whole default job as a process vs ``benchmarks/raw_opacus_digits.py`` (raw Opacus, same
                           training); target <= 0.6x its wall time.

Quick mode is a smoke test of every figure (the test suite runs it): fewer steps and runs, the presets' batch capped
at 64, the no-target figures trimmed; its ratios are not the figures.

Accuracy figures (issue 23), separate scripts run by ``make bench`` after the above (not timings; each writes its json,
a markdown table in benchmarks/ and a picture in docs/):

    python -m benchmarks.adaptive_clipping   # fixed C vs privacy.clipping=adaptive, C 10x too small/tuned/10x too large
    python -m benchmarks.dp_adam             # optimizer=dp_adamw vs AdamW vs SGD at epsilon 1 and 8
    python -m benchmarks.bandmf --text       # privacy.mechanism=bandmf vs dpsgd at epsilon 1, 3, 8 (digits, text); the noise's cost
"""
