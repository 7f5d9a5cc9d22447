"""Figures 1 and 2: DP vs non-private throughput and peak step memory on every preset; our trainer vs raw Opacus.

Figure 1 (``dp_vs_nonprivate``) times the *step* only, on each preset of ``benchmarks.presets`` (built as
``python -m workbench`` builds it: composed config, the preset's model, criterion, data, collator and batch size).
Every configuration replays the same Poisson batches (workbench's sampler, collated by workbench's training loader,
drawn before timing), so sampling and loading are out of it.
- ``non_private``: a plain loop on the same model, ``criterion(model(batch)).mean().backward(); opt.step()``.
- ``ours``: workbench's ``GradientStep`` in ``grad_sample_mode=auto`` (its fastest mode for the model; per-sample
  clipping to C=1, sigma=1 noise, the flat all-reduce, a no-op at W=1) + divide by B + ``SGD.step()`` -- what
  ``workbench.trainer.Trainer.fit`` does per step, after the pre-run check on 8 examples as ``workbench.run`` does.
- ``opacus_ghost``: raw Opacus 1.6, ``PrivacyEngine().make_private(grad_sample_mode="ghost")`` on the same model,
  fed the same batches (its ``DPOptimizer`` adds the same sigma=1 noise, C=1), with the preset's criterion.
- ``gradient_step_twin`` (full mode): ``GradientStep(max_grad_norm=None)`` (no clipping, no noise), for diagnosis.
- ``bare_dp`` (full mode, models of Linear layers on rows: the MLP): the least a DP-SGD step can do in eager PyTorch,
  written out by hand without the floating-point bound or any check (``bare_dp_step``): the floor, for diagnosis.

Peak memory: the peak of bytes held by torch's CPU allocator during one step (a fixed batch: the preset's first
B examples) above what was live before it, read from ``torch.profiler(profile_memory=True)``'s allocation trace
("Total Allocated"). It counts every tensor the step creates (activations, per-sample gradients, norms, noise,
gradients); it is deterministic, so it needs no repeats. Interpreter, library and allocator overheads are not in it.

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
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.common import Settings, interleaved, median, set_threads, target, timed
from benchmarks.presets import PRESETS, preset

BATCH = 256  # figure 2's batch (digits)
CLIP, SIGMA, LR = 1.0, 1.0, 0.05
FIGURE_PRESETS = ("mlp", "images_resnet", "text_classifier", "lm_lora", "transformer", "gpt", "vit")
# DP / non-private throughput each preset should reach (issue 10: tiny transformer presets 0.75x, ResNet-GN 0.6x,
# default MLP 0.7x; issue 21: the tutorial-style gpt and vit 0.6x); peak step memory at most MEMORY_TARGET x
# non-private; ours at least GHOST_TARGET x Opacus ghost.
THROUGHPUT_TARGETS = {"mlp": 0.7, "images_resnet": 0.6, "text_classifier": 0.75, "lm_lora": 0.75, "transformer": 0.75,
                      "gpt": 0.6, "vit": 0.6}
MEMORY_TARGET = 1.3
GHOST_TARGET = 2.0
# Steps per timed block, relative to Settings.steps: a preset's step costs 1 ms (MLP) to ~0.5 s (ResNet, one thread).
STEP_SHARE = {"mlp": 1.0, "images_resnet": 0.05, "text_classifier": 0.25, "lm_lora": 0.25, "transformer": 0.1,
              "gpt": 0.05, "vit": 0.1}

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
warnings.filterwarnings("ignore", message=".*Optimal order is the (largest|smallest) alpha.*")


def make_model(name: str) -> nn.Module:
    """A fresh model of preset ``name`` (benchmarks.presets), as the preset builds it."""
    return preset(name).model()


def fastest_mode(name: str) -> str:
    """What ``grad_sample_mode=auto`` picks for preset ``name``'s model."""
    from workbench.privacy.clipping import fastest_grad_sample_mode

    return fastest_grad_sample_mode(make_model(name))


def digits():
    from workbench.data import Digits

    return Digits("train")


def single_process_dist():
    from workbench.distributed import Dist, JobEnv

    return Dist(JobEnv(), "gloo", torch.device("cpu"), owns_group=False)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------------ one step
# A step is called as step(batch, step_index) with a collated batch ((x, y), (x1, ..., y) or a mapping).


