"""Figures 1 and 2: DP vs non-private throughput and peak memory per grad_sample_mode; our trainer vs raw Opacus.

Figure 1 (``dp_vs_nonprivate``) times the *step* only: every configuration replays the same pre-drawn Poisson batches
(workbench's own sampler, expected batch 256) from an in-memory tensor, so sampling and loading are out of it.
- ``non_private``: a plain loop, ``F.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()``.
- ``gradient_step_twin``: workbench's ``GradientStep(max_grad_norm=None)`` (no clipping, no noise), for diagnosis.
- ``dp_<mode>``: workbench's ``GradientStep`` (per-sample clipping to C=1, sigma=1 noise, the flat all-reduce,
  a no-op at W=1) + divide by B + ``SGD.step()`` -- what ``workbench.trainer.Trainer.fit`` does per step.

Peak memory: the peak of bytes held by torch's CPU allocator during one step (a fixed batch of exactly 256) above
what was live before it, read from ``torch.profiler(profile_memory=True)``'s allocation trace ("Total Allocated").
It counts every tensor the step creates (activations, per-sample gradients, norms, noise, gradients); it is
deterministic, so it needs no repeats. Interpreter, library and allocator overheads (RSS) are not in it.

Figure 2 (``vs_opacus``) times the whole step *including* Poisson sampling and loading, on both sides:
- ours: ``PoissonBatchSampler`` + ``workbench.data.train_loader`` + ``GradientStep`` + SGD step;
- raw Opacus: ``PrivacyEngine().make_private(poisson_sampling=True)`` -> ``DPDataLoader`` + ``DPOptimizer``
  (plus its default accountant's per-step hook). Both load through the dataset's batched ``__getitems__``.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Settings, interleaved, median, set_threads, target, timed

MODES = ("bk", "hooks", "functorch", "ew", "ghost")  # bk: workbench's own book-keeping clipping


def modes_for(model_name: str) -> tuple[str, ...]:
    """The grad_sample_modes measured per preset: all on the MLP and CNN; on the transformer bk and its closest
    Opacus counterparts (hooks and functorch run at 0.05-0.37x there: minutes per figure for no news)."""
    return ("bk", "ew", "ghost") if model_name == "transformer" else MODES
BATCH = 256
CLIP, SIGMA, LR = 1.0, 1.0, 0.05
MODELS = {"mlp": "workbench.models.MLP(64, [128], 10)", "cnn": "workbench.models.SmallCNN(10, channels=16)",
          "transformer": "workbench.models.TinyTransformer(17, 64, d_model=64, heads=4) on digits' 64 pixels as tokens"}
# DP / non-private throughput each preset should reach (issue 10); peak step memory at most MEMORY_TARGET x.
THROUGHPUT_TARGETS = {"mlp": 0.7, "cnn": 0.6, "transformer": 0.75}
MEMORY_TARGET = 1.3
GHOST_TARGET = 2.0  # our bk step / the same step with Opacus' ghost clipping

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
warnings.filterwarnings("ignore", message=".*Optimal order is the (largest|smallest) alpha.*")


WIDE_MLP = "workbench.models.MLP(64, [1024, 1024], 10)"  # ~1.1M parameters: how the DP price shrinks with compute


def make_model(name: str) -> nn.Module:
    from workbench.models import MLP, SmallCNN, TinyTransformer

    torch.manual_seed(0)
    if name == "mlp_wide":
        return MLP(64, [1024, 1024], 10)
    if name == "transformer":
        return TinyTransformer(17, 64, d_model=64, heads=4)
    return MLP(64, [128], 10) if name == "mlp" else SmallCNN(10, channels=16)


def digits():
    from workbench.data import Digits

    return Digits("train")


def poisson_batches(n: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` Poisson batches of expected size 256, drawn by workbench's own sampler (one rank)."""
    from workbench import data

    shard = data.train_shard(n, 0, 1, "per_rank", BATCH)
    sampler = data.PoissonBatchSampler(shard, count, seed, 0)
    return [torch.as_tensor(sampler.indices_for_step(s), dtype=torch.long) for s in range(count)]


