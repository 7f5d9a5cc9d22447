"""Figure 3: weak scaling over gloo on CPU, and one flattened all-reduce vs one all-reduce per parameter.

Weak scaling: ``workbench.launch_distributed`` starts W local processes (one thread each) that join a gloo group
through ``workbench.distributed.setup``; each rank samples its ``shard=per_rank`` shard with workbench's Poisson
sampler at the same expected *per-rank* batch (256) and takes ``GradientStep`` + SGD steps (the flat all-reduce of
the step is real at W=2, skipped at W=1). Per-rank throughput = that rank's realised samples / wall time of the
block, averaged over ranks. W=1 and W=2 jobs alternate, and inside a job the configurations are interleaved.
Each rank also records its CPU time / wall time over the timed blocks ("CPU share"): with W=2 on a 2-core machine
shared with other work, a share well below 1 means the rank waited (for a core, or for its peer in the all-reduce).

All-reduce cost (W=2): the same gradient, either as workbench sends it (one ``all_reduce`` of one flat buffer of
numel+2 floats: gradients, loss sum, count) or as Opacus' ``DistributedDPOptimizer`` does (one ``all_reduce`` per
parameter's ``.grad``); and, for the latency floor, an all-reduce of 1,000 floats (gloo on loopback costs about
the same from ~100 to ~10,000 floats; a single float takes a cheaper path). Each timed block is preceded
by a barrier; the median per-step cost is reported.
"""

from __future__ import annotations

import functools
import time

from benchmarks.common import Settings, interleaved, median, target

BATCH = 256
SMALL = 1000  # floats in the latency-floor all-reduce