def plain_step(model: nn.Module, criterion: nn.Module | None = None) -> Callable[[Any, int], None]:
    """The non-private step a user writes: the mean of the per-example losses, backward, SGD step."""
    from workbench.data import as_batch
    from workbench.losses import logits_of

    criterion = criterion or nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(_trainable(model), lr=LR)

    def step(raw, _):
        batch = as_batch(raw)
        criterion(logits_of(batch.forward(model)), batch.labels).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def workbench_step(model: nn.Module, mode: str | None, dist=None, check_on: Any = None,
                   criterion: nn.Module | None = None, expected_batch: int = BATCH,
                   max_physical_batch_size: int | str = 512) -> Callable[[Any, int], None]:
    """One step as ``Trainer.fit`` takes it; ``mode=None`` is GradientStep's non-private twin. ``check_on``: a few
    examples for the pre-run check, as ``workbench.run`` does (8); without it the first step checks 8 of its own."""
    from workbench.step import GradientStep

    gs = GradientStep(model, criterion or nn.CrossEntropyLoss(reduction="none"), dist or single_process_dist(),
                      max_grad_norm=None if mode is None else CLIP, noise_multiplier=SIGMA,
                      grad_sample_mode=mode or "hooks", max_physical_batch_size=max_physical_batch_size,
                      noise_seed=0, expected_batch=expected_batch)
    if check_on is not None:
        gs.check(check_on)
        gs.size_micro_batches(check_on)  # max_physical_batch_size=auto: as workbench.job does after the check
    opt = torch.optim.SGD(gs.params, lr=LR)
    expected = float(expected_batch * (dist.world_size if dist is not None else 1))

    def step(batch, s):
        gs(batch, s)
        gs.divide_(expected)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.gradient_step = gs  # type: ignore[attr-defined]
    return step


def opacus_ghost_step(model: nn.Module, criterion: nn.Module, population: int, batch: int) -> Callable[[Any, int], None]:
    """Raw Opacus' ghost clipping on ``model``: make_private (expected batch ``batch`` of ``population``) + its
    DPOptimizer, fed our replayed batches. Raises what Opacus raises where it cannot run the model."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from workbench.data import as_batch
    from workbench.losses import logits_of

    opt = torch.optim.SGD(_trainable(model), lr=LR)
    loader = DataLoader(range(population), batch_size=batch)  # sets Opacus' expected batch; never iterated
    model, opt, criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=criterion, noise_multiplier=SIGMA,
        max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode="ghost")

    def step(raw, _):
        b = as_batch(raw)
        opt.zero_grad(set_to_none=True)
        criterion(logits_of(b.forward(model)), b.labels).backward()
        opt.step()

    return step


def bare_dp_step(model: nn.Module, criterion: nn.Module, expected_batch: int) -> Callable[[Any, int], None]:
    """The least a DP-SGD step of a model made of nn.Linear layers on (batch, features) rows can do in eager PyTorch,
    written out by hand: the layers' inputs captured by forward hooks, one backward to their outputs, each example's
    squared norm (||a_i||^2 + 1) ||g_i||^2 summed over layers, min(1, C / norm) factors, the clipped sums as one addmm
    and one addmv per layer, sigma C Gaussian noise from a per-step generator, divided by B, SGD. No floating-point
    margins, checks, micro-batches or accounting: not private as written (its rounding is not bounded), only the floor
    that shows how much of ``ours``' gap to the plain loop is that extra work. Raises on any other model."""
    from workbench.data import as_batch
    from workbench.losses import logits_of

    params = _trainable(model)
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    if not all(type(m) is nn.Linear and m.bias is not None for m in layers):
        raise TypeError("the bare step takes nn.Linear layers with biases only")
    flat = torch.zeros(sum(p.numel() for p in params))
    views, start = {}, 0
    for p in params:
        views[p] = flat[start:start + p.numel()].view(p.shape)
        start += p.numel()
    opt = torch.optim.SGD(params, lr=LR)
    noise = torch.empty_like(flat)

    def step(raw, s):
        b, seen = as_batch(raw), []
        flat.zero_()
        hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0].detach(), out))) for m in layers]
        try:
            losses = criterion(logits_of(b.forward(model)), b.labels)
        finally:
            for h in hooks:
                h.remove()
        grads = torch.autograd.grad(losses.sum(), [out for _, _, out in seen])
        n2 = sum(torch.linalg.vecdot(a, a).add_(1.0).mul_(torch.linalg.vecdot(g, g)) for (_, a, _), g in zip(seen, grads))
        factor = n2.rsqrt_().mul_(CLIP).clamp_(max=1.0)
        for (m, a, _), g in zip(seen, grads):
            views[m.weight].addmm_(g.t(), a * factor.unsqueeze(1))
            views[m.bias].addmv_(g.t(), factor)
        gen = torch.Generator().manual_seed(s)
        flat.add_(torch.randn(flat.numel(), generator=gen, out=noise).mul_(SIGMA * CLIP)).div_(expected_batch)
        for p in params:
            p.grad = views[p]
        opt.step()

    return step