def single_process_dist():
    from workbench.distributed import Dist, JobEnv

    return Dist(JobEnv(), "gloo", torch.device("cpu"), owns_group=False)


# ------------------------------------------------------------------------------------------------ one step


def plain_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x, y, _):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def workbench_step(model: nn.Module, mode: str | None, dist=None,
                   check_on: tuple[torch.Tensor, torch.Tensor] | None = None) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """One step as ``Trainer.fit`` takes it; ``mode=None`` is GradientStep's non-private twin. ``check_on``: a few
    examples for the pre-run check, as ``workbench.run`` does (8); without it the first step checks its whole batch,
    one autograd call per example (~40 s on the transformer: only warm-ups pay it)."""
    from workbench.trainer import GradientStep

    gs = GradientStep(model, nn.CrossEntropyLoss(reduction="none"), dist or single_process_dist(),
                      max_grad_norm=None if mode is None else CLIP, noise_multiplier=SIGMA,
                      grad_sample_mode=mode or "hooks", max_physical_batch_size=512, noise_seed=0)
    if check_on is not None:
        gs.check(check_on)
    opt = torch.optim.SGD(gs.params, lr=LR)
    expected = float(BATCH * (dist.world_size if dist is not None else 1))

    def step(x, y, s):
        gs((x, y), s)
        gs.divide_(expected)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.gradient_step = gs  # type: ignore[attr-defined]
    return step


class Replay:
    """A step function fed with the pre-drawn batches, in turn; each call of ``block(n)`` runs n steps."""

    def __init__(self, step, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor]):
        self.step, self.x, self.y, self.batches, self.cursor = step, x, y, batches, 0

    def block(self, n: int) -> float:
        samples = 0
        for _ in range(n):
            idx = self.batches[self.cursor % len(self.batches)]
            self.step(self.x[idx], self.y[idx], self.cursor)
            self.cursor += 1
            samples += len(idx)
        return float(samples)


