"""Mutants that must die: deliberate bugs in the privacy path, each of which some named test must catch.

    make mutants                       # or: python -m tests.mutants [NAME ...] [--list] [--keep]

Each mutant is one exact text substitution in one file of a scratch copy of this working tree (tracked and untracked,
not ignored files; the tree itself is never touched). The script first runs every killing test on the unmutated
copy (they must pass there), then, per mutant, applies it and runs only its killing tests: the mutant is *killed*
when they fail. It prints a table and exits 1 if any mutant survives, cannot be applied, or errs.

When the code moves, a substitution whose ``old`` text is no longer in the file (or is there more than once) fails
loudly, naming the mutant: update ``old``/``new`` below to the bug's new home (``tests/test_mutants.py`` checks every
target still applies, so CI notices at once). Killers are pytest node ids; keep them to the few tests that should
catch the bug, so the run stays short.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # the broken promise, in words
    path: str  # relative to the repository root
    old: str  # exact text, present exactly once
    new: str
    killers: tuple[str, ...]  # pytest node ids that must fail on the mutant


NOISE_GATE = "self.adds = self.sigma > 0 and self.rank == 0"
NOISE_CALL = "        if self.noise is not None:  # 3:"
FP_CANCEL = "tests/test_fp_bound.py::test_inputs_that_cancel_across_positions_are_released_within_the_clip"
FP_FUZZ = "tests/test_fp_bound.py::test_no_example_is_released_above_the_clip_in_floating_point"
FP_WORST = "tests/test_fp_bound.py::test_a_kernel_sum_whose_every_partial_sum_rounds_up_is_clipped_within_the_clip"
FP_ROUTES = "tests/test_fp_bound.py::test_each_other_routes_clip_factor_leaves_room_for_an_independently_counted_rounding"

MUTANTS = (
    Mutant("divide-by-realised-batch", "the update is divided by the realised batch, not the expected B",
           "workbench/trainer.py", "self.step_fn.divide_(self.expected_batch)", "self.step_fn.divide_(max(count, 1.0))",
           ("tests/test_trainer.py::test_update_is_the_clipped_sum_over_the_expected_batch_not_the_realised_one",)),
    Mutant("noise-on-every-rank", "every rank adds sigma*C noise: W times the noise in the sum (and W-fold accounting lie)",
           "workbench/privacy/noise.py", NOISE_GATE, "self.adds = self.sigma > 0",
           ("tests/test_distributed.py::test_noise_is_added_exactly_once_cluster_wide[2]",)),
    Mutant("no-noise-on-empty-batch", "a step whose Poisson batch is empty releases no noise",
           "workbench/step.py", NOISE_CALL, NOISE_CALL.replace(" is not None:", " is not None and batch is not None:"),
           ("tests/test_noise.py::test_noise_std_is_sigma_times_clip_and_reproducible",)),
    Mutant("sampler-takes-first-k", "the batch is the first k examples (k ~ Binomial(n, q), so sizes look right)",
           "workbench/privacy/sampling.py", "return np.sort(_first_distinct(n, k, rng))", "return np.arange(k)",
           ("tests/test_sampling.py::test_each_example_is_included_binomial_t_q_times[per_rank]",
            "tests/test_sampling.py::test_pairs_of_examples_are_included_together_q_squared_of_the_time[per_rank]")),
    Mutant("accountant-q-of-other-shard-mode", "the accountant gets the other shard mode's q (per_rank: B / (W N))",
           "workbench/privacy/mechanisms/dpsgd.py",
           "return Accountant(p.accountant, shard.sample_rate, sigma, world_size, shard_mode)",
           "return Accountant(p.accountant, __import__('workbench.privacy.sampling', fromlist=['_']).train_shard("
           "shard.population, 0, world_size, 'global' if shard_mode == 'per_rank' else 'per_rank', "
           "shard.expected_batch // world_size).sample_rate, sigma, world_size, shard_mode)",
           ("tests/test_distributed.py::test_parameters_stay_identical_and_only_rank_zero_tracks",)),
    Mutant("clip-per-layer", "each parameter's per-example gradient is clipped to C on its own, not the whole flat one",
           "workbench/privacy/clipping/opacus_modes.py", "torch.mv(gs.t(), factor.to(gs.dtype))",
           "torch.mv(gs.t(), (self.clip / (torch.linalg.vector_norm(gs, dim=1) + 1e-6)).clamp(max=1.0))",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[linear-hooks]",)),
    Mutant("bk-norm-without-bias", "book-keeping leaves the bias out of each example's norm: under-clipped examples",
           "workbench/privacy/clipping/layers/linear.py", "(1.0 if \"bias\" in names else 0.0)", "0.0",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[linear-bk]",)),
    Mutant("bk-alias-not-hidden", "a rule-less module's second reference to a layer's parameter stays visible during "
           "bk's forward: a use of it outside the layer, which the layer's rule does not see, is missing from the "
           "clipped gradient", "workbench/privacy/clipping/book_keeping.py",
           "            m.__dict__[\"_parameters\"] = {name: p for name, p in m._parameters.items() if name != k}",
           "            pass",
           ("tests/test_clipping.py::test_a_second_reference_to_a_layers_bias_is_the_layers_and_any_other_use_of_it_"
            "is_refused",)),
    Mutant("bk-check-skips-one-example", "book-keeping's pre-run check compares nothing on one example: a weight "
           "used outside its layer trains with micro-batches of one",
           "workbench/privacy/clipping/bk_check.py", "        for k in range(n):", "        for k in range(n if n > 1 else 0):",
           ("tests/test_clipping.py::test_a_weight_used_outside_its_layer_is_refused_one_example_at_a_time[bk]",)),
    Mutant("non-finite-factor-kept", "an example whose norm is NaN keeps a NaN clip factor: one example's data makes "
           "the release non-finite (an event seen without noise)",
           "workbench/privacy/clipping/bound.py", "rows = ~(factor >= TINY_FACTOR)", "rows = factor < TINY_FACTOR",
           ("tests/test_clipping.py::test_an_example_with_a_non_finite_gradient_contributes_zero_and_the_others_are_"
            "unchanged[hooks-nan]",)),
    Mutant("non-finite-rows-summed-bk", "a zeroed example's inf rows still enter bk's clipped sum: 0 * inf = NaN",
           "workbench/privacy/clipping/book_keeping.py", "t = t if rows is None else zero_rows(t, rows)", "t = t",
           ("tests/test_clipping.py::test_an_example_with_a_non_finite_gradient_contributes_zero_and_the_others_are_"
            "unchanged[bk-nan]",)),
    Mutant("non-finite-rows-summed-opacus", "a zeroed example's inf rows still enter the hooks sum: 0 * inf = NaN",
           "workbench/privacy/clipping/opacus_modes.py", "gs = gs if rows is None else zero_rows(gs, rows)", "gs = gs",
           ("tests/test_clipping.py::test_an_example_with_a_non_finite_gradient_contributes_zero_and_the_others_are_"
            "unchanged[hooks-overflow]",)),
    # issue 19: each route's factor recomputed from another precision or quantity than what its kernel sums
    Mutant("fp-conv-kept-norm-without-kernel-error", "the conv kept/Gram route clips against its float64 norm alone: "
           "the float32 kernel's rounding of cancelling terms escapes the clip",
           "workbench/privacy/clipping/layers/conv.py", "err += (formed + kernel) * magnitude", "err += 0 * magnitude",
           (FP_CANCEL + "[conv1x1_kept]", FP_CANCEL + "[patch_embedding]")),
    Mutant("conv-input-gram-offsets-unstrided", "the conv Gram route without patches reads the input positions' Gram "
           "as if stride and dilation were 1: strided or dilated layers' norms are wrong",
           "workbench/privacy/clipping/layers/conv.py", "rows = tuple(slice(o * d, o * d + (size - 1) * st + 1, st)",
           "rows = tuple(slice(o, o + size)",
           ("tests/test_clipping.py::test_the_input_gram_route_gives_each_examples_squared_norm[config1]",
            "tests/test_clipping.py::test_book_keeping_matches_the_per_example_loop[64-conv1d_dilated_kept_gram_by_"
            "inputs]")),
    Mutant("conv-gram-chunk-norms-misplaced", "the conv Gram route writes each chunk's norms to the first examples' "
           "rows: an example is clipped by another's norm", "workbench/privacy/clipping/layers/conv.py",
           "n2[s:s + step] = (self._gram32", "n2[:len(chunk[0][2])] = (self._gram32",
           ("tests/test_clipping.py::test_conv_rule_in_chunks_of_examples_matches_the_per_example_loop"
            "[conv2d_kept_gram]",)),
    Mutant("fp-conv-gram32-without-margin", "the conv Gram route from float32 Gram matrices takes their sum for the "
           "squared norm, without the rounding margin: an example whose terms cancel is clipped against rounding",
           "workbench/privacy/clipping/layers/conv.py", "margin = gram32_margin(diagonal_norms(uu, p)",
           "margin = 0 * gram32_margin(diagonal_norms(uu, p)",
           ("tests/test_clipping.py::test_the_float32_gram_route_bounds_each_examples_squared_norm_from_above[True]",
            "tests/test_clipping.py::test_the_float32_gram_route_bounds_each_examples_squared_norm_from_above[False]")),
    Mutant("conv-stash-chunks-misplaced", "the conv kept route scales each stashed chunk of per-sample gradients "
           "by the first examples' factors: an example is clipped by another's norm",
           "workbench/privacy/clipping/layers/conv.py", "s += len(w)", "s += 0",
           ("tests/test_clipping.py::test_conv_rule_in_chunks_of_examples_matches_the_per_example_loop[conv2d_kept]",)),
    Mutant("conv-patch-sum-rows-unstrided", "the conv clipped sum by patches reads windows as if the stride were 1: "
           "strided layers add the wrong positions' inputs", "workbench/privacy/clipping/layers/conv.py",
           "(st[0], *[k * s for k, s in zip(m.stride, st[1:1 + dims])], per,", "(st[0], *st[1:1 + dims], per,",
           ("tests/test_clipping.py::test_the_clipped_sum_by_patches_is_the_weight_gradient[config1]",)),
    Mutant("conv-stash-by-patches-in-kernel-order", "the conv kept route adds per-sample gradients formed tap-major "
           "(by shifts or patches) as if their columns were in the weight's order: channels and kernel taps swapped",
           "workbench/privacy/clipping/layers/conv.py", "movedim(-1, 1) if state.tap_major", "movedim(-1, 1) if False",
           ("tests/test_clipping.py::test_kept_convolutions_summed_by_patches_match_the_per_example_loop"
            "[conv2d_kept]",)),
    Mutant("conv-shifts-gradient-unspread", "the conv kept route's per-sample gradients by shifted input rows place "
           "g contiguously, not at its positions' rows of the padded input: taps read the wrong input positions",
           "workbench/privacy/clipping/layers/conv.py",
           "wide.as_strided((n, g.shape[1], *out), (g.shape[1] * q, q, *steps)).copy_(g)",
           "wide[..., :math.prod(out)].copy_(g.flatten(2))",
           ("tests/test_clipping.py::test_per_sample_gradients_by_shifts_and_by_patches_are_each_examples[config0]",
            "tests/test_clipping.py::test_kept_convolutions_summed_by_patches_match_the_per_example_loop"
            "[conv2d_kept]")),
    Mutant("fp-linear-seq-norm-without-kernel-error", "the Linear sequence kept route clips against the float32 "
           "per-sample norm, not the matmul's sum",
           "workbench/privacy/clipping/layers/linear.py", "scale = (formed + gamma(kernel_depth(batch, steps)))",
           "scale = 0 * (formed + gamma(kernel_depth(batch, steps)))",
           (FP_CANCEL + "[linear_seq_kept_formed]", FP_FUZZ,
            "tests/test_fp_bound.py::test_a_reduced_float32_matmul_precision_does_not_loosen_the_bound[medium-formed]",
            "tests/test_fp_bound.py::test_a_reduced_float32_matmul_precision_does_not_loosen_the_bound[high-formed]")),
    Mutant("bk-linear-gram-drops-cross-positions", "the Linear Gram route sums <a_t,a_t><g_t,g_t> alone (positions "
           "taken for examples): each example's norm is wrong", "workbench/privacy/clipping/layers/linear.py",
           "n2 = ga.double().mul_(gg.double()).sum((1, 2))",
           "n2 = ga.double().mul_(gg.double()).diagonal(dim1=1, dim2=2).sum(1)",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[linear_sequence_gram-bk]",
            "tests/test_layers.py::test_the_linear_gram_route_is_taken_where_it_costs_fewer_flops")),
    Mutant("bk-patch-columns-out-of-order", "the patch convolution's patches lay their pixels out kernel-major, not "
           "in the weight's (C_in, *k) order: each example's gradient lands on the wrong weights",
           "workbench/privacy/clipping/layers/patch_conv.py",
           "order = (0, *[2 + 2 * i for i in range(dims)], 1, *[3 + 2 * i for i in range(dims)])",
           "order = (0, *[2 + 2 * i for i in range(dims)], *[3 + 2 * i for i in range(dims)], 1)",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[conv2d_patches-bk]",
            "tests/test_layers.py::test_patch_convolutions_take_the_patch_rule_and_form_what_the_convolution_kernel_"
            "forms")),
    Mutant("fp-linear-gram32-without-margin", "the Linear float32 Gram route clips against its float32 sum, not an "
           "upper bound: about half the examples' norms round below the exact and escape the clip by up to 2^-8",
           "workbench/privacy/clipping/layers/linear.py", "bound = n2.clamp(min=0).add_(margin).mul_(1.0 + 4 * U64)",
           "bound = n2.clamp(min=0).mul_(1.0 + 4 * U64)",
           ("tests/test_layers.py::test_the_float32_gram_bound_holds_and_falls_back_to_float64_where_it_is_loose",
            "tests/test_layers.py::test_the_linear_gram_route_is_taken_where_it_costs_fewer_flops")),
    Mutant("bk-linear-gram64-drops-bias", "the float64 Gram route of small matrices leaves the bias out of the "
           "folded input (a'_t = [a_t, 0], not [a_t, 1]): each example's norm misses its bias gradient",
           "workbench/privacy/clipping/layers/linear.py", "            ga.add_(1.0)\n            d_in += 1",
           "            ga.add_(0.0)\n            d_in += 1",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[linear_sequence_gram-bk]",
            "tests/test_layers.py::test_the_float64_gram_route_of_small_matrices_bounds_weight_and_bias_together")),
    Mutant("fp-linear-gram64-without-kernel-error", "the float64 Gram route clips against its float64 norm and its "
           "own margin, not the float32 kernel's rounding of what it sums",
           "workbench/privacy/clipping/layers/linear.py", "scale = (gamma(kernel_depth(batch, steps)) + math.sqrt(",
           "scale = (0 * gamma(kernel_depth(batch, steps)) + math.sqrt(",
           ("tests/test_layers.py::test_the_float64_gram_route_of_small_matrices_bounds_weight_and_bias_together",)),
    Mutant("fp-linear-gram64-without-err", "the float64 Gram route returns no error term: an example whose positions "
           "cancel has a Gram norm near 0 and its float32 kernel's rounding is released unclipped (~170 C)",
           "workbench/privacy/clipping/layers/linear.py", "return Bound(n2, err=s.mul_(scale * (1.0 + 2 * U64)),",
           "return Bound(n2, err=s.mul_(0.0),",
           ("tests/test_layers.py::test_the_float64_gram_route_counts_the_float32_kernels_rounding",)),
    Mutant("fp-linear-gram64-keeps-huge-entries", "the float64 Gram route keeps examples with entries past 2^64 in "
           "the float32 kernel: a scaled value rounded to a subnormal then moves a product by more than the slack",
           "workbench/privacy/clipping/layers/linear.py", "n2.masked_fill_(big, math.inf)",
           "n2.masked_fill_(big & False, math.inf)",
           ("tests/test_layers.py::test_the_float64_gram_route_of_small_matrices_bounds_weight_and_bias_together",)),
    Mutant("bk-linear-seq-bias-unscaled", "a kept Linear sequence's bias is summed into its buffer without the "
           "clip factors: every clipped example's bias gradient is released whole",
           "workbench/privacy/clipping/layers/linear.py", "view_of[id(layers[0].bias)].addmv_(rows.t(), scale)",
           "view_of[id(layers[0].bias)].addmv_(rows.t(), torch.ones_like(scale))",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[linear_sequence_gram-bk]",)),
    Mutant("bk-joins-linears-of-other-inputs", "book-keeping joins Linear layers whose inputs merely have one shape "
           "(out_proj with q, k, v): out_proj's gradient is formed from q's input, its examples clipped by a wrong norm",
           "workbench/privacy/clipping/book_keeping.py", "groups.setdefault((a.data_ptr(), a.shape,",
           "groups.setdefault((a.shape,",
           ("tests/test_layers.py::test_q_k_v_reading_one_input_are_joined_and_each_example_is_clipped_as_the_oracle_"
            "clips_it[2-True]",)),
    Mutant("bk-scalar-copies-read-per-feature", "a raw parameter's per-example copies take no 1s: a scalar's (n,) "
           "on a (n, d) activation reads copy j for feature j, mixing examples (or cannot broadcast at all)",
           "workbench/privacy/clipping/book_keeping.py",
           "return p.expand(n, *[1] * self.ones, *shape)", "return p.expand(n, *shape)",
           ("tests/test_model_zoo.py::test_broadcast_parameters_get_each_examples_own_clipped_gradient"
            "[auto-layer_scale_rezero]",)),
    Mutant("fp-embedding-norm-without-kernel-error", "Embedding clips against float64 row sums, not the float32 "
           "index_add_ that sums them", "workbench/privacy/clipping/layers/embedding.py",
           "magnitude.mul_((gamma(steps, U64) + gamma(kernel_depth(batch, steps))) * scale)",
           "magnitude.mul_(0 * scale)", (FP_CANCEL + "[embedding]",)),
    Mutant("bk-tied-weight-without-cross-term", "a weight tied between an Embedding and a Linear (GPT-2's wte and "
           "lm_head) clipped by ||E||^2 + ||L||^2, not ||E + L||^2: the example's norm is wrong either way",
           "workbench/privacy/clipping/tied.py", "out.append(ee.add_(ll).add_(el, alpha=2.0))",
           "out.append(ee.add_(ll))",
           ("tests/test_model_zoo.py::test_a_token_embedding_tied_to_the_lm_head_is_clipped_exactly_on_bk[False-False]",)),
    Mutant("fp-tied-norm-without-error", "the tied pair clips against its float64 Gram norm alone, not what its "
           "float32 index_add_ and matmul add", "workbench/privacy/clipping/tied.py",
           "scale = (1 + max(u_rel, g_rel))", "scale = 0 * (1 + max(u_rel, g_rel))", (FP_CANCEL + "[tied]",)),
    Mutant("bk-hf-conv1d-sum-untransposed", "GPT-2's Conv1D (a Linear stored transposed) gets the Linear layout's "
           "clipped sum: a square projection's update is its transpose", "workbench/privacy/clipping/layers/linear.py",
           "view_of = {**view_of, id(m.weight): view_of[id(m.weight)].t()}", "view_of = view_of",
           ("tests/test_layers.py::test_clipped_sum_equals_the_per_example_loop[hf_conv1d_sequence_kept-bk]",)),
    Mutant("bk-leading-1-read-per-call", "shared position ids whose first dimension is 1 in one call are taken for a "
           "batch of 1 (ids (T,) at T = 1): every example's gradient reaches every example's copy",
           "workbench/privacy/clipping/book_keeping.py", "ids.expand(n, *ids.shape[1:] if lead else ids.shape)",
           "ids.expand(n, *ids.shape[1:] if ids.dim() and ids.shape[0] == 1 else ids.shape)",
           ("tests/test_model_zoo.py::test_shared_position_ids_stay_per_example_when_a_later_batch_is_one_token_long"
            "[False]",)),
    Mutant("fp-linear-rows-norm-in-bf16", "the Linear rows route's norms from bf16-rounded inputs: rounded down, an "
           "example escapes the clip", "workbench/privacy/clipping/layers/linear.py", "aa = torch.linalg.vecdot(a, a)", "aa = torch.linalg.vecdot(a.bfloat16(), a.bfloat16()).float()",
           (FP_FUZZ,)),
    Mutant("bk-rows-lean-adds-non-finite", "bk's lean rows path adds even where an example's bound is not finite "
           "(0 * inf = NaN in the release) instead of handing the batch to the generic path's float64 route",
           "workbench/privacy/clipping/rows.py", "if not within(factor):", "if False:",
           ("tests/test_rows.py::test_the_lean_path_is_the_generic_path_bit_for_bit_and_steps_aside_where_it_must",)),
    Mutant("bk-rows-lean-margins-stale", "bk's lean rows path keeps the margins of the first C it saw: adaptive "
           "clipping's later, smaller C_t clips against the old one", "workbench/privacy/clipping/rows.py",
           "tuple((a.shape[1], g.shape[1]) for a, g in rows), batch, clip)",
           "tuple((a.shape[1], g.shape[1]) for a, g in rows), batch)",
           ("tests/test_rows.py::test_the_lean_paths_margins_follow_the_batch_bound_and_the_clip",)),
    Mutant("fp-materialised-norm-in-bf16", "formed per-sample gradients (bk's formed routes, hooks, functorch, ew) "
           "clipped by a bf16 norm, not the float32 values summed", "workbench/privacy/clipping/bound.py",
           "    b = squares(t)\n", "    b = squares(t.bfloat16())\n", (FP_FUZZ,)),
    Mutant("fp-ill-conditioned-in-batch-kernels", "examples whose float32 sums are mostly rounding stay in the batch "
           "kernels, where their share of the rounding moves with their batch-mates", "workbench/privacy/clipping/bound.py",
           ".mul_(c).masked_fill_(ill, 0.0)", ".mul_(c)",
           ("tests/test_fp_bound.py::test_removing_one_example_moves_the_release_by_at_most_its_clipped_contribution[3]",
            "tests/test_fp_bound.py::test_removing_one_example_moves_the_release_by_at_most_its_clipped_contribution"
            "[512]")),
    Mutant("fp-factor-depends-on-the-draw", "the kernels' rounding margins use the number of examples drawn, not the "
           "public micro-batch bound", "workbench/privacy/clipping/book_keeping.py", "bound_n = max(n, self.max_batch)",
           "bound_n = n", ("tests/test_fp_bound.py::test_an_examples_clip_factor_does_not_depend_on_how_many_others_"
                           "were_drawn",)),
    Mutant("fp-huge-gradient-dropped", "a finite gradient past float32's squares contributes 0 instead of C",
           "workbench/privacy/clipping/bound.py", "if top == 0.0 or not math.isfinite(top):", "if True:",
           ("tests/test_fp_bound.py::test_a_finite_gradient_past_float32s_squares_is_clipped_to_c_not_dropped[bk]",
            "tests/test_fp_bound.py::test_a_finite_gradient_past_float32s_squares_is_clipped_to_c_not_dropped[hooks]")),
    Mutant("fp64-route-nan-past-first-parameter-unscaled", "the float64 route adds an example whose NaN is past its "
           "first parameter unscaled (max compares the NaN away, min(1, C / NaN) = 1): 2.3e36 released at C = 1",
           "workbench/privacy/clipping/bound.py", "    if not math.isfinite(norm):", "    if False:",
           ("tests/test_fp_bound.py::test_a_nan_in_any_parameter_of_an_example_sent_to_the_float64_route_contributes_zero",)),
    Mutant("pinned-seed-logged", "a pinned secure_seed reaches MLflow's params unredacted",
           "workbench/tracking/redaction.py", 'container["privacy"]["secure_seed"] = "<redacted>"', "pass",
           ("tests/test_resume.py::test_streams_are_secret_unless_pinned",)),
    Mutant("secret-in-published-checkpoint", "the checkpoint published to MLflow carries the stream secret",
           "workbench/run.py", 'torch.save({k: v for k, v in state(steps).items() if k not in PRIVATE_STATE}, published)',
           "torch.save(state(steps), published)",
           ("tests/test_resume.py::test_streams_are_secret_unless_pinned",)),
    Mutant("pinned-seed-in-overrides-tag", "a pinned secure_seed reaches MLflow in the overrides tag and params",
           "workbench/tracking/redaction.py", 'text = _SECRET_OVERRIDE.sub(r"\\1<redacted>", text)', "return text",
           ("tests/test_tracking_redaction.py::test_secrets_never_reach_mlflow",)),
    Mutant("pinned-seed-copied-elsewhere", "a pinned secure_seed copied into the run name or another config string "
           "reaches MLflow", "workbench/tracking/redaction.py",
           'text = re.sub(rf"(?<!\\d){abs(int(secret))}(?!\\d)", "<redacted>", text)', "pass",
           ("tests/test_tracking_redaction.py::test_a_pinned_seed_is_redacted_from_every_text_of_the_config_and_kept_out_"
            "of_hydra_folder_names",)),
    Mutant("bandmf-parts-ignored", "cyclic Poisson samples part 0 at every step: examples take part more often than "
           "once every b steps, as accounted", "workbench/privacy/cyclic.py", "k = step % self.num_bands", "k = 0",
           ("tests/test_bandmf.py::test_cyclic_poisson_takes_each_example_at_most_once_every_b_steps_at_rate_p[1]",)),
    Mutant("bandmf-participations-floored", "amplified BandMF counts floor(T/b) participations: epsilon under-reported",
           "workbench/privacy/accounting/banded.py", "return -(-int(steps) // int(num_bands))",
           "return int(steps) // int(num_bands)",
           ("tests/test_bandmf.py::test_bandmf_epsilon_is_dp_sgd_over_ceil_t_over_b_participations[pld]",)),
    Mutant("bandmf-noise-uncorrelated", "bandmf's noise forgets the ring: not C^-1 Z, so not the accounted mechanism",
           "workbench/privacy/correlated.py", "w.sub_(self.ring[(step - j) % slots], alpha=self.c[j])", "pass",
           ("tests/test_bandmf.py::test_noise_covariance_is_sigma_squared_C_inverse_C_inverse_transposed",)),
    Mutant("bandmf-ring-published", "bandmf's secret noise ring reaches the checkpoint published to MLflow",
           "workbench/run.py", 'PRIVATE_STATE = ("secret", "privacy_digest", "correlated_noise", "audit")',
           'PRIVATE_STATE = ("secret", "privacy_digest", "audit")',
           ("tests/test_bandmf.py::test_a_crashed_bandmf_run_resumes_bit_for_bit_and_its_ring_stays_out_of_mlflow",)),
    Mutant("bandmf-audit-ignores-correlation", "the white-box audit of a bandmf run scores its correlated noise as "
           "DP-SGD's independent noise: its likelihood ratio is not one", "workbench/privacy/auditing/canaries.py",
           "coefficients or (1.0,), self.bands)", "(1.0,), None)",
           ("tests/test_audit.py::test_bandmf_white_box_ratio_is_calibrated_on_non_members_and_members",)),
    Mutant("audit-state-published", "the audit's private state (canary scores, the observer's past updates) reaches "
           "the checkpoint published to MLflow", "workbench/run.py",
           'PRIVATE_STATE = ("secret", "privacy_digest", "correlated_noise", "audit")',
           'PRIVATE_STATE = ("secret", "privacy_digest", "correlated_noise")',
           ("tests/test_audit.py::test_a_crashed_bandmf_audit_resumes_to_the_uninterrupted_audit_below_its_epsilon",)),
    Mutant("blt-sensitivity-one-participation", "blt's sensitivity counts one participation per example, not every "
           "k-th step's: epsilon under-reported", "workbench/privacy/blt.py",
           "        v[start:start + min_sep] += v[start - min_sep:start - min_sep + len(v[start:start + min_sep])]",
           "        pass",
           ("tests/test_blt.py::test_the_sensitivity_of_every_prefix_is_the_worst_part_of_the_dense_matrix",)),
    Mutant("blt-noise-uncorrelated", "blt's noise forgets its buffers: not C^-1 Z, so not the accounted mechanism",
           "workbench/privacy/correlated.py", "x.sub_(self.buffers[i], alpha=s)", "pass",
           ("tests/test_blt.py::test_the_noise_is_sigma_clip_c_inverse_z_computed_densely_and_keeps_d_plus_one_model_"
            "vectors",)),
    Mutant("blt-batches-not-cyclic", "blt's sampler takes batch 0 at every step: examples take part every step, not "
           "every k-th as accounted", "workbench/privacy/cyclic.py", "k = step % self.parts", "k = 0",
           ("tests/test_blt.py::test_fixed_batches_take_each_example_exactly_at_the_steps_of_its_part[1]",)),
    Mutant("oom-retry-keeps-partial-sum", "max_physical_batch_size=auto restarts a step after out-of-memory on top "
           "of the failed attempt's clipped sums: examples counted twice", "workbench/step.py",
           "        self.flat.zero_()\n        for p in self.params:\n            p.grad = None\n            if getattr",
           "        for p in self.params:\n            p.grad = None\n            if getattr",
           ("tests/test_micro_batches.py::test_out_of_memory_restarts_the_step_from_the_same_batch_and_equals_the_"
            "smaller_size_from_the_start",)),
    Mutant("oom-retry-lowers-the-margins", "the clip margins follow auto's halving, which happens on a realised "
           "(private) batch size: every factor then depends on how many examples were drawn",
           "workbench/step.py", "        self.max_physical_batch_size = size // 2\n",
           "        self.max_physical_batch_size = self.clipper.max_batch = size // 2\n",
           ("tests/test_micro_batches.py::test_out_of_memory_restarts_the_step_from_the_same_batch_and_equals_the_"
            "smaller_size_from_the_start",)),
    Mutant("resume-forgets-auto-size", "a resumed max_physical_batch_size=auto run re-probes its size and margins: "
           "not the run it resumes", "workbench/job.py", 'if step_fn.auto and state.get("physical_batch_size"):',
           "if False:", ("tests/test_micro_batches.py::test_a_resumed_auto_run_keeps_its_size_and_margins_and_ends_"
                         "bit_exact",)),
    Mutant("budget-stop-ignored", "a run with fixed sigma takes all planned steps past target_epsilon",
           "workbench/privacy/mechanisms/base.py", "        steps = budget\n", "        pass\n",
           ("tests/test_mechanism.py::test_a_run_with_fixed_noise_stops_at_the_budget",)),
    Mutant("published-model-carries-the-last-batch", "the MLflow model is the trained module itself, with the last "
           "batch's per-example gradients and activations on it", "workbench/run.py",
           "            torch.save(published, path)", "            torch.save(model, path)",
           ("tests/test_mlflow_ui.py::test_the_published_model_holds_the_trained_weights_and_nothing_of_the_last_batch"
            "[hooks]",)),
    Mutant("private-run-publishes-its-raw-loss", "a private run sends its training loss (an exact statistic of its "
           "batches, outside epsilon) to MLflow by default", "workbench/trainer.py",
           "return not self.mechanism.private if chosen is None else bool(chosen)",
           "return True if chosen is None else bool(chosen)",
           ("tests/test_trainer.py::test_the_raw_training_loss_reaches_mlflow_only_where_nothing_private_is_lost_or_the_"
            "user_asked[True-None-False]",)),
    Mutant("throughput-counts-the-realised-batch", "samples_per_second publishes the realised Poisson batch sizes (a "
           "noiseless count)", "workbench/trainer.py", "window_steps * self.expected_batch / max(elapsed, 1e-9)",
           "window_count / max(elapsed, 1e-9)",
           ("tests/test_trainer.py::test_samples_per_second_counts_expected_examples_never_the_realised_batch",)),
    Mutant("resume-draws-a-fresh-secret", "a resumed unpinned run ignores its checkpoint's secret",
           "workbench/job.py", 'secret = state["secret"]', "secret = secret",
           ("tests/test_resume.py::test_an_unpinned_run_resumes_with_the_secret_of_its_checkpoint",)),
    Mutant("poisson-mean-below-one-accepted", "random stopping with a Poisson mean below 1 runs, and its bound's "
           "log(mu) term publishes less than one run's epsilon", "workbench/config.py",
           "not isinstance(mu, bool) and mu < 1:", "not isinstance(mu, bool) and mu < 0:",
           ("tests/test_bad_input.py::test_bad_input_is_one_line_before_any_run_or_folder[sweep.poisson_mean=0.5]",)),
    Mutant("only-drawn-points-bounded", "sweep_epsilon_best covers only the points that were drawn, not every point "
           "that could have been", "workbench/sweep/summary.py", "    for c in candidates:\n",
           "    for c in [c for c, n in zip(candidates, state['trials']) if n]:\n",
           ("tests/test_sweeps.py::test_random_stopping_bounds_every_point_of_the_grid_drawn_or_not",)),
    Mutant("profile-bound-without-second-term", "the profile bound drops the term for how the best is chosen",
           "workbench/privacy/accounting/selection.py", "math.exp(e1) * second <= room", "0 * second <= room",
           ("tests/test_selection.py::test_the_profile_bound_is_never_below_the_exact_selection_privacy_of_a_toy",)),
    Mutant("user-count-per-example", "user-level adaptive clipping counts each example of a user (a user moves the "
           "count by up to k/2, not 1/2)", "workbench/privacy/clipping/per_user.py",
           "self.count(factor, exact)  # adaptive clipping: one term per user",
           "self.count(factor.repeat_interleave(torch.as_tensor(sizes, device=device)), exact)  #",
           ("tests/test_user_mechanisms.py::test_the_count_is_over_users_and_c_follows_a_hand_computation_from_the_"
            "per_user_norms[hooks-64]",)),
    Mutant("user-bandmf-samples-plain-poisson", "user-level bandmf draws every user at every step (no cyclic parts) "
           "while accounted as amplified BandMF", "workbench/privacy/users.py", '        if self.kind == "bandmf":  #',
           "        if False:  #",
           ("tests/test_user_mechanisms.py::test_bandmf_draws_users_in_strided_cyclic_parts_and_accounts_over_users[1]",)),
    Mutant("step-pld-keeps-one-steps-infinity-mass", "StepPLD's n-fold composition keeps one step's mass at infinite "
           "loss instead of 1 - (1 - m)^n: delta, hence epsilon, under-reported",
           "workbench/privacy/accounting/pld.py",
           "infinity_mass = _TAIL_MASS - math.expm1(n * math.log1p(-dense._infinity_mass))",
           "infinity_mass = dense._infinity_mass",
           ("tests/test_accounting.py::test_step_pld_self_composes_bit_for_bit_as_dp_accounting",)),
    Mutant("correlated-noise-with-dp-adamw", "DP-AdamBC subtracts independent noise of std sigma C / B from bandmf's "
           "correlated noise, whose std varies with t: not refused", "workbench/job.py",
           "if not mechanism.MECHANISMS[kind].independent_noise:  # its std is not sigma C / B", "if False:  #",
           ("tests/test_refusals_up_front.py::test_a_combination_the_config_decides_is_refused_by_the_up_front_check"
            "[optimizer=dp_adamw-privacy.mechanism=bandmf]",)),
    Mutant("typed-default-dropped", "a value the user typed for a replaced _target_ is dropped because it equals the "
           "replaced option's default", "workbench/overrides.py", ' and not any(\n                k == mine or k.startswith(mine + ".") for k in typed):', ":",
           ("tests/test_refusals_up_front.py::test_a_typed_value_equal_to_the_replaced_options_default_is_passed"
            "[model=mlp-model.in_features]",)),
    Mutant("every-rank-prints-its-refusal", "under torchrun every rank prints the refusal (one line per rank)",
           "workbench/__main__.py", 'if _rank() not in (None, "", "0"):', "if False:",
           ("tests/test_refusals_up_front.py::test_a_rank_above_0_refuses_in_silence_and_says_it_only_when_rank_0_did_"
            "not",)),
    Mutant("bands-refused-after-the-model", "b B / N > 1 refused only by the plan, after the users' line, the model "
           "and the data check", "workbench/job.py", "    if cfg.privacy.enabled:  # the mechanism's recut",
           "    if False:  #",
           ("tests/test_refusals_up_front.py::test_too_many_bands_for_the_users_is_refused_before_the_model_is_built",)),
    Mutant("noise-seed-without-the-secret", "the noise stream is seeded from the public seed alone: whoever reads the "
           "config can subtract the noise (runs still differ, through the secret batch stream)", "workbench/job.py",
           "step_fn.noise_seed = sampling.stream_seed(secret, cfg.seed)",
           "step_fn.noise_seed = sampling.stream_seed(0, cfg.seed)",
           tuple(f"tests/test_noise.py::test_the_noise_depends_on_the_secret_not_only_on_the_public_seed[{m}]"
                 for m in ("dpsgd", "bandmf", "blt", "adaptive"))),
    Mutant("count-noise-seed-public", "adaptive clipping's count noise is drawn from a public stream: the released "
           "count, hence C_t, can be de-noised by whoever reads the config", "workbench/privacy/noise.py",
           "step_generator(self.seed, 0, step, stream=COUNT_NOISE_STREAM", "step_generator(0, 0, step, stream=COUNT_NOISE_STREAM",
           ("tests/test_noise.py::test_the_noise_depends_on_the_secret_not_only_on_the_public_seed[adaptive]",)),
    Mutant("profile-delta-read-a-cell-late", "the profile bound pairs each eps1 of its grid with delta_Q of the next "
           "grid point (the optimistic side of the cell): sweep_epsilon_best below the claim it computes",
           "workbench/privacy/accounting/selection.py", "for e1, d1 in zip(T_GRID, dq):",
           "for e1, d1 in zip(T_GRID, np.append(dq[1:], 0.0)):",
           ("tests/test_selection.py::test_the_profile_bound_rounds_up_and_is_within_a_percent_of_the_exact_claim"
            "[poisson-3-1.0]",)),
    Mutant("pld-rounds-optimistic", "the Gaussian PLD is discretised on the optimistic side: every delta (a sweep's "
           "best-of-K bound included) below the mechanism's", "workbench/privacy/accounting/pld.py",
           "sampling_prob=sampling_prob, adjacency_type=adjacency),\n            pessimistic_estimate=True",
           "sampling_prob=sampling_prob, adjacency_type=adjacency),\n            pessimistic_estimate=False",
           ("tests/test_selection.py::test_the_profile_bound_rounds_up_and_is_within_a_percent_of_the_exact_claim"
            "[poisson-3-2.0]",)),
    Mutant("fp-kernel-count-quartered", "the clipped-sum kernels' rounding count is a quarter of the products they sum: "
           "every kept and rows route's margin 4x too small", "workbench/privacy/clipping/layers/common.py",
           "    return min(batch, c) * positions + calls * math.ceil(batch / c) + 2",
           "    return (min(batch, c) * positions + calls * math.ceil(batch / c) + 2) // 4",
           tuple(f"tests/test_fp_bound.py::test_each_clip_factor_leaves_room_for_an_independently_counted_rounding[{s}]" for s in ("linear_rows", "linear_seq_kept", "linear_seq_formed_norms",
                                          "linear_seq_gram32"))
           + tuple(f"{FP_ROUTES}[{s}]" for s in ("conv2d_kernel_formed_norms", "conv2d_kernel_gram",
                                                 "conv2d_patches_sum", "embedding"))
           + (FP_WORST,)),
    Mutant("fp-materialised-margin-quartered", "formed per-sample gradients' margin for their sum is gamma_{batch+2} / 4",
           "workbench/privacy/clipping/bound.py", "return b._replace(rel=b.rel + gamma(batch + 2)",
           "return b._replace(rel=b.rel + gamma(batch + 2) / 4",
           tuple(f"tests/test_fp_bound.py::test_each_clip_factor_leaves_room_for_an_independently_counted_rounding[{s}]" for s in ("materialised_hooks", "materialised_functorch"))
           + tuple(f"{FP_ROUTES}[{s}]" for s in ("patch_conv_formed", "layernorm", "groupnorm"))),
    Mutant("fp-conv-kernel-error-quartered", "a kept convolution's kernel error term is a quarter of gamma_K S: its "
           "clipped sum may release past C (1 + rho) where terms cancel", "workbench/privacy/clipping/layers/conv.py",
           "err += (formed + kernel) * magnitude", "err += (formed + kernel) * magnitude / 4",
           tuple(f"{FP_ROUTES}[{s}]" for s in ("conv2d_kernel_formed_norms", "conv2d_kernel_gram",
                                               "conv2d_patches_sum"))),
    Mutant("mia-bound-overflows-to-nan", "the membership-inference bounds take e^eps and e^-L apart: past a loss of 709 "
           "(tiny sigma) inf * 0 publishes NaN", "workbench/privacy/accounting/tradeoff.py",
           "lower += sign * np.exp(eps + log_sums[first])", "lower += sign * np.exp(eps) * np.exp(log_sums[first])",
           ("tests/test_tradeoff.py::test_the_bounds_are_finite_for_every_sigma_and_tend_to_their_limit",
            "tests/test_tradeoff.py::test_a_run_that_draws_every_example_tends_to_a_bound_of_one")),
    Mutant("add-or-remove-claimed-for-every-dpsgd", "a per_rank run on W > 1 ranks (its tail cut by index) is tagged "
           "add-or-remove, which its sampler does not give", "workbench/privacy/mechanisms/dpsgd.py",
           'return m.shard_mode == "global" or m.world_size == 1', "return True",
           ("tests/test_adjacency.py::test_add_or_remove_is_claimed_exactly_where_removing_an_example_leaves_the_"
            "others_as_they_were[dpsgd-per_rank-2]",)),
    Mutant("random-stopping-with-a-pinned-secret", "random stopping's trials run on a pinned secure_seed: a point drawn "
           "twice repeats its batches and noise, not the independent trials the bound assumes", "workbench/config.py",
           'OmegaConf.select(cfg, "sweep.tuning") == "random_stopping" and', 'OmegaConf.select(cfg, "sweep.tuning") == "" and',
           ("tests/test_sweeps.py::test_a_random_stopping_sweep_with_a_pinned_secret_is_refused_before_any_work",)),
    Mutant("best-only-epsilon-claims-k-and-the-table", "the parent labels K, the table and the frontier as covered by "
           "the best-only epsilon", "workbench/sweep/summary.py", "that run's model and metrics; K stays hidden, so nothing else here",
           "that run's model and metrics, points, points_finished, points_failed, sweep_table.csv, frontier.png",
           ("tests/test_sweeps.py::test_random_stopping_sweep_trains_the_drawn_trials_and_reports_the_bound",)),
    Mutant("sweep-points-share-a-pinned-stream", "two sweep points with one pinned secret and seed draw the same noise "
           "(released together it can cancel): not refused", "workbench/config.py",
           "            if (stream, key) in seen:\n", "            if False:\n",
           ("tests/test_sweeps.py::test_sweep_points_sharing_a_pinned_secret_and_seed_are_refused_before_any_work",)),
    Mutant("resume-dedup-keyed-on-the-loss", "a resumed run recognises a logged line by its loss, which a private run "
           "does not publish: the steps between its checkpoint and the interruption are logged twice (issue 45)",
           "workbench/tracking/outbox.py", "if step > logged.get(k, -1)}", 'if step > logged.get("loss", -1)}',
           ("tests/test_tracking.py::test_a_resumed_private_run_logs_each_metric_at_each_step_once_spool_replay_included",
            "tests/test_resume.py::test_a_truncated_checkpoint_is_named_and_the_run_resumes_from_the_newest_intact_one")),
    Mutant("resume-refusal-creates-the-store", "resuming a run into a store that is not there creates an empty "
           "mlflow.db before refusing (issue 45)", "workbench/tracking/tracker.py",
           "if run_id is not None and _creates_store(self.uri):", "if run_id is not None and False:",
           ("tests/test_resume.py::test_resume_refusals",)),
    Mutant("solve-side-by-log-gap", "the root solver decides which side of the target a point is on by the log gap, "
           "which can round an epsilon one float above the target onto it: a sigma or step count that exceeds it",
           "workbench/privacy/accounting/solve.py", "        if (e <= target) == lo_meets:", "        if (gap(e) <= 0) == lo_meets:",
           ("tests/test_solve.py::test_the_side_is_the_exact_comparison_not_the_log_gap",)),
    Mutant("solve-returns-the-missing-end", "the solver returns the bracket's end that misses the target",
           "workbench/privacy/accounting/solve.py", "    return lo if lo_meets else hi", "    return hi if lo_meets else lo",
           ("tests/test_solve.py::test_integers_give_the_most_steps_that_meet_as_brute_force_does",)),
    Mutant("solve-trusts-any-bracket", "a bracket whose ends do not straddle the target is searched anyway",
           "workbench/privacy/accounting/solve.py", "    if lo_meets == (e_hi <= target):", "    if False:",
           ("tests/test_solve.py::test_a_bracket_that_does_not_straddle_the_target_is_refused",)),
    Mutant("solve-integers-stop-two-apart", "the integer search stops two apart: a step count short of the budget, or "
           "one past it", "workbench/privacy/accounting/solve.py", "(hi - lo > 1) if integer", "(hi - lo > 2) if integer",
           ("tests/test_solve.py::test_integers_give_the_most_steps_that_meet_as_brute_force_does",)),
    Mutant("cache-key-without-solver", "the on-disk cache key leaves the solver out: a changed solver reads stale "
           "sigmas and budgets", "workbench/privacy/accounting/accountant.py", '"calibration", "solve", "banded"',
           '"calibration", "banded"',
           ("tests/test_cache.py::test_a_cached_epsilon_depends_on_every_accounting_module_it_is_computed_by",)),
    Mutant("sweep-points-share-pinned-batches", "sweep points with one pinned secret and data_seed but other seeds "
           "draw the same batches with independent noise (one Gaussian of sigma / sqrt 2): not refused",
           "workbench/config.py", '("batches", (secret, data_seed if data_seed is not None',
           '("batches", (secret, i, data_seed if data_seed is not None',
           ("tests/test_sweeps.py::test_sweep_points_sharing_a_pinned_secret_and_seed_are_refused_before_any_work",)),
    Mutant("typed-inside-a-dict-dropped", "a value typed inside a dict argument of a replaced _target_ "
           "(model.config.vocab_size=64) drops the whole argument", "workbench/overrides.py",
           'k == mine or k.startswith(mine + ".")', "k == mine",
           ("tests/test_refusals_up_front.py::test_a_value_typed_inside_a_dict_argument_keeps_the_whole_argument",)),
    Mutant("sweep-candidates-forget-the-typed-keys", "random stopping's candidates are planned without the keys the "
           "user typed: an undrawn point enters the best-of-K bound with another q", "workbench/sweep/driver.py",
           "cfg.hydra.runtime.choices, list(cfg.hydra.overrides.task))", "cfg.hydra.runtime.choices)",
           ("tests/test_sweeps.py::test_a_candidate_is_planned_with_the_values_the_user_typed",)),
    Mutant("peers-share-one-key-across-runs", "a torchrun job's later run reads an earlier run's stop counts and "
           "refusal (one store for the job)", "workbench/interrupt.py",
           'store = PrefixStore(f"workbench.run.{run_key}.", store)', 'store = PrefixStore("workbench.run.", store)',
           ("tests/test_refusals_up_front.py::test_rank_0_tells_its_refusal_and_a_peer_stays_quiet_only_on_the_same_line",)),
    Mutant("sampler-count-binomial-n-minus-1", "the Poisson batch's count is Binomial(n - 1, q): every example is drawn "
           "at rate q (n - 1) / n, not the q accounted (issue 44)", "workbench/privacy/sampling.py",
           "k = int(rng.binomial(n, q))", "k = int(rng.binomial(n - 1, q))",
           ("tests/test_sampling.py::test_the_batch_size_is_binomial_n_q[small]",)),
    Mutant("sampler-never-picks-the-last-index", "the Poisson batch's first draw of distinct indices leaves out the "
           "shard's last position: that example's rate is not q (issue 44)", "workbench/privacy/sampling.py",
           "drawn = rng.integers(0, n, size=k)", "drawn = rng.integers(0, n - 1, size=k)",
           ("tests/test_sampling.py::test_each_example_is_included_binomial_t_q_times[small]",)),
    Mutant("sampler-draws-with-replacement", "the Poisson batch takes the distinct values of K draws with replacement: "
           "fewer than K examples, inclusions no longer independent (issue 44)", "workbench/privacy/sampling.py",
           "        if len(values) >= k:\n", "        if True:\n",
           ("tests/test_sampling.py::test_the_batch_size_is_binomial_n_q[small]", "tests/test_sampling.py::test_the_batch_size_is_binomial_n_q[per_rank]")),
    Mutant("resume-under-another-sampler", "a checkpoint written by another batch sampler (the float32 uniform per "
           "example before issue 44) resumes, drawing other batches than the run it continues", "workbench/job.py",
           'if state.get("sampler") != sampling.SAMPLER:', "if False:",
           ("tests/test_resume.py::test_resume_refusals",)),
    Mutant("step-ignores-the-plans-noise", "the step adds its own independent Gaussian noise, not the noise the plan "
           "hands it: a registered mechanism's (or bandmf's) noise is never added", "workbench/step.py",
           "make_noise = noise or (", "make_noise = None or (",
           ("tests/test_mechanism_registry.py::test_a_registered_mechanism_trains_through_the_job_and_reports_dp_"
            "accountings_epsilon",)),
    Mutant("user-level-for-any-mechanism", "privacy.unit=user runs a registered mechanism that did not declare it "
           "(users.py would sample users by plain Poisson, whatever its own sampler)", "workbench/privacy/mechanism.py",
           'if get("unit", "example") != "example" and not spec.user_level:', "if False:",
           ("tests/test_mechanism_registry.py::test_a_registered_mechanisms_refusal_is_asked_before_any_work",)),
    Mutant("pre-run-check-reads-every-row", "the pre-run data check reads the whole training set, not its first FIRST "
           "examples: O(N) before the run (a 1e8-row memmap read whole)", "workbench/data/checks.py",
           "first_examples(dataset, FIRST, collator) if indices is None",
           "first_examples(dataset, len(dataset), collator) if indices is None",
           ("tests/test_memmap.py::test_a_memmap_trains_reading_only_the_rows_each_step_drew[1000000]",)),
    Mutant("in-memory-scan-unbounded", "the pre-run scan of an in-memory tensor dataset reads every row: its memory "
           "grows with N (a mask of N values per check)", "workbench/data/checks.py",
           "scanned = tuple(t[:SCAN] for t in tensors) if whole", "scanned = tuple(tensors) if whole",
           ("tests/test_memmap.py::test_the_in_memory_scan_reads_the_first_scan_rows_only",)),
)


def apply(mutant: Mutant, root: Path) -> None:
    """Apply ``mutant`` to the tree at ``root``; raise if its target text is missing or ambiguous."""
    path = root / mutant.path
    text = path.read_text()
    found = text.count(mutant.old)
    if found != 1:
        raise LookupError(f"mutant {mutant.name}: {mutant.path} has the target text {found} times, not once: "
                          f"update tests/mutants.py to where the code moved ({mutant.old!r})")
    path.write_text(text.replace(mutant.old, mutant.new))


def scratch_copy(dest: Path) -> None:
    """This working tree's tracked and untracked, not ignored, files (uncommitted edits included)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def pytest(root: Path, node_ids: list[str]) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                           *node_ids], cwd=root, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list or not chosen:
        for m in MUTANTS:
            print(f"{m.name:34} {m.path:22} {m.bug}")
        return 0 if args.list else 2

    root = Path(tempfile.mkdtemp(prefix="workbench-mutants-"))
    try:
        scratch_copy(root)
        killers = sorted({k for m in chosen for k in m.killers})
        print(f"baseline: {len(killers)} killing tests on the unmutated copy ({root})", flush=True)
        rc, output, seconds = pytest(root, killers)
        if rc != 0:
            print(output[-4000:])
            print(f"error: the killing tests must pass on the unmutated code (pytest exit {rc}); fix them first")
            return 1
        print(f"baseline passed in {seconds:.0f} s", flush=True)
        rows = []
        for m in chosen:
            original = (root / m.path).read_text()
            try:
                apply(m, root)
            except LookupError as e:
                rows.append((m, "NOT APPLIED", 0.0, str(e)))
                continue
            try:
                rc, output, seconds = pytest(root, list(m.killers))
            finally:
                (root / m.path).write_text(original)
            # pytest exit 1 = tests failed: killed. 0 = survived. Anything else (collection, usage) is an error.
            status = {0: "SURVIVED", 1: "killed"}.get(rc, f"ERROR (pytest exit {rc})")
            failed = [line.split()[1] for line in output.splitlines() if line.startswith("FAILED ")]
            rows.append((m, status, seconds, failed[0] if failed else output[-1500:] if rc > 1 else ""))
            print(f"  {m.name}: {status} ({seconds:.0f} s)", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept at {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'mutant':34} {'result':12} {'s':>4}  killed by / why")
    for m, status, seconds, detail in rows:
        print(f"{m.name:34} {status:12} {seconds:4.0f}  {detail if detail else ', '.join(m.killers)}")
    bad = [m.name for m, status, _, _ in rows if status != "killed"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutants killed" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