class Replay:
    """A step function fed with pre-drawn, collated batches, in turn; each call of ``block(n)`` runs n steps."""

    def __init__(self, step, batches: list):
        from workbench.data import as_batch

        self.step, self.batches, self.cursor = step, batches, 0
        self.sizes = [0 if b is None else len(as_batch(b)) for b in batches]

    def block(self, n: int) -> float:
        samples = 0
        for _ in range(n):
            i = self.cursor % len(self.batches)
            self.step(self.batches[i], self.cursor)
            self.cursor += 1
            samples += self.sizes[i]
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


def _preset_steps(p, s: Settings) -> dict[str, Any]:
    """The figure's configurations of preset ``p``, each on its own fresh copy of the model (same weights); a
    configuration that cannot be built is a string saying why."""
    as_run = dict(criterion=p.criterion(reduction="none"), expected_batch=p.batch_size,
                  max_physical_batch_size=p.cfg.max_physical_batch_size)
    steps: dict[str, Any] = {"non_private": plain_step(p.model(), p.criterion(reduction="none"))}
    if s.mode == "full":
        steps["gradient_step_twin"] = workbench_step(p.model(), None, **as_run)
        try:
            steps["bare_dp"] = bare_dp_step(p.model(), p.criterion(reduction="none"), p.batch_size)
        except TypeError:
            pass  # a model with other layers: no hand-written floor for it
    steps["ours"] = workbench_step(p.model(), "auto", check_on=p.first_examples(8), **as_run)
    try:
        steps["opacus_ghost"] = opacus_ghost_step(p.model(), p.criterion(), len(p.dataset), p.batch_size)
    except Exception as e:  # noqa: BLE001 - said in the table: which preset Opacus cannot run, and why
        steps["opacus_ghost"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return steps


def dp_vs_nonprivate(s: Settings, log=print, only: tuple[str, ...] = FIGURE_PRESETS) -> dict:
    set_threads()
    out: dict = {"what": __doc__.split("\n\n")[1], "max_grad_norm": CLIP, "noise_multiplier": SIGMA, "presets": {}}
    for name in only:
        p = preset(name, s.max_batch)
        n_steps = max(1, round(s.steps * STEP_SHARE[name]))
        steps = _preset_steps(p, s)
        batches, fixed = p.poisson_batches(16), p.first_examples(p.batch_size)
        replays = {}
        for k, st in steps.items():
            if not callable(st):
                continue
            replays[k] = Replay(st, batches)
            try:  # Opacus failing on a real batch (not at construction) cannot run the preset either: said, not fatal
                replays[k].block(max(1, round(s.warmup_steps * STEP_SHARE[name])))
            except Exception as e:  # noqa: BLE001
                if k != "opacus_ghost":
                    raise
                steps[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                del replays[k]
        rates = interleaved({k: (lambda r=r: timed(lambda: r.block(n_steps))) for k, r in replays.items()},
                            s.repeats)
        memory = {k: peak_step_bytes(lambda st=steps[k]: st(fixed, 0)) for k in replays}
        base_rate, base_mem = median(rates["non_private"]), memory["non_private"]
        rows = {}
        for k in replays:
            rows[k] = {"samples_per_s": median(rates[k]), "samples_per_s_runs": rates[k],
                       "throughput_vs_non_private": median(rates[k]) / base_rate,
                       "peak_step_bytes": memory[k], "peak_memory_vs_non_private": memory[k] / base_mem}
        mode = steps["ours"].gradient_step.mode
        entry = {"what": p.what, "overrides": PRESETS[name][0], "batch": p.batch_size,
                 "preset_batch": preset(name).batch_size,
                 "population": len(p.dataset), "grad_sample_mode": mode, "steps_per_block": n_steps,
                 "trainable_parameters": sum(x.numel() for x in steps["ours"].gradient_step.params), "rows": rows}
        if "opacus_ghost" in rows:
            rows["ours"]["vs_opacus_ghost"] = rows["ours"]["samples_per_s"] / rows["opacus_ghost"]["samples_per_s"]
        else:
            entry["opacus_ghost_refused"] = steps["opacus_ghost"]
        out["presets"][name] = entry
        log(f"  {name} (ours: {mode}): " + ", ".join(
            f"{k} {v['samples_per_s']:.0f}/s ({v['throughput_vs_non_private']:.2f}x, mem "
            f"{v['peak_memory_vs_non_private']:.2f}x)" for k, v in rows.items())
            + (f"; Opacus ghost cannot run it: {entry['opacus_ghost_refused']}" if "opacus_ghost" not in rows else ""))
    out["targets"], out["info"] = [], []
    for name, e in out["presets"].items():
        ours, mode = e["rows"]["ours"], e["grad_sample_mode"]
        out["targets"] += [
            target(f"{name}: DP ({mode}) / non-private throughput", ours["throughput_vs_non_private"],
                   THROUGHPUT_TARGETS[name], True),
            target(f"{name}: DP ({mode}) / non-private peak step memory", ours["peak_memory_vs_non_private"],
                   MEMORY_TARGET, False)]
        if "vs_opacus_ghost" in ours:
            out["targets"].append(target(f"{name}: ours ({mode}) / Opacus ghost throughput", ours["vs_opacus_ghost"],
                                         GHOST_TARGET, True))
    return out


# ------------------------------------------------------------------------------------------------ figure 2


class OursLoop:
    """Our trainer's step with its own data path: the Poisson sampler and loader of workbench.data."""

    def __init__(self, model_name: str, mode: str, ds):
        from workbench import data
        from workbench.privacy import sampling

        self.step = workbench_step(make_model(model_name), mode, check_on=data.first_examples(ds, 8))
        shard = sampling.train_shard(len(ds), 0, 1, "per_rank", BATCH)
        sampler = sampling.PoissonBatchSampler(shard, 10**9, seed=0, rank=0)
        cfg = SimpleNamespace(dataloader_num_workers=0, dataloader_pin_memory=False,
                              dataloader_persistent_workers=False, dataloader_prefetch_factor=None)
        self.it = iter(data.train_loader(ds, sampler, cfg, torch.device("cpu")))
        self.s = 0

    def block(self, n: int) -> float:
        samples = 0
        for _ in range(n):
            batch = next(self.it)
            self.step(batch, self.s)
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


def vs_opacus(s: Settings, log=print) -> dict:
    """Per model (the default MLP and the SmallCNN on digits), our trainer in hooks mode and in its fastest mode (what
    ``auto`` picks) beside raw Opacus in the same mode. Opacus has no book-keeping mode: ours_bk is set beside
    opacus_ghost, its closest counterpart (no per-sample gradients materialised)."""
    set_threads()
    ds = digits()
    out: dict = {"what": __doc__.split("\n\n")[3], "batch": BATCH, "max_grad_norm": CLIP, "noise_multiplier": SIGMA,
                 "models": {}}
    for model_name in ("mlp", "cnn"):  # the transformer's Opacus counterpart (ghost) is in figure 1
        n_steps = s.steps if model_name == "mlp" else max(5, s.steps // 2)
        fast = fastest_mode(model_name)
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
        out["models"][model_name] = {"model": PRESETS[model_name][1], "fastest_mode": fast, "steps_per_block": n_steps,
                                     "rows": rows}
        log(f"  {model_name}: " + ", ".join(f"{k} {v['samples_per_s']:.0f}/s ({v['vs_opacus_hooks']:.2f}x)"
                                              for k, v in rows.items()))
    out["targets"] = []  # issue 6's 1.5x raw Opacus hooks is no one's target now; issue 10's ghost one is figure 1's
    out["info"] = [{"what": f"{name} our trainer ({row[5:]}) / raw Opacus hooks, sampling and loading included",
                    "value": v["vs_opacus_hooks"]}
                   for name, m in out["models"].items() for row, v in m["rows"].items() if row.startswith("ours_")]
    return out

