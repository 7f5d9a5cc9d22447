"""Models as tutorials write them, with parameters used outside a layer and broadcast over the batch (learned
positions looked up with ids shared by the batch, cls tokens, position tables, layer-scale gammas, ReZero alphas):
every example's clipped gradient is its own, against the float64 per-example loop; ``auto`` picks the fastest mode
whose pre-run check passes and says why the faster ones were skipped."""

import pytest
import torch
from torch import nn

from tests.oracle import CLIPPED_RTOL, clipped_sum, rows
from workbench.distributed import setup
from workbench.errors import WorkbenchError
from workbench.step import GradientStep

CLIP = 0.3


class SharedPositions(nn.Module):
    """GPT-2 style: positions looked up with torch.arange(T), the same ids for every example."""

    def __init__(self, t=6, d=8):
        super().__init__()
        self.t = t
        self.fc, self.pos, self.head = nn.Linear(4, d), nn.Embedding(t, d), nn.Linear(d, 3)

    def forward(self, x):
        h = self.fc(x.view(len(x), self.t, 4)) + self.pos(torch.arange(self.t, device=x.device))
        return self.head(torch.tanh(h).mean(1))


class TinyViT(nn.Module):
    """Patch conv, a cls token and a position table as raw parameters, one LayerNorm, a head on the cls token."""

    def __init__(self, d=8):
        super().__init__()
        self.patch = nn.Conv2d(1, d, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos = nn.Parameter(torch.randn(1, 5, d) * 0.5)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        p = self.patch(x.view(len(x), 1, 4, 4)).flatten(2).transpose(1, 2)  # (B, 4, d)
        h = torch.cat([self.cls.expand(len(x), -1, -1), p], 1) + self.pos
        h = self.norm(h + torch.tanh(h).mean(1, keepdim=True))
        return self.head(h[:, 0])


class LayerScaleReZero(nn.Module):
    """A layer-scale gamma (a vector) and a ReZero alpha (a scalar), each multiplying a residual branch."""

    def __init__(self, d=8):
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(16, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.gamma = nn.Parameter(torch.full((d,), 0.5))
        self.alpha = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = self.inp(x.view(len(x), -1))
        h = h + self.gamma * torch.tanh(self.mlp(h))
        h = h + self.alpha * torch.sin(h)
        return self.head(h)


class ReZeroSequence(nn.Module):
    """A ReZero alpha on a sequence branch: (B, T, d) activations, so its copies must be (B, 1, 1)."""

    def __init__(self, d=8):
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(4, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.alpha = nn.Parameter(torch.tensor(0.6))

    def forward(self, x):
        h = self.inp(x.view(len(x), 4, 4))
        return self.head((h + self.alpha * torch.tanh(self.mlp(h))).mean(1))


class LayerScaleSequence(nn.Module):
    """LLaMA's and timm's habits on (B, T, d) activations: an RMSNorm written by hand (its weight (d,)) and a
    LayerScale module (gamma (d,)): copies (B, 1, d). T = 8, the check's batch size, so that copies (B, d) would
    still broadcast, wrongly, on the check's batch: the check must not take them."""

    class LayerScale(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.gamma = nn.Parameter(torch.full((d,), 0.3))

        def forward(self, x):
            return x * self.gamma

    def __init__(self, d=6):
        super().__init__()
        self.inp, self.mlp, self.head = nn.Linear(3, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.norm_weight, self.ls = nn.Parameter(torch.full((d,), 1.2)), self.LayerScale(d)

    def forward(self, x):
        h = self.inp(x.view(len(x), 8, 3))
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return self.head((h + self.ls(torch.tanh(self.mlp(n)))).mean(1))


class ConvNeXtGamma(nn.Module):
    """A ConvNeXt block: depthwise conv, channels-last LayerNorm and MLP, a gamma (d,) on (B, H, W, d): copies
    (B, 1, 1, d)."""

    def __init__(self, d=4):
        super().__init__()
        self.stem, self.dw = nn.Conv2d(1, d, 2, stride=2), nn.Conv2d(d, d, 3, padding=1, groups=d)
        self.norm, self.pw, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, 3)
        self.gamma = nn.Parameter(torch.full((d,), 0.4))

    def forward(self, x):
        h = self.stem(x.view(len(x), 1, 4, 4))
        b = self.gamma * self.pw(torch.tanh(self.norm(self.dw(h).permute(0, 2, 3, 1))))
        return self.head((h + b.permute(0, 3, 1, 2)).mean((2, 3)))


class WithDropout(SharedPositions):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return super().forward(self.drop(x))


MODELS = {"shared_positions": SharedPositions, "vit": TinyViT, "layer_scale_rezero": LayerScaleReZero,
          "rezero_sequence": ReZeroSequence, "layer_scale_sequence": LayerScaleSequence, "convnext_gamma": ConvNeXtGamma}


def _clipped_sum_loop(make, x, y, clip):
    """The definition in float64: each example's own gradient, clipped to C, summed."""
    model = make().double()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i:i + 1].double()), y[i:i + 1])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += min(1.0, clip / (norm + 1e-6)) * g
    return total


def _made(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


def _step(model, mode, physical=5):
    return GradientStep(model, nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=CLIP,
                        noise_multiplier=0.0, grad_sample_mode=mode, max_physical_batch_size=physical)


def _data(n=11):
    torch.manual_seed(1)
    return torch.randn(n, 24) * 2, torch.randint(0, 3, (n,))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["auto", "vmap"])
def test_broadcast_parameters_get_each_examples_own_clipped_gradient(name, mode):
    make = _made(MODELS[name])
    x, y = _data()
    if name not in ("shared_positions", "layer_scale_sequence"):
        x = x[:, :16]
    step = _step(make(), mode)
    step.check((x[:8], y[:8]))
    if mode == "auto":  # bk expands shared ids and raw parameters per example; ReZero's scalar alpha to (B, 1), the
        # shape its check finds (as (B,) it would be read per feature, not per example: the float64 loop below tells)
        assert step.mode == "bk", step.mode_note
    step((x, y), step=0)  # 11 examples in micro-batches of 5: 5, 5, 1
    expected = _clipped_sum_loop(make, x, y, CLIP)
    for p, e in zip(step.params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


class SummedPositions(SharedPositions):
    """The position rows summed over positions, (d,), then broadcast: expanding the ids per example would change it."""

    def forward(self, x):
        h = self.fc(x.view(len(x), self.t, 4)) + self.pos(torch.arange(self.t, device=x.device)).sum(0)
        return self.head(torch.tanh(h).mean(1))


def test_auto_picks_the_fastest_mode_whose_check_passes_and_says_why_faster_ones_were_skipped():
    x, y = _data(8)
    shared = _step(SharedPositions(), "auto")  # ids shared by the batch: bk expands them, its check passes
    shared.check((x, y))
    assert shared.mode == "bk" and shared.mode_note == "grad_sample_mode=auto: bk"
    step = _step(SummedPositions(), "auto")
    assert step.mode == "bk"  # what the layers allow: bk has a rule for each
    step.check((x, y))
    assert step.mode == "vmap"
    note = step.mode_note
    assert note.startswith("grad_sample_mode=auto: vmap (bk, ew, hooks skipped: model.pos (Embedding) is called on "
                           "an input of shape (6,) that has no batch dimension") and "\n" not in note
    plain = _step(nn.Sequential(nn.Linear(24, 3)), "auto")
    plain.check((x, y))
    assert plain.mode == "bk" and plain.mode_note == "grad_sample_mode=auto: bk"


def test_auto_falls_back_on_the_first_step_when_no_check_ran_before_training():
    for cls, mode in ((SharedPositions, "bk"), (SummedPositions, "vmap")):
        make = _made(cls)
        x, y = _data()
        step = _step(make(), "auto")
        step((x, y), step=0)
        assert step.mode == mode
        for p, e in zip(step.params, _clipped_sum_loop(make, x, y, CLIP)):
            torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


def test_vmap_draws_dropout_per_example_and_its_check_passes():
    step = _step(WithDropout(), "vmap")
    x, y = _data(8)
    step.check((x, y))
    torch.manual_seed(0)
    step((x, y), step=0)
    with_dropout = torch.cat([p.grad.flatten() for p in step.params]).clone()
    step.model.drop.p = 0.0
    step((x, y), step=0)
    assert not torch.allclose(with_dropout, torch.cat([p.grad.flatten() for p in step.params]))


def test_vmap_contributions_never_exceed_the_bound():
    """Each example's contribution as summed has norm <= C (1 + 2^-20): one example per step, huge gradients."""
    from workbench.privacy.clipping.bound import RHO

    torch.manual_seed(0)
    model = TinyViT()
    step = _step(model, "vmap")
    x, y = _data(6)
    for i in range(6):
        step((x[i:i + 1, :16] * 1e4, y[i:i + 1]), step=0)
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in step.params))
        assert float(norm) <= CLIP * (1 + RHO)