def peak_step_bytes(step: Callable[[], None]) -> int:
    """Peak bytes held by torch's CPU allocator during one call of ``step`` above what was live before it."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm: lazily created state (optimizer buffers, hooks) is not the step's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return int(max(e["args"]["Total Allocated"] for e in mem) - base)


# ------------------------------------------------------------------------------------------------ figure 1


def dp_vs_nonprivate(s: Settings, log=print) -> dict:
    set_threads()
    ds = digits()
    x, y = ds.tensors
    batches = poisson_batches(len(ds), 64)
    fixed = torch.arange(BATCH)
    out: dict = {"what": __doc__.split("\n\n")[1], "batch": BATCH, "max_grad_norm": CLIP, "noise_multiplier": SIGMA,
                 "models": {}}
    for model_name in MODELS:
        n_steps = {"mlp": s.steps, "cnn": max(5, s.steps // 2), "transformer": max(3, s.steps // 5)}[model_name]
        steps = {"non_private": plain_step(make_model(model_name)),
                 "gradient_step_twin": workbench_step(make_model(model_name), None)}
        for mode in modes_for(model_name):
            steps[f"dp_{mode}"] = workbench_step(make_model(model_name), mode)
        replays = {k: Replay(v, x, y, batches) for k, v in steps.items()}
        for r in replays.values():
            r.block(s.warmup_steps)
        rates = interleaved({k: (lambda r=r: timed(lambda: r.block(n_steps))) for k, r in replays.items()}, s.repeats)
        memory = {k: peak_step_bytes(lambda st=st: st(x[fixed], y[fixed], 0)) for k, st in steps.items()}
        base_rate, base_mem = median(rates["non_private"]), memory["non_private"]
        rows = {}
        for k in steps:
            rows[k] = {"samples_per_s": median(rates[k]), "samples_per_s_runs": rates[k],
                       "throughput_vs_non_private": median(rates[k]) / base_rate,
                       "peak_step_bytes": memory[k], "peak_memory_vs_non_private": memory[k] / base_mem}
        fastest = max(modes_for(model_name), key=lambda m: rows[f"dp_{m}"]["samples_per_s"])
        out["models"][model_name] = {"model": MODELS[model_name], "steps_per_block": n_steps, "rows": rows,
                                     "fastest_mode": fastest}
        log(f"  {model_name}: " + ", ".join(f"{k} {v['samples_per_s']:.0f}/s ({v['throughput_vs_non_private']:.2f}x, "
                                              f"mem {v['peak_memory_vs_non_private']:.2f}x)" for k, v in rows.items()))
    out["targets"] = []
    for model_name, m in out["models"].items():
        bk = m["rows"]["dp_bk"]
        out["targets"] += [
            target(f"{model_name} DP (bk)/non-private throughput", bk["throughput_vs_non_private"],
                   THROUGHPUT_TARGETS[model_name], True),
            target(f"{model_name} DP (bk) peak step memory / non-private", bk["peak_memory_vs_non_private"],
                   MEMORY_TARGET, False),
            target(f"{model_name} our bk step / the same step with Opacus ghost clipping",
                   bk["samples_per_s"] / m["rows"]["dp_ghost"]["samples_per_s"], GHOST_TARGET, True),
        ]
    # The same comparison on a wider MLP: the per-step fixed costs (hooks, norms, the noise draw) weigh less.
    wide = {"non_private": plain_step(make_model("mlp_wide")), "dp_bk": workbench_step(make_model("mlp_wide"), "bk")}
    wide_replays = {k: Replay(v, x, y, batches) for k, v in wide.items()}
    for r in wide_replays.values():
        r.block(max(2, s.warmup_steps // 4))
    wide_steps = max(5, s.steps // 4)
    wide_rates = interleaved({k: (lambda r=r: timed(lambda: r.block(wide_steps))) for k, r in wide_replays.items()},
                             s.repeats)
    out["wide_mlp"] = {"model": WIDE_MLP, "steps_per_block": wide_steps,
                       "samples_per_s": {k: median(v) for k, v in wide_rates.items()},
                       "throughput_vs_non_private": median(wide_rates["dp_bk"]) / median(wide_rates["non_private"])}
    log(f"  mlp_wide: bk/non-private {out['wide_mlp']['throughput_vs_non_private']:.2f}x")
    out["info"] = [
        {"what": "wide MLP (64-1024-1024-10) DP (bk)/non-private throughput",
         "value": out["wide_mlp"]["throughput_vs_non_private"]},
        *({"what": f"{name} fastest DP mode ({m['fastest_mode']}) / non-private throughput",
           "value": m["rows"][f"dp_{m['fastest_mode']}"]["throughput_vs_non_private"]}
          for name, m in out["models"].items()),
    ]
    return out



# ------------------------------------------------------------------------------------------------ figure 2


class OursLoop:
    """Our trainer's step with its own data path: the Poisson sampler and loader of workbench.data."""

    def __init__(self, model_name: str, mode: str, ds):
        from workbench import data

        self.step = workbench_step(make_model(model_name), mode)
        shard = data.train_shard(len(ds), 0, 1, "per_rank", BATCH)
        sampler = data.PoissonBatchSampler(shard, 10**9, seed=0, rank=0)
        cfg = SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=False,
                              dataloader_persistent_workers=False, dataloader_prefetch_factor=None)
        self.it = iter(data.train_loader(ds, sampler, cfg, torch.device("cpu")))
        self.s = 0

    def block(self, n: int) -> float:
        samples = 0
        for _ in range(n):
            batch = next(self.it)
            self.step(batch[0], batch[1], self.s)
            self.s += 1
            samples += len(batch[1])
        return float(samples)