def _worker(configs: list[tuple[str, str]], steps: int, warmup: int, repeats: int, allreduce_iters: int) -> dict:
    """One rank of a W-process job (runs in a spawned process)."""
    import torch
    import torch.distributed as tdist

    from benchmarks.throughput import make_model, workbench_step
    from workbench import data, distributed
    from workbench.data import Digits

    torch.set_num_threads(1)
    d = distributed.setup("gloo")
    try:
        ds = Digits("train")
        x, y = ds.tensors
        shard = data.train_shard(len(ds), d.rank, d.world_size, "per_rank", BATCH)
        sampler = data.PoissonBatchSampler(shard, 64, seed=0, rank=d.rank)
        batches = [torch.as_tensor(sampler.indices_for_step(s), dtype=torch.long) for s in range(64)]

        class Runner:
            def __init__(self, model_name, mode):
                self.step, self.cursor, self.cpu_share = workbench_step(make_model(model_name), mode, d), 0, []

            def block(self, n):
                d.barrier()
                t, c = time.perf_counter(), time.process_time()
                samples = 0
                for _ in range(n):
                    idx = batches[self.cursor % len(batches)]
                    self.step(x[idx], y[idx], self.cursor)
                    self.cursor += 1
                    samples += len(idx)
                wall = time.perf_counter() - t
                self.cpu_share.append((time.process_time() - c) / wall)
                return float(samples), wall

        runners = {f"{m}/{mode}": Runner(m, mode) for m, mode in configs}
        for r in runners.values():
            r.block(warmup)
        n_steps = {m: steps if m == "mlp" else max(5, steps // 2) for m, _ in configs}
        rates = interleaved({k: (lambda r=r, k=k: r.block(n_steps[k.split("/")[0]])) for k, r in runners.items()},
                            repeats)
        out = {"rank": d.rank, "world_size": d.world_size, "rates": rates, "allreduce": {},
               "cpu_share": {k: r.cpu_share[1:] for k, r in runners.items()}}  # [0] is the warm-up

        if d.world_size > 1:
            for model_name in sorted({m for m, _ in configs}):
                params = [p for p in make_model(model_name).parameters() if p.requires_grad]
                numel = sum(p.numel() for p in params)
                tensors = {"flat": [torch.zeros(numel + 2)],  # workbench: one buffer per step
                           "per_parameter": [torch.zeros_like(p) for p in params],  # Opacus: one per .grad
                           "small": [torch.zeros(SMALL)]}  # the latency floor

                def block(n=allreduce_iters, *, xs):
                    d.barrier()
                    t = time.perf_counter()
                    for _ in range(n):
                        for x in xs:
                            tdist.all_reduce(x)
                    return float(n), time.perf_counter() - t

                blocks = {k: functools.partial(block, xs=xs) for k, xs in tensors.items()}
                for b in blocks.values():
                    b(max(10, allreduce_iters // 10))
                ops = interleaved(blocks, repeats)
                out["allreduce"][model_name] = {"numel": numel, "tensors": len(params),
                                                "ops_per_s": ops}
        return out
    finally:
        distributed.teardown(d)


def distributed_scaling(s: Settings, fastest: dict[str, str] | None = None, log=print) -> dict:
    from workbench import launch_distributed

    fastest = fastest or {"mlp": "bk", "cnn": "hooks"}
    configs: list[tuple[str, str]] = []
    for model_name in ("mlp", "cnn"):
        for mode in dict.fromkeys(("hooks", fastest.get(model_name, "hooks"))):
            configs.append((model_name, mode))
    steps = s.steps
    results: dict[int, list[list[dict]]] = {1: [], 2: []}
    t0 = time.perf_counter()
    for i in range(s.scaling_launches):
        for w in ((1, 2) if i % 2 == 0 else (2, 1)):
            results[w].append(launch_distributed(_worker, w, configs, steps, s.warmup_steps, s.repeats,
                                                 s.allreduce_iters, timeout=900))
    wall = time.perf_counter() - t0

    rows = {}
    for model_name, mode in configs:
        key = f"{model_name}/{mode}"
        per_w = {}
        for w, jobs in results.items():
            # per job and repeat: the mean over ranks of per-rank throughput
            runs = [sum(rank["rates"][key][r] for rank in job) / w for job in jobs for r in range(s.repeats)]
            per_w[w] = runs
        rows[key] = {"model": model_name, "grad_sample_mode": mode,
                     "per_rank_samples_per_s_w1": median(per_w[1]), "per_rank_samples_per_s_w2": median(per_w[2]),
                     "runs_w1": per_w[1], "runs_w2": per_w[2],
                     "w2_vs_w1_per_rank": median(per_w[2]) / median(per_w[1]),
                     # CPU time / wall time of a rank during its timed blocks: how much of a core it got and used
                     "cpu_share_w1": median([c for job in results[1] for rank in job for c in rank["cpu_share"][key]]),
                     "cpu_share_w2": median([c for job in results[2] for rank in job for c in rank["cpu_share"][key]])}
    allreduce = {}
    for model_name in sorted({m for m, _ in configs}):
        per = {"flat": [], "per_parameter": [], "small": []}
        for job in results[2]:
            for rank in job:
                for k in per:
                    per[k] += rank["allreduce"][model_name]["ops_per_s"][k]
        info = results[2][0][0]["allreduce"][model_name]
        flat_us, pp_us, floor_us = (1e6 / median(per[k]) for k in ("flat", "per_parameter", "small"))
        allreduce[model_name] = {"numel": info["numel"], "tensors": info["tensors"], "flat_us_per_step": flat_us,
                                 "per_parameter_us_per_step": pp_us, "per_parameter_vs_flat": pp_us / flat_us,
                                 "latency_floor_us": floor_us}
    log("  " + ", ".join(f"{k} W2/W1 {v['w2_vs_w1_per_rank']:.2f} (CPU share per rank {v['cpu_share_w1']:.2f} -> "
                         f"{v['cpu_share_w2']:.2f})" for k, v in rows.items()))
    log("  " + ", ".join(f"{k}: flat {v['flat_us_per_step']:.0f} us, per-parameter {v['per_parameter_us_per_step']:.0f} us, "
                         f"1,000 floats {v['latency_floor_us']:.0f} us"
                         for k, v in allreduce.items()))
    mlp_fast = f"mlp/{fastest.get('mlp', 'hooks')}"
    return {
        "what": __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[2],
        "backend": "gloo", "per_rank_batch": BATCH, "shard": "per_rank", "steps_per_block": steps,
        "launches_per_world_size": s.scaling_launches, "wall_s": wall, "rows": rows, "allreduce": allreduce,
        "targets": [target(f"MLP W=2 / W=1 per-rank throughput ({mlp_fast.split('/')[1]})",
                           rows[mlp_fast]["w2_vs_w1_per_rank"], 0.85, True)],
        "info": [{"what": f"{k} W=2 / W=1 per-rank throughput", "value": v["w2_vs_w1_per_rank"]}
                 for k, v in rows.items() if k != mlp_fast]
                + [{"what": f"{k}: per-parameter all-reduce time / one flat all-reduce (W=2, {v['tensors']} tensors)",
                    "value": v["per_parameter_vs_flat"]} for k, v in allreduce.items()],
    }