def test_a_model_no_mode_can_clip_is_refused_by_auto_with_the_module_to_blame():
    class Center(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    model = nn.Sequential(nn.Linear(24, 8), Center(), nn.Linear(8, 3))
    step = _step(model, "auto")
    x, y = _data(8)
    with pytest.raises(WorkbenchError, match=r"^grad_sample_mode=auto found no mode that clips this model exactly: the model mixes "
                                          r"examples in model\.1 \(Center\)"):
        step.check((x, y))


class MinGPT(nn.Module):
    """Attention as the makemore/minGPT lectures write it: a causal mask kept as a buffer of the model's own module
    (with a raw position table sliced to the sequence), q/k/v Linears without bias. Opacus' hooks refuse a module that
    has both buffers and trainable layers; bk's per-example copy of ``pos`` cannot be sliced to T."""

    def __init__(self, vocab=11, t=6, d=8):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(t, d) * 0.1)
        self.key, self.query, self.value = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(t, t)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.emb(ids) + self.pos[:t]
        w = self.query(x) @ self.key(x).transpose(-2, -1) * x.shape[-1] ** -0.5
        x = x + w.masked_fill(self.tril[:t, :t] == 0, float("-inf")).softmax(-1) @ self.value(x)
        return self.head(self.ln(x).mean(1))


