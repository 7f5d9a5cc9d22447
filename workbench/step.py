"""One logical step of DP-SGD on one rank (the privacy contract of docs/DESIGN.md, steps 1-3).

Every logical step, on every rank, whatever its Poisson batch (even empty):
  1. per-sample gradients of the local batch, in physical micro-batches of at most ``max_physical_batch_size``
     (``auto``: the size is found, never the batch changed: see GradientStep._restart);
  2. flat per-sample L2 clipping to C (workbench/privacy/clipping/), summed locally into one flat buffer;
  3. Gaussian noise of std sigma*C added by rank 0 alone (workbench/privacy/noise.py), then one all-reduce of that
     buffer, so the noise is in the sum exactly once.
With adaptive clipping (workbench/privacy/clipping/adaptive.py) C is the schedule's C_t, the buffer has one more slot,
the shifted count of examples not scaled down, noised by rank 0 in the same place and reduced by the same all-reduce;
the schedule then moves C from that released count, alike on every rank.
Step 4, the division by the expected global batch B and the optimizer step, is the loop's (workbench/trainer.py).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

from workbench.data.batches import Batch, as_batch
from workbench import model_checks
from workbench.distributed import Dist
from workbench.errors import WorkbenchError
from workbench.models.losses import logits_of
from workbench.privacy import clipping
from workbench.privacy.clipping.adaptive import AdaptiveClip, FixedClip
from workbench.privacy.clipping.opacus_modes import EW_MIXED_PRECISION
from workbench.privacy.noise import CountNoise, GaussianNoise

# Opacus' hooks trigger this on every backward of a model whose inputs need no grad: expected, not actionable.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")

CHECK_EXAMPLES = 8  # examples the pre-run check compares against autograd's per-example gradients
FP16_LOSS_SCALE = 2.0 ** 10  # fp16_loss_scale's default (workbench/config.py)

MEMORY_SHARE = 0.25  # max_physical_batch_size=auto on CPU: the default budget, this share of available memory
MATERIALISED = ("hooks", "functorch", "ew", "vmap")  # modes that hold every example's gradient of every parameter


def auto_start(expected_batch: int) -> int:
    """Where max_physical_batch_size=auto starts (public: the margins of clipping/bound.py are computed for it): twice
    the expected per-rank batch rounded up to a power of two, so a Poisson batch above its mean rarely splits."""
    return 1 << max(0, math.ceil(math.log2(max(1, 2 * expected_batch))))


def available_mib() -> float:
    """Memory this process may still take (psutil when installed, else the OS's count of free pages), in MiB."""
    try:
        import psutil

        return psutil.virtual_memory().available / 2**20
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20


class GradientStep:
    """Steps 1-3 of the contract: the noised, all-reduced sum of clipped per-sample gradients for one logical step.

    With ``max_grad_norm=None`` it is the non-private twin: plain summed gradients, no clipping, no noise, through the
    same single all-reduce, so both paths are measured alike.

    ``clip_schedule``: C's schedule (None: fixed ``max_grad_norm``); with an adaptive one, ``noise_multiplier`` is
    the gradient's raised sigma_g (Mechanism.gradient_noise_multiplier) and the schedule's sigma_b noises the count.

    ``noise``: the mechanism's noise maker (Mechanism.noise: called with the flat update's numel, the rank, the
    device, the noise seed and the dtype): the plan hands the step its noise (bandmf's and blt's correlated across
    steps, workbench/privacy/correlated.py), drawn and added at the same place; None: DP-SGD's independent Gaussian
    noise of ``noise_multiplier`` (a step built without a plan).
    """

    def __init__(self, model: nn.Module, criterion: nn.Module, dist: Dist, *, max_grad_norm: float | None,
                 noise_multiplier: float, grad_sample_mode: str = "hooks", max_physical_batch_size: int = 512,
                 noise_seed: int = 0, autocast_dtype: torch.dtype | None = None, loss_scale: float | None = None,
                 clip_schedule: FixedClip | AdaptiveClip | None = None,
                 noise: Callable[..., Any] | None = None, expected_batch: int = 256,
                 physical_batch_memory: float | None = None):
        self.dist, self.criterion, self.autocast_dtype = dist, criterion, autocast_dtype
        # fp16's narrow range needs the loss scaled (bf16 has float32's exponent range and needs none); see _losses
        self.scale = float(loss_scale if loss_scale is not None else
                           FP16_LOSS_SCALE if autocast_dtype == torch.float16 else 1.0)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise WorkbenchError(f"the loss scale must be a finite number > 0, got {loss_scale}")
        self.clip, self.sigma, self.mode = max_grad_norm, noise_multiplier, grad_sample_mode
        # auto: start at a public size (CPU: the pre-run probe lowers it to the memory budget, see size_micro_batches;
        # CUDA: an out-of-memory error halves it, see _restart). The clip margins stay those of the start.
        self.auto = max_physical_batch_size == "auto"
        if not self.auto and not (isinstance(max_physical_batch_size, int) and max_physical_batch_size >= 1):
            raise WorkbenchError(f"max_physical_batch_size must be an integer >= 1 or auto, got {max_physical_batch_size!r}")
        self.max_physical_batch_size = auto_start(expected_batch) if self.auto else max_physical_batch_size
        self.bound_batch = self.max_physical_batch_size  # the clipper's public max_batch (clipping/base.py)
        self.physical_batch_memory = physical_batch_memory
        self.private = max_grad_norm is not None
        self.clip_schedule = (clip_schedule or FixedClip(max_grad_norm)) if self.private else None
        adaptive = self.private and self.clip_schedule.adaptive
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._frozen = [p for p in model.parameters() if not p.requires_grad]  # both fixed here: see _changed
        if not self.params:
            raise WorkbenchError("the model has no trainable parameters")
        if len({p.dtype for p in self.params}) > 1:
            raise WorkbenchError(f"the model's trainable parameters mix dtypes {sorted({str(p.dtype) for p in self.params})}; "
                                 "one flat gradient buffer needs one")
        if self.private and self.params[0].dtype not in (torch.float32, torch.float64):
            # the per-example bound and the clipped sum, noise and count are float32 computations (DESIGN.md): in bf16
            # each addition rounds by 2^-9 of the total, and one example could move it by more than C
            raise WorkbenchError(f"the model's trainable parameters are {self.params[0].dtype}: DP-SGD needs float32 "
                                 "(or float64) weights; load the model in float32 and set bf16=true (or fp16=true) to "
                                 "compute in low precision")
        self.model = model
        # auto: the fastest mode whose pre-run check passes (check() moves down this list); mode_note says which
        self.candidates = clipping.candidate_modes(model, autocast_dtype is not None) \
            if self.private and self.mode == "auto" else []
        self.skipped: list[tuple[str, str, str | None]] = []  # (mode, why auto skipped it, the module to blame)
        for mode, reason in clipping.ruled_out(model, autocast_dtype is not None) if self.candidates else []:
            self._skip(mode, reason)
        self.mode_note = ""
        self._make(self.candidates[0] if self.candidates else self.mode)
        if self.private and autocast_dtype is not None and self.mode == "ew":
            raise WorkbenchError(EW_MIXED_PRECISION)
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        if autocast_dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise WorkbenchError(f"bf16=true: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16=true")
        # Gradient sum, then [loss sum, example count] and, adaptive, the shifted clipped count: one collective.
        self.flat = torch.zeros(numel + 2 + adaptive, device=device, dtype=self.params[0].dtype)
        self.grad_views, offset = [], 0
        for p in self.params:
            self.grad_views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.view_of = {id(p): view for p, view in zip(self.params, self.grad_views)}
        self.numel, self.on_cpu = numel, device.type == "cpu"
        self.loss_sum, self.count = self.flat[numel], self.flat[numel + 1]  # 0-d views: cheaper to add to
        self._update, self._totals = self.flat[:numel], self.flat[numel:]  # views made once, not per step
        make_noise = noise or (lambda n, rank, dev, seed, dtype: GaussianNoise(noise_multiplier, max_grad_norm, n, rank,
                                                                               dev, seed))
        self.noise = make_noise(numel, dist.rank, device, noise_seed, self.flat.dtype) if self.private else None
        self.unclipped = self.flat[numel + 2] if adaptive else None  # sum of 1[not scaled down] - 1/2, then noised
        self.count_noise = CountNoise(self.clip_schedule.count_noise, dist.rank, noise_seed) if adaptive else None

    def _make(self, mode: str) -> None:
        """The strategy for ``mode``. With auto, a mode whose wrapper cannot be built for this model (Opacus refusing
        it in its own words) is skipped for the next, as a failed pre-run check is."""
        self._drop_clipper()
        self.mode = mode
        try:
            self.clipper = clipping.make(self.model, self.params, max_grad_norm=self.clip, mode=mode)
        except Exception as e:  # noqa: BLE001 - any failure of a candidate's wrapper: the next candidate may fit
            later = self._later()
            if not later or isinstance(e, WorkbenchError):
                raise
            self._skip(mode, model_checks.one_line(e))
            return self._make(later[0])
        self.clipper.max_batch = self.bound_batch
        self.module = self.clipper.module

    def _drop_clipper(self) -> None:
        old, self.clipper = getattr(self, "clipper", None), None
        if old is not None and old.module is not self.model and hasattr(old.module, "_close"):
            old.module._close()  # an Opacus wrapper skipped by auto: its hooks must not stay on the model

    def _later(self) -> list[str]:
        """auto: the candidates after the current mode (none when the mode was named)."""
        return self.candidates[self.candidates.index(self.mode) + 1:] if self.mode in self.candidates else []

    def _skip(self, mode: str, reason: str, why: str | None = None) -> None:
        self.skipped.append((mode, reason if len(reason) <= 200 else reason[:200].rsplit(" ", 1)[0] + " ...", why))

    def _check(self, batch: Batch) -> None:
        """The strategy's pre-run check. With auto, a mode that fails it is skipped for the next (the reason kept for
        mode_note); any other refusal names the module to blame when one can be found (workbench/model_checks.py)."""
        while True:
            try:
                self.clipper.check(batch, self._precise_losses)
                break
            except WorkbenchError as e:
                if not self.private or not str(e).startswith(f"grad_sample_mode={self.mode}"):
                    raise  # not the mode's (the criterion, the model's own forward): no other mode helps
                why = model_checks.explain_not_own(self.model, lambda b: b.forward(self.model), batch)
                later = self._later()
                if not later and self.candidates:  # auto: the module to blame, found by any mode's failure
                    why = why or next((w for _, w, found in self.skipped if found), None)
                    why = why and why.replace(model_checks.AUTO_FIX, "")  # auto tried them all: not a fix here
                    raise WorkbenchError(f"grad_sample_mode=auto found no mode that clips this model exactly: {why}"
                                         if why else str(e)) from e
                if not later:  # the generic verdict replaced by the module to blame, when one was found
                    raise WorkbenchError(f"grad_sample_mode={self.mode}: {why}" if why and "is not its own" in str(e)
                                         else str(e)) from e
                reason = (why or str(e).removeprefix(f"grad_sample_mode={self.mode}").lstrip(" :")).split(";")[0]
                self._skip(self.mode, reason, why)
                self._make(later[0])
            except Exception as e:  # noqa: BLE001 - a mode's own machinery failing on this model (auto: the next)
                if not self.candidates:
                    raise  # a mode the user named: its own error, as it came
                later, mode = self._later(), self.mode
                self._drop_clipper()
                if model_checks.fails_alone(lambda: self._precise_losses(self.model, batch), self.params):
                    raise  # the model's or the data's failure, not the mode's: no other mode helps
                self._skip(mode, model_checks.one_line(e))
                if not later:
                    raise WorkbenchError("grad_sample_mode=auto found no mode that clips this model exactly: " + "; ".join(
                        f"{m}: {reason}" for m, reason, _ in self.skipped)) from e
                self._make(later[0])
        if self.candidates:
            self.mode_note = clipping.auto_note(self.mode, [(m, reason) for m, reason, _ in self.skipped])

    @property
    def noise_seed(self) -> int:
        return self.noise.seed if self.noise is not None else 0

    @noise_seed.setter
    def noise_seed(self, seed: int) -> None:
        """The secret noise seed, known only once the run's secret is (a resumed run takes its checkpoint's)."""
        if self.noise is not None:
            self.noise.seed = seed
        if self.count_noise is not None:
            self.count_noise.seed = seed

    @property
    def clip_norm(self) -> float | None:
        """C for the next step (C_t of the adaptive schedule, released); None for the non-private twin."""
        return self.clip_schedule.value if self.private else None

    def check(self, batch: Any) -> None:
        """Before any training, on a real batch: the criterion gives one loss per example, and the strategy's
        assumptions about the model hold (book-keeping's cannot all be read off the layers). Run in the parameters'
        precision: the checks compare against autograd there."""
        self._check(self._to_device(batch))

    def _forward(self, module: nn.Module, batch: Batch) -> Any:
        # Opacus' ew wrapper reads the batch size off a positional input (the pre-run check also calls the bare model)
        if self.private and self.mode == "ew" and module is self.module:
            from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

            module = call_for_per_sample_grads(module._module, batch_size=len(batch), loss_reduction="sum")
        return batch.forward(module)

    def _precise_losses(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """The loss function the clipping strategies call: forward ``module`` on the micro-batch, one loss per example."""
        losses = self.criterion(logits_of(self._forward(module, batch)), batch.labels)
        if losses.dim() != 1 or len(losses) != len(batch):
            raise WorkbenchError(f"the criterion must return one loss per example (reduction='none'), not shape "
                                 f"{tuple(losses.shape)} for a batch of {len(batch)}")
        return losses if losses.dtype is torch.float32 else losses.float()

    def _losses(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """As _precise_losses, under autocast with bf16/fp16 (norms and clipping stay float32: clipping/), times the
        loss scale S (fp16: ``fp16_loss_scale``; 1 otherwise), so that small gradients survive the fp16 backward.

        Inside the contract: clipping to C*S and noise of std sigma*C*S, divided by S, give DP-SGD's own update (every
        clip factor is unchanged). S is fixed, not dynamic as torch's GradScaler: an example whose backward overflows
        contributes 0 (clipping/base.py), so the released update stays finite and no overflow is ever seen to adapt
        to, nor may it be (whether one occurred depends on one example's data). Per-example losses are summed, not
        averaged over the batch: the gradient at the logits reaches S itself, hence 2**10 and not GradScaler's 2**16."""
        if self.autocast_dtype is None:  # entering a disabled autocast still costs more than the MLP's loss
            losses = self._precise_losses(module, batch)
        else:
            with torch.autocast(self.flat.device.type, dtype=self.autocast_dtype):
                losses = self._precise_losses(module, batch)
        return losses if self.scale == 1.0 else losses * self.scale

    def _to_device(self, batch: Any) -> Batch:
        batch = as_batch(batch)
        return batch if self.on_cpu and batch.on_cpu() else batch.to(self.flat.device, non_blocking=True)

    def _micro_batches(self, batch: Batch):
        if len(batch) <= self.max_physical_batch_size:  # at most one micro-batch: the batch itself, no slicing
            if len(batch):  # an empty draw has none (the step still adds noise and joins the all-reduce)
                yield batch
            return
        for start in range(0, len(batch), self.max_physical_batch_size):
            yield batch.slice(start, start + self.max_physical_batch_size)

    def __call__(self, batch: Any, step: int) -> tuple[float, float]:
        """Fill each parameter's .grad with the noised clipped sum; return the cluster-wide (loss sum, example count)."""
        if not all(p.requires_grad for p in self.params) or any(p.requires_grad for p in self._frozen):
            raise WorkbenchError(self._changed())
        self.flat.zero_()
        for p in self.params:  # a .grad left from outside (no zero_grad) must not leak unclipped into the backward modes
            p.grad = None
        scale = self.scale
        if self.private:
            clip = self.clip_schedule.value  # C, or adaptive clipping's C_t
            self.clipper.clip = clip * scale  # scaled losses, scaled bound: every clip factor is unchanged
            self.clipper.unclipped = self.unclipped  # where the clipper counts (None: fixed C, nothing counted)
            self.noise.clip = clip
        if batch is not None:  # 1-2: per-sample gradients, clipped and summed into the flat buffer
            batch = self._to_device(batch)
            while not self._accumulate(batch, scale):  # auto: out of memory, restarted at half the size
                pass
        if self.noise is not None:  # 3: rank 0's noise (privacy/noise.py), every step, whatever the batch
            self.noise.add_(self._update, step, scale)
        if self.count_noise is not None:  # and the clipped count's, in the same buffer
            self.count_noise.add_(self.unclipped, step)
        self.dist.all_reduce_(self.flat)
        for p, view in zip(self.params, self.grad_views):
            p.grad = view  # a view into the reduced buffer: no copy; the next step re-zeroes the buffer
        loss_sum, count, *released = self._totals.tolist()  # one host read for all
        if released:  # the noised count, identical on every rank: so is the next C
            self.clip_schedule.update(released[0])
        return loss_sum, count

    def _changed(self) -> str:  # the buffer, noise and optimizer cover what was trainable when the step was built
        name, p = next((n, p) for n, p in self.model.named_parameters() if p.requires_grad == any(p is q for q in self._frozen))
        return (f"parameter {name!r} was {'unfrozen' if p.requires_grad else 'frozen'} after the DP step was built (a frozen "
                "one would still be noised and stepped, an unfrozen one never trained): set requires_grad before training starts")

    def _accumulate(self, batch: Batch, scale: float) -> bool:
        """Steps 1-2 for the whole local batch; False when auto ran out of memory (the step restarts, see _restart)."""
        try:
            for i, micro_batch in enumerate(self._micro_batches(batch)):
                if self.fault is not None:
                    self.fault(i, len(micro_batch))
                if getattr(self.clipper, "checked", True) is False:  # normally check() ran before training
                    # on a few examples, as run.py does: the check is one autograd call per example
                    self._check(micro_batch.slice(0, CHECK_EXAMPLES))
                losses = self.clipper.accumulate(micro_batch, self._losses, self.view_of)
                self.loss_sum.add_(losses.sum() if scale == 1.0 else losses.sum() / scale)
                self.count.add_(len(losses))
        except torch.cuda.OutOfMemoryError:
            if not self.auto:
                raise
            self._restart()
            return False
        return True

    fault: Callable[[int, int], None] | None = None  # tests: called with each micro-batch's index and size before it
    # runs, to raise an out-of-memory error where a GPU would

    def _restart(self) -> None:
        """max_physical_batch_size=auto after an out-of-memory error: the same drawn batch again, at half the size.
        Everything this step accumulated goes (clipped sums, loss sum, count, adaptive clipping's count: all in the
        flat buffer; per-sample gradients and Opacus' kept activations), so no example is counted twice; the noise is
        drawn after, once, from the step's own stream position. The clip margins keep the start's public size, so the
        update never depends on when (on which realised batch) memory ran out."""
        self.flat.zero_()
        for p in self.params:
            p.grad = None
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None
        self._drop_kept_inputs()
        if self.flat.device.type == "cuda":
            torch.cuda.empty_cache()
        size = self.max_physical_batch_size
        if size <= 1:
            raise WorkbenchError("max_physical_batch_size=auto: one example does not fit in memory (out of memory at a "
                                 "micro-batch of 1); use a smaller model, shorter inputs or bf16=true")
        self.max_physical_batch_size = size // 2
        if self.dist.is_main:  # console only: when memory ran out depends on a realised (private) batch size
            print(f"max_physical_batch_size=auto: out of memory at {size} examples per micro-batch; now "
                  f"{size // 2}", flush=True)

    def _drop_kept_inputs(self) -> None:
        """Forget forwards never backpropagated: Opacus' hooks keep each forward's inputs and count the forwards per
        parameter until the backward (a stale count would change how the next per-sample gradients are summed)."""
        for m in self.model.modules():
            if isinstance(getattr(m, "activations", None), list):
                m.activations = []
        for p in self.params:
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0

    def size_micro_batches(self, batch: Any) -> None:
        """max_physical_batch_size=auto on CPU, before training, on the pre-run check's examples: the largest
        micro-batch whose estimated memory fits ``physical_batch_memory`` MiB (default: MEMORY_SHARE of available
        memory), at most the public start. One example's cost: the tensors its forward saves for the backward (counted
        twice: the backward holds their gradients too), plus, in modes that form them, its per-sample gradients."""
        if not self.auto or self.flat.device.type == "cuda":
            return
        batch = self._to_device(batch)
        budget = self.physical_batch_memory if self.physical_batch_memory is not None else \
            MEMORY_SHARE * available_mib()
        per_example = self.example_bytes(batch) / 2**20
        size = min(self.max_physical_batch_size, math.floor(budget / per_example)) if per_example > 0 else \
            self.max_physical_batch_size
        if size < 1:
            raise WorkbenchError(f"max_physical_batch_size=auto: one example needs about {per_example:.1f} MiB, "
                                 f"more than physical_batch_memory={budget:.1f} MiB")
        self.max_physical_batch_size = self.bound_batch = self.clipper.max_batch = size

    def example_bytes(self, batch: Batch) -> float:
        """Estimated bytes one example of ``batch`` holds during its step (see size_micro_batches)."""
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a wrapper)
                return t
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        was_training = self.model.training
        self.model.train()
        try:  # the global RNG as it was (dropout): training draws what it would have drawn without the probe
            with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._losses(self.model, batch)
        finally:
            self.model.train(was_training)
            self._drop_kept_inputs()
        per_sample = self.numel * self.flat.element_size() if self.private and self.mode in MATERIALISED else 0
        return 2 * sum(saved.values()) / max(len(batch), 1) + per_sample

    def divide_(self, expected_batch: float) -> None:
        """Step 4's division of every gradient by the expected batch B (and the loss scale S), in one operation on the
        reduced buffer."""
        self._update.div_(expected_batch * self.scale)
        # the std of this step's noise in each coordinate of the update (for DP-AdamBC, workbench/optim.py): public
        self.released_noise_std = self.noise.sigma * self.noise.clip / expected_batch if self.noise is not None else 0.0

    @property
    def update(self) -> torch.Tensor:
        """The step's released update (noised, all-reduced), as a flat view."""
        return self._update