class OpacusLoop:
    """Raw Opacus as its tutorials use it: make_private with Poisson sampling (DPDataLoader), DPOptimizer."""

    def __init__(self, model_name: str, mode: str, ds):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader

        from workbench.data import collate

        model = make_model(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # workbench's collate keeps the dataset's batched __getitems__ path: the same loading cost as ours
        loader = DataLoader(ds, batch_size=BATCH, collate_fn=collate)
        engine = PrivacyEngine()
        criterion = nn.CrossEntropyLoss()
        made = engine.make_private(module=model, optimizer=opt, data_loader=loader, criterion=criterion,
                                   noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=True,
                                   grad_sample_mode=mode)
        if mode == "ghost":
            self.model, self.opt, self.criterion, self.loader = made
        else:
            (self.model, self.opt, self.loader), self.criterion = made, criterion
        self.it = self._forever()

    def _forever(self):
        while True:
            yield from self.loader

    def block(self, n: int) -> float:
        samples = 0
        for _ in range(n):
            x, y = next(self.it)
            self.opt.zero_grad(set_to_none=True)
            loss = self.criterion(self.model(x), y)
            loss.backward()
            self.opt.step()
            samples += len(y)
        return float(samples)


def vs_opacus(s: Settings, fastest: dict[str, str] | None = None, log=print) -> dict:
    """``fastest``: per model, our fastest grad_sample_mode from figure 1 (default: bk for the MLP, hooks else).
    Opacus has no book-keeping mode: ours_bk is set beside opacus_ghost, its closest counterpart (no per-sample
    gradients materialised)."""
    set_threads()
    ds = digits()
    fastest = fastest or {"mlp": "bk", "cnn": "hooks"}
    out: dict = {"what": __doc__.split("\n\n")[3], "batch": BATCH, "max_grad_norm": CLIP, "noise_multiplier": SIGMA,
                 "models": {}}
    for model_name in ("mlp", "cnn"):  # the transformer's Opacus counterpart (ghost) is in figure 1
        n_steps = s.steps if model_name == "mlp" else max(5, s.steps // 2)
        fast = fastest.get(model_name, "hooks")
        loops = {"ours_hooks": OursLoop(model_name, "hooks", ds), "opacus_hooks": OpacusLoop(model_name, "hooks", ds)}
        counterpart = "ghost" if fast == "bk" else fast
        if fast != "hooks":
            loops[f"ours_{fast}"] = OursLoop(model_name, fast, ds)
            loops[f"opacus_{counterpart}"] = OpacusLoop(model_name, counterpart, ds)
        for lp in loops.values():
            lp.block(s.warmup_steps)
        rates = interleaved({k: (lambda lp=lp: timed(lambda: lp.block(n_steps))) for k, lp in loops.items()}, s.repeats)
        base = median(rates["opacus_hooks"])
        rows = {k: {"samples_per_s": median(v), "samples_per_s_runs": v, "vs_opacus_hooks": median(v) / base}
                for k, v in rates.items()}
        if fast != "hooks":
            rows[f"ours_{fast}"][f"vs_opacus_{counterpart}"] = \
                median(rates[f"ours_{fast}"]) / median(rates[f"opacus_{counterpart}"])
        out["models"][model_name] = {"model": MODELS[model_name], "fastest_mode": fast, "steps_per_block": n_steps,
                                     "rows": rows}
        log(f"  {model_name}: " + ", ".join(f"{k} {v['samples_per_s']:.0f}/s ({v['vs_opacus_hooks']:.2f}x)"
                                              for k, v in rows.items()))
    mlp = out["models"]["mlp"]
    out["targets"] = [
        target("MLP our trainer (hooks) / raw Opacus hooks", mlp["rows"]["ours_hooks"]["vs_opacus_hooks"], 1.5, True),
        target(f"MLP our trainer (fastest: {mlp['fastest_mode']}) / raw Opacus hooks",
               mlp["rows"][f"ours_{mlp['fastest_mode']}"]["vs_opacus_hooks"], 1.5, True),
    ]
    return out