class NanoGPT(nn.Module):
    """nanoGPT's habits: the token embedding tied to the LM head, LayerNorm without bias (which Opacus' hooks crash
    on), F.scaled_dot_product_attention with is_causal, positions looked up with torch.arange(T). ``shared``: a second
    projection layer sharing the first's weight, as ALBERT shares layers (bk clips only an Embedding tied to a Linear).
    """

    def __init__(self, vocab=11, t=6, d=8, shared=False, bias=False, lead=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.ln, self.qkv, self.proj = nn.LayerNorm(d, bias=False), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=bias)
        self.wte.weight = self.lm_head.weight
        self.again, self.lead = nn.Linear(d, d) if shared else None, lead
        if shared:
            self.again.weight = self.proj.weight

    def forward(self, ids):
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        x = self.wte(ids) + self.wpe(pos.unsqueeze(0) if self.lead else pos)  # nanoGPT's first version: (1, T)
        q, k, v = (h.view(b, t, 2, -1).transpose(1, 2) for h in self.qkv(self.ln(x)).chunk(3, -1))
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                          .reshape(b, t, -1))
        if self.again is not None:
            x = x + self.again(torch.tanh(x))
        return self.lm_head(x)[:, -1, :3]  # the next token, as 3 classes


class SharedLayersNanoGPT(NanoGPT):
    def __init__(self):
        super().__init__(shared=True)


@pytest.mark.parametrize("cls, said", [(MinGPT, "hooks skipped: NotImplementedError: "),
                                       (SharedLayersNanoGPT, "hooks skipped: AttributeError: ")])
def test_auto_skips_a_mode_whose_own_machinery_fails_on_the_model_and_clips_it_exactly(cls, said):
    """A mode that crashes on a model (Opacus refusing its module layout, or failing inside a hook) is skipped as a
    failed check is, said in one line, and the next mode clips exactly: here vmap, against the float64 loop."""
    make = _made(cls)
    torch.manual_seed(1)
    x, y = torch.randint(0, 11, (9, 6)), torch.randint(0, 3, (9,))
    step = _step(make(), "auto", physical=4)
    step.check((x[:8], y[:8]))
    assert step.mode == "vmap" and said in step.mode_note and "\n" not in step.mode_note, step.mode_note
    if cls is SharedLayersNanoGPT:  # the faster mode left out before any check says why too
        assert "bk skipped: cannot clip a parameter shared between layers other than an Embedding and a Linear " \
               "(tied weights)" in step.mode_note
    step((x, y), step=0)
    for p, e in zip(step.params, clipped_sum(make(), rows(x, y), CLIP).grads):
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


@pytest.mark.parametrize("bias, lead", [(False, False), (True, True)])
def test_a_token_embedding_tied_to_the_lm_head_is_clipped_exactly_on_bk(bias, lead):
    """nanoGPT, GPT-2, T5: one weight is both the token embedding and the output projection, so each example's
    gradient of it is the sum of both layers' (its norm has a cross term). auto takes bk, and the clipped sum equals
    the float64 loop's, with repeated ids, examples clipped and not (C = 0.05 and 50), the head's bias trainable or
    absent, positions looked up with ids (T,) or (1, T)."""
    def make():
        torch.manual_seed(0)
        return NanoGPT(bias=bias, lead=lead)
    torch.manual_seed(1)
    x, y = torch.randint(0, 4, (9, 6)), torch.randint(0, 3, (9,))  # 4 of 11 ids: repeats within an example
    for clip in (0.05, 50.0):
        step = GradientStep(make(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=clip,
                            noise_multiplier=0.0, grad_sample_mode="auto", max_physical_batch_size=4)
        step.check((x[:8], y[:8]))
        assert step.mode == "bk", step.mode_note
        step((x, y), step=0)
        expected = clipped_sum(make(), rows(x, y), clip)
        assert expected.clipped == (9 if clip < 1 else 0)
        for p, e in zip(step.params, expected.grads):
            torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


@pytest.mark.parametrize("lead", [False, True])
def test_shared_position_ids_stay_per_example_when_a_later_batch_is_one_token_long(lead):
    """The check reads how positions are looked up (ids (T,), or (1, T) whose 1 stands for the batch) once, at T = 6;
    a later batch of T = 1 gives ids (1,) or (1, 1), and each example's copy must still receive its own gradient only
    (ids (1,) taken for a batch of 1 would broadcast every example's gradient into every copy)."""
    def make():
        torch.manual_seed(0)
        return NanoGPT(lead=lead)
    torch.manual_seed(1)
    step = GradientStep(make(), nn.CrossEntropyLoss(reduction="none"), setup("gloo"), max_grad_norm=0.05,
                        noise_multiplier=0.0, grad_sample_mode="bk", max_physical_batch_size=8)
    step.check((torch.randint(0, 11, (8, 6)), torch.randint(0, 3, (8,))))
    for t in (1, 6):
        x, y = torch.randint(0, 11, (5, t)), torch.tensor([0, 1, 2, 0, 1])
        step((x, y), step=0)
        for p, e in zip(step.params, clipped_sum(make(), rows(x, y), 0.05).grads):
            torch.testing.assert_close(p.grad.double(), e, rtol=CLIPPED_RTOL, atol=1e-7)


def test_a_model_that_fails_by_itself_keeps_its_own_error_under_auto():
    """auto skips a mode only when the bare model works: a model's own bug is raised as it is, not hidden behind
    'no mode clips this model'."""
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(24, 3)

        def forward(self, x):
            return self.fc(x) @ torch.ones(4, 3)  # a shape bug of the user's own

    x, y = _data(8)
    step = _step(Broken(), "auto")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        step.check((x, y))
    assert step.skipped == [] and step.mode == "bk"
