#!/usr/bin/env python
"""Mutation check of edgeprune's core modules with mutmut (issue 17).

Each core module is mutated (mutmut 3.x: operators, numbers, comparisons, arguments, ...) and run
against its FAST relevant tests only (:data:`MODULES`). A mutant that no test kills either needs a
new test or is equivalent; docs/mutation.md lists the survivors of the last run and why.

Not part of the normal pytest run. Needs ``mutmut`` (not a project dependency):

    pip install "mutmut>=3.8,<4"
    python tools/mutation_check.py                       # the default (priority) modules
    python tools/mutation_check.py ranking plan flops    # chosen modules
    python tools/mutation_check.py --list                # the module -> tests map
    python tools/mutation_check.py --budget 120 --json /tmp/mutation.json solve_mlp

How it works: for every module a private copy of the repository (edgeprune/, exporters/, runners/,
devices/, tests/) is made under ``--workdir`` with a ``setup.cfg`` ``[mutmut]`` section that mutates
only that module's files and selects only its tests, and ``mutmut run`` is started there (so the
working tree is never modified, and other jobs running tests meanwhile are not affected). Lines
that raise an error (``raise UserError(...)`` etc.) are not mutated: the wording of error
messages is not what this check is about. mutmut mutates function bodies only (not module-level
constants or docstrings). Each module gets ``--budget`` seconds of wall time; mutants not reached
in time are reported as "not run".

Sampling (issue 43: ~5 s per mutant on a loaded 2-core box, thousands of mutants): with
``--sample N [--seed S]`` every mutant of the module is generated first (``mutmut run`` with a name
that matches no mutant generates them and collects the test map, then stops), and a uniform random
sample of N of them (seeded, :func:`sample_names`) is run with ``mutmut run <names...>``. The
summary then gives the population size, the sample's counts, the score among the sample's
non-equivalent mutants and its 95% Wilson interval (:func:`wilson`), an estimate for the module.
A sample cut short by ``--budget`` is no longer uniform (mutmut runs the fastest mutants first): give
it the time (the summary says STOPPED).

    python tools/mutation_check.py --sample 40 --seed 1 --budget 420 latency_table

Exit status: 0 when every module finished and every mutant that ran was killed or listed in
:data:`EQUIVALENT`; 1 otherwise (survivors, or a module that ran out of time); 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPY = ("edgeprune", "exporters", "runners", "devices", "tests", "pyproject.toml")

#: module -> (files to mutate, fast tests that exercise them: paths or node ids; "-k EXPR" allowed)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "solve_mlp": (["edgeprune/solve/mlp_ridge.py"],
                  ["tests/test_solvers.py", "tests/test_known_answers.py", "tests/test_mutation_extras.py"]),
    "solve_qk": (["edgeprune/solve/qk_logit.py"],
                 ["tests/test_solvers.py", "tests/test_known_answers.py", "tests/test_mutation_extras.py"]),
    "solve_cg": (["edgeprune/solve/qk_logit_cg.py"],
                 ["tests/test_qk_cg.py::test_cg_matches_cholesky",
                  "tests/test_qk_cg.py::test_cg_reports_non_convergence_and_rejects_bad_input",
                  "tests/test_qk_cg.py::test_cg_zero_rhs_gives_zero_compensation",
                  "tests/test_qk_cg.py::test_ridge_lambda_without_forming_the_system_equals_mean_diagonal",
                  "tests/test_cg_mutants.py"]),
    "ranking": (["edgeprune/ranking/scores.py", "edgeprune/ranking/builtin.py"],
                ["tests/test_known_answers.py", "tests/test_mutation_extras.py"]),
    "plan": (["edgeprune/plan.py"],
             ["tests/test_known_answers.py", "tests/test_mutation_extras.py",
              "tests/test_corp_pipeline.py::test_rounding_and_its_errors"]),
    "flops": (["edgeprune/flops.py"],
              ["tests/test_known_answers.py", "tests/test_mutation_extras.py"]),
    "runner_stats": (["runners/base.py", "runners/compare.py", "runners/report.py"],
                     ["tests/test_known_answers.py", "tests/test_mutation_extras.py",
                      "tests/test_runners.py::test_summarize_latencies_linear_interpolation",
                      "tests/test_runners.py::test_ratio_stats_are_per_pair"]),
    "calibration": (["edgeprune/calibration/mlp_stats.py", "edgeprune/calibration/qk_stats.py", "edgeprune/solve/gram.py"],
                    ["tests/test_calibration_mutants.py", "tests/test_solvers.py", "tests/test_known_answers.py",
                     "tests/test_distributed.py::test_recentred_halves_equal_one_pass",
                     "tests/test_prune_cost.py::test_symmetric_gram_is_the_full_product_and_accumulates",
                     "tests/test_prune_cost.py::test_covariance_matches_float64_reference_over_batches",
                     "tests/test_prune_cost.py::test_without_positive_count_active_prob_raises_and_the_rest_is_unchanged",
                     "tests/test_prune_cost.py::test_fused_qk_grams_equal_per_head_products"]),
    "verify": (["exporters/verify.py"],
               ["tests/test_known_answers.py", "tests/test_mutation_extras.py"]),
    "nuwa": (["edgeprune/nuwa/ofp_mha.py", "edgeprune/nuwa/budget.py"],
             ["tests/test_known_answers.py", "tests/test_mutation_extras.py", "tests/test_nuwa_mutants.py",
              "tests/test_nuwa.py::test_rank_for_energy_floors_to_multiple_of_8",
              "tests/test_nuwa.py::test_adaptive_rho_grid_hits_every_dim_change",
              "tests/test_nuwa.py::test_svd_truncation_is_eckart_young_with_scale_fold"]),
    "heal_alignment": (["edgeprune/heal/alignment.py"],
                       ["tests/test_heal.py::test_alignment_loss_is_eq1",
                        "tests/test_heal.py::test_block_capture_gives_post_residual_block_outputs",
                        "tests/test_heal_mutants.py"]),
    "surgery": (["edgeprune/surgery.py"],
                ["tests/test_corp_pipeline.py::test_keeping_every_dim_through_the_full_solve_and_surgery_is_exact",
                 "tests/test_known_answers.py", "tests/test_surgery_mutants.py"]),
    # (test_corp_pipeline's save/load round trip prunes fmnist-vit first: too slow per mutant;
    # test_artifact_mutants.py has its own round trip and interrupted save)
    "artifact": (["edgeprune/artifact.py"], ["tests/test_artifact_mutants.py"]),
    # select.py is not mutated: they fold real models and measure output errors
    # (tests/test_allocation_select.py), too slow per mutant
    "allocation": (["edgeprune/budget/parse.py", "edgeprune/budget/budget.py", "edgeprune/budget/registry.py",
                    "edgeprune/budget/flops.py", "edgeprune/budget/params.py",
                    "edgeprune/allocation/curves.py", "edgeprune/allocation/greedy.py",
                    "edgeprune/allocation/report.py"],
                   # (the rest of test_allocation.py prunes models or runs the CLI: 0.2-30 s per test)
                   ["tests/test_allocation_mutants.py",
                    "tests/test_allocation.py::test_budget_values_parse",
                    "tests/test_allocation.py::test_prefix_errors_equal_the_fold_error_computed_directly",
                    "tests/test_allocation.py::test_qk_curve_is_the_diagonal_m_least_squares_residual"]),
    # --- issue 43: the embed slicing and the quantization code (tests/test_embed_quant_mutants.py) ---
    # (test_embed.py's prune/CLI/save-load tests and test_smooth.py's fmnist ViT tests: too slow per mutant)
    "embed": (["edgeprune/embed/fold.py", "edgeprune/embed/rotate.py", "edgeprune/embed/slice.py",
               "edgeprune/embed/covariance.py"],
              # (test_embed.py's sparsity-0 and subspace slices: 3-7 s each under load; TestEmbed has
              # the same checks on a smaller model)
              ["tests/test_embed_quant_mutants.py::TestEmbed",
               "tests/test_embed.py::test_folds_are_exact_and_make_every_norm_an_rmsnorm",
               "tests/test_embed.py::test_ones_complement_and_basis_are_orthogonal_to_ones",
               "tests/test_embed.py::test_kept_dim_and_refusals"]),
    # (stats.py's ActStats.rescale / alias -- the folds' effect on the int8 ranges -- are tested by
    # test_smooth_stats_rescale_and_alias_by_hand, but not mutated: the whole file is ~200 more mutants)
    "smoothquant": (["exporters/quantization/smoothing.py", "exporters/quantization/smoothing_explicit.py"],
                    ["tests/test_embed_quant_mutants.py::TestSmoothQuant",
                     "tests/test_embed_quant_mutants.py::TestSmoothQuantSampled",
                     "tests/test_smooth.py::test_smoothing_keeps_the_float_model_and_moves_the_range",
                     "tests/test_smooth.py::test_scales_follow_smoothquant_eq4",
                     "tests/test_smooth.py::test_absmax_is_the_per_channel_max",
                     "tests/test_smooth.py::test_a_norm_read_by_value_elsewhere_is_left_alone",
                     "tests/test_int8_tensorrt.py::test_alpha_search_smooths_an_outlier_channel"]),
    "gptq": (["exporters/quantization/weight_rounding.py"],
             ["tests/test_embed_quant_mutants.py::TestGPTQ",
              "tests/test_int8_rounding.py::test_gptq_equals_nearest_for_white_inputs",
              "tests/test_int8_rounding.py::test_gptq_lowers_the_output_error_on_correlated_inputs",
              "tests/test_int8_rounding.py::test_unknown_weight_rounding_is_one_line"]),
    # (only the lines these tests run: the rest of recipe_tensorrt.py is the ONNX pipeline)
    "quant_fallback": (["exporters/quantization/recipe_tensorrt.py"],
                       ["tests/test_embed_quant_mutants.py::TestFallback",
                        "tests/test_int8_tensorrt.py::test_fallback_takes_the_most_error_per_flop_within_the_flop_cap"]),
    # --- end of issue 43's block ---
    # --- issue 43: the latency / allocation code (kept in one block; tests/test_latency_mutants.py) ---
    "latency_table": (["edgeprune/latency/build.py", "edgeprune/latency/table.py", "edgeprune/latency/grid.py",
                       "edgeprune/latency/selfcheck.py", "edgeprune/latency/timing_checks.py"],
                      # (the CLI builds, the real tiny build and the interleave test time real models: 1-4 s each)
                      ["tests/test_latency_mutants.py",
                       "tests/test_latency_table.py::test_interpolation_equals_the_measured_points",
                       "tests/test_latency_table.py::test_interpolation_is_linear_between_points",
                       "tests/test_latency_table.py::test_qk_equals_v_table_interpolates_on_the_diagonal",
                       "tests/test_latency_table.py::test_out_of_range_dims_are_user_errors",
                       "tests/test_latency_table.py::test_dense_ms_is_fixed_plus_depth_blocks",
                       "tests/test_latency_table.py::test_check_model_names_the_mismatch",
                       "tests/test_latency_table.py::test_save_load_round_trip",
                       "tests/test_latency_table.py::test_load_bad_files",
                       "tests/test_latency_table.py::test_load_refuses_a_malformed_grid",
                       "tests/test_latency_table.py::test_grid_for_deit_small_on_cpu_is_bounded_and_on_the_rules",
                       "tests/test_latency_table.py::test_gpu_grid_times_only_the_diagonal",
                       "tests/test_latency_table.py::test_grid_keeps_a_dense_width_off_the_rule",
                       "tests/test_latency_table.py::test_resume_skips_measured_entries",
                       "tests/test_latency_table.py::test_another_key_is_refused_without_force",
                       "tests/test_latency_table.py::test_statistic_min_is_the_fastest_run_and_is_part_of_resume",
                       "tests/test_latency_table.py::test_auto_clock_is_cpu_for_one_cpu_thread",
                       "tests/test_latency_selfcheck.py::test_without_the_overhead_term_the_table_would_not_add_up",
                       "tests/test_latency_selfcheck.py::test_a_hand_table_that_does_not_add_up_is_refused_on_load",
                       "tests/test_latency_selfcheck.py::test_a_complete_table_with_parts_measured_but_missing_is_refused",
                       "tests/test_latency_selfcheck.py::test_a_forced_table_loads_although_its_parts_do_not_add_up",
                       "tests/test_latency_selfcheck.py::"
                       "test_a_table_without_the_new_fields_loads_and_prices_exactly_as_before",
                       "tests/test_latency_selfcheck.py::test_spread_check_times_a_noisy_entry_again",
                       "tests/test_latency_selfcheck.py::test_build_records_a_noisy_entry"]),
    "latency_cost": (["edgeprune/budget/latency.py"],
                     # (test_latency_budget.py's allocations calibrate a model: ~10 s per mutant)
                     ["tests/test_latency_mutants.py",
                      "tests/test_latency_budget.py::test_bad_inputs_fail_in_one_line_before_calibration"]),
    "rules": (["edgeprune/allocation/rules.py", "devices/kernels.py"],
              ["tests/test_latency_mutants.py",
               "tests/test_trt_kernel_rules.py::test_gpu_profiles_carry_tensorrts_rule_per_precision",
               "tests/test_trt_kernel_rules.py::test_cpu_profile_has_no_head_dim_rule",
               "tests/test_trt_kernel_rules.py::test_a_tensorrt_profile_without_the_rule_gets_tensorrts",
               "tests/test_trt_kernel_rules.py::test_bad_rule_values_refused_in_one_line",
               "tests/test_trt_kernel_rules.py::test_head_dims_not_a_table_refused",
               "tests/test_trt_kernel_rules.py::test_allocator_grid_keeps_round_to_and_the_dense_dim",
               "tests/test_trt_kernel_rules.py::test_latency_grid_times_only_the_allowed_head_dims"]),
    # select.py: its measured selection folds real models (tests/test_allocation_select.py, too slow per mutant):
    # its mutants count as "no tests" (the strict score)
    "greedy_heads": (["edgeprune/allocation/greedy.py", "edgeprune/allocation/select.py",
                      "edgeprune/allocation/unit_curves.py"],
                     ["tests/test_latency_mutants.py", "tests/test_allocation_mutants.py",
                      "tests/test_allocation_select_fast.py",  # select.py's measured selection, tiny model
                      "tests/test_latency_budget.py::test_heads_cheap_to_remove_dims_not_removes_heads",
                      "tests/test_latency_budget.py::test_dims_expensive_heads_free_shrinks_dims",
                      "tests/test_latency_budget.py::test_predicted_latency_within_budget_and_monotone",
                      "tests/test_latency_budget.py::test_qk_solutions_are_reused_across_candidates"]),
    "derive_latency": (["edgeprune/nuwa/budget.py", "edgeprune/nuwa/measured.py"],
                       # (the tests on test_derive_latency.py's `prep` run SKP and calibration: seconds per mutant)
                       ["tests/test_latency_mutants.py",
                        "tests/test_derive_latency.py::test_qk_equals_v_takes_the_larger_dim",
                        "tests/test_derive_latency.py::test_search_equals_closed_form_on_flops",
                        "tests/test_derive_latency.py::test_impossible_budget_and_api_errors"]),
    "latency_loop": (["edgeprune/budget/correction_loop.py"],
                     # (the rest of test_latency_loop.py prunes a model per round: seconds per mutant)
                     ["tests/test_latency_mutants.py", "tests/test_latency_loop.py::test_next_value_steps",
                      "tests/test_latency_loop.py::test_bad_correction_settings_are_refused_before_any_pass"]),
    # --- end of issue 43 block ---
}

#: what runs without arguments, in this order (the issue's priorities first)
DEFAULT = ("solve_mlp", "solve_qk", "ranking", "plan", "flops", "runner_stats")

#: modules whose files hold much more than the statistics under test: mutate only the lines the
#: selected tests execute (mutmut's ``mutate_only_covered_lines``)
COVERED_LINES_ONLY = {"runner_stats", "verify", "surgery", "artifact", "nuwa", "allocation",
                      # issue 43: derive_latency (nuwa/budget.py is also the FLOPs/params search of "nuwa")
                      "derive_latency"}
COVERED_LINES_ONLY |= {"quant_fallback"}  # issue 43: recipe_tensorrt.py is mostly the ONNX pipeline

#: mutants judged equivalent (same behaviour for every input the code can get), with the reason;
#: keyed by the diff line that mutmut shows (``+`` side, stripped). See docs/mutation.md.
EQUIVALENT: dict[str, str] = {
    # budget.rho_candidates: with len(lv) == n the evenly spaced down-sample picks 0..n-1 (all of lv)
    "if len(lv) >= n:": "down-sampling n of n levels returns the same list",
    "order = torch.sort(scores, descending=True, stable=True).indices[..., :k]":
        "torch.sort's default dim is -1 (the same call)",
    "return torch.sort(order, ).values": "torch.sort's default dim is -1 (the same call)",
    # summarize_latencies: pstdev of one value is 0.0, so the len > 1 guard only avoids the call
    '"std": float(statistics.pstdev(arr.tolist())) if (len(arr) > 1) or True else 0.0,':
        "pstdev([x]) == 0.0: same result for one latency",
    '"std": float(statistics.pstdev(arr.tolist())) if len(arr) >= 1 else 0.0,':
        "pstdev([x]) == 0.0: same result for one latency",
    # np.asarray of latencies without dtype: ints/floats both give float64 statistics below
    "arr = np.asarray(latencies_ms, dtype=None)": "percentile/mean/min/max are cast to float anyway",
    "arr = np.asarray(latencies_ms, )": "percentile/mean/min/max are cast to float anyway",
    "a = np.asarray(latencies_a, dtype=None)": "a / float array is float64 anyway",
    "a = np.asarray(latencies_a, )": "a / float array is float64 anyway",
    "b = np.asarray(latencies_b, dtype=None)": "np.maximum(b, 1e-12) is float64 anyway",
    "b = np.asarray(latencies_b, )": "np.maximum(b, 1e-12) is float64 anyway",
    # qk_logit: shapes are square / (N, d', d') as documented; float32 identity is exact
    "r, sig, th = torch.linalg.svd(torch.eye(d, dtype=None) + m.double())":
        "float32 identity is exact and the sum with float64 M is float64",
    "r, sig, th = torch.linalg.svd(torch.eye(d, ) + m.double())":
        "float32 identity is exact and the sum with float64 M is float64",
    "tr = (torch.diagonal(gq_ss, dim1=-2, dim2=-1).sum(+1).double()":
        "the diagonal of the documented (N, d', d') input is (N, d'): axis 1 is axis -1",
    "* torch.diagonal(gk_ss, dim1=-2, dim2=-1).sum(+1).double()).sum()":
        "the diagonal of the documented (N, d', d') input is (N, d'): axis 1 is axis -1",
    "d = gq_ss.shape[+1]": "(N, d', d'): shape[1] == shape[-1]",
    "d = gq_ss.shape[-2]": "(N, d', d'): shape[-2] == shape[-1]",
    "d = rhs.shape[1]": "rhs is square (d', d')",
    # exporters/verify.compare_outputs
    "a = onnx_out.astype(None)": "numpy's astype(None) is float64",
    "b = torch_out.astype(None)": "numpy's astype(None) is float64",
    "flat_a = a.reshape(a.shape[0], -2)": "numpy treats any negative size as the inferred one",
    "flat_b = b.reshape(b.shape[0], -2)": "numpy treats any negative size as the inferred one",
    # nuwa.ofp_mha.energy_ratios / rank_for_energy: (H, d) input, 1e-9 slack on rho
    "tot = e.sum(+1, keepdim=True)": "s is (H, d): axis 1 is axis -1",
    "ratio = torch.where(tot > 0, e.cumsum(+1) / tot.clamp_min(1e-300), torch.ones_like(e))":
        "s is (H, d): axis 1 is axis -1",
    "ok = (ratios > rho - 1e-9).nonzero()":
        "differs only when a ratio equals rho - 1e-9 exactly (the slack exists to absorb round-off)",
    # plan.kept_heads: ``what`` is never used; sparsity 0 is a fast path of the same formula
    'def kept_heads(num_heads: int, sparsity: float, what: str = "XXattentionXX") -> int:':
        "the parameter `what` is unused in kept_heads",
    'def kept_heads(num_heads: int, sparsity: float, what: str = "ATTENTION") -> int:':
        "the parameter `what` is unused in kept_heads",
    "if sparsity == 1:": "in kept_heads, round(H * (1 - 0)) = H: the sparsity-0 branch is a fast path "
                         "(sparsity 1 is rejected before)",
    # mlp_ridge.fold_into_linear
    "if b is not None and c is not None and len(prune) >= 0:":
        "with no pruned channel W_P B and W_P c are empty products (zeros): same result",
    "bias64 = torch.zeros(w.shape[0], dtype=None) if bias is None else bias.double()":
        "float32 zeros + float64 W_P c promotes to float64; zeros are exact in any dtype",
    "bias64 = torch.zeros(w.shape[0], ) if bias is None else bias.double()":
        "float32 zeros + float64 W_P c promotes to float64; zeros are exact in any dtype",
    # qk_logit_cg: pinning 1 thread when there already is 1 (the two float-equality boundaries
    # `rel < tol` / `rel < tol * 10` are killed by tests/test_cg_mutants.py, not equivalent)
    'pin = gq_ss.device.type == "cpu" and threads >= 1':
        "with 1 thread, setting 1 thread and restoring 1 changes nothing",
    # heal.alignment: cosine_similarity's defaults are dim=1, eps=1e-8 (= COS_EPS); _stop is only
    # tested for truth (`if last and self._stop`), so None acts as False (in __init__ and in run)
    "per = 1.0 - F.cosine_similarity(a, b, eps=COS_EPS)": "cosine_similarity's default dim is 1",
    "per = 1.0 - F.cosine_similarity(a, b, dim=1, )": "cosine_similarity's default eps is 1e-8 == COS_EPS",
    "self._stop = None": "`_stop` is only tested for truth: None acts as False",
    # surgery.qkv_parts
    "wq, wk, wv = w.split([H * dq, H * dq, H * dv], )": "torch.split's default dim is 0 (the same call)",
    # artifact.check_writable: the probe file's name and content are never observable (it is
    # created, written and removed within the call); Path("") == Path(".")
    'fd, probe = tempfile.mkstemp(prefix=None, dir=d)': "the probe's name is not observable",
    'fd, probe = tempfile.mkstemp(dir=d)': "the probe's name is not observable",
    'fd, probe = tempfile.mkstemp(prefix="XX.edgeprune-probe.XX", dir=d)': "the probe's name is not observable",
    'fd, probe = tempfile.mkstemp(prefix=".EDGEPRUNE-PROBE.", dir=d)': "the probe's name is not observable",
    'os.write(fd, b"XXxXX")': "the probe's content is not observable",
    'os.write(fd, b"X")': "the probe's content is not observable",
    'd = Path(folder) if (str(folder)) or True else Path(".")': 'Path("") == Path("."): the fallback is the same path',
    'd = Path(folder) if str(None) else Path(".")': 'Path("") == Path("."): the fallback is the same path',
    # artifact.load_run / save_run: falsy None and the defaults are the values written out
    "model = spec.create(pretrained=None)": "ModelSpec.create tests `if pretrained and ...`: None is False",
    "model.load_state_dict(state, )": "load_state_dict's default is strict=True",
    '(tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=None, default=str) + "\\n")':
        "json.dumps treats sort_keys=None as False",
    '(tmp / RECORD).write_text(json.dumps(record, indent=2, default=str) + "\\n")':
        "json.dumps's default is sort_keys=False",
    # calibration.symmetric_gram: at d == block the block-row loop runs once with the same product,
    # mirrored and added to all of out; the `i + block < d` guard only skips an empty update
    # (out[i + block:, ...] and g[:, block:] are both empty when i + block >= d)
    "if d < block:": "at d == block the loop does one block row: the same GEMM, mirrored, added to all of out",
    "if i - block < d:": "when i + block >= d the guarded update adds an empty slice to an empty slice",
    "if i + block <= d:": "when i + block == d the guarded update adds an empty slice to an empty slice",
    # calibration.MLPStatistics: with second_order=False `_gram` is an unread placeholder (variance
    # reads `_sq`, cov raises, distributed.reduce_statistics reads `_sq`); any empty tensor does
    "self._gram = torch.zeros(dim, dim, **f64) if second_order else torch.zeros(0, **f64)":
        "the second_order=False placeholder `_gram` is never read",
    "self._gram = torch.zeros(dim, dim, **f64) if second_order else torch.zeros(0, 0, )":
        "the second_order=False placeholder `_gram` is never read",
    "self._gram = torch.zeros(dim, dim, **f64) if second_order else torch.zeros(1, 0, **f64)":
        "the second_order=False placeholder `_gram` is never read",
    "self._gram = torch.zeros(dim, dim, **f64) if second_order else torch.zeros(0, 1, **f64)":
        "the second_order=False placeholder `_gram` is never read",
    # allocation: scores are (H, d_v); make_budget's kind default; getattr default None is falsy
    "rank = torch.sort(scores, descending=True, stable=True).indices  # (H, d_v)":
        "torch.sort's default dim is -1 (the same call)",
    "rank = torch.sort(scores, dim=+1, descending=True, stable=True).indices  # (H, d_v)":
        "scores are (H, d_v): dim 1 is dim -1",
    'return {"kind": "flops", "value": parse_budget_value(flops, )}':
        'parse_budget_value\'s default kind is "flops" (the same call)',
    'if not getattr(qk_stats, "keep_grams", None) or not getattr(qk_stats, "_gq", None):':
        "a missing keep_grams reads as None instead of False: both falsy",
    # report.rounding_warnings: the "mlp" key is only a tag (the dedup set; the fused test looks for
    # "qk" / "v"); sparsity 0 keeps every dim / head (achieved 0: no warning; round_to >= 1 is
    # enforced by CorpConfig.validate)
    'what = {"XXmlpXX": ("MLP hidden channels", "mlp_sparsity", "mlp_hidden"),':
        'the MLP entry\'s key is only a tag (dedup; not "qk"/"v")',
    'what = {"MLP": ("MLP hidden channels", "mlp_sparsity", "mlp_hidden"),':
        'the MLP entry\'s key is only a tag (dedup; not "qk"/"v")',
    "if s < 0 or (key, dense, s) in seen:": "sparsity 0 keeps every dim: achieved 0, no warning",
    'if s >= 0 and ("heads", b.num_heads, s) not in seen:': "head sparsity 0 keeps every head: no warning",
    # greedy.allocate: min() keeps the first of equal keys, and "greedy" is inserted first
    'chosen = min(candidates, key=lambda k: (candidates[k].error, k != "XXgreedyXX"))':
        "on a tie min() returns the first candidate, which is greedy",
    'chosen = min(candidates, key=lambda k: (candidates[k].error, k != "GREEDY"))':
        "on a tie min() returns the first candidate, which is greedy",
    # greedy._descend / _fill: the candidate keys end with the candidate index p (and u), so two
    # keys compared in one scan are never equal
    "if cand is None or key <= cand:": "keys include the candidate index: never equal within one scan",
    "for i in range(1000):": "range(1000) == range(0, 1000)",
    # greedy.base_dims: the plain config only feeds attention_dims / attention_sparsities, which
    # test `layout == "fused"` and nothing else; replacing "default" by "default" is a copy
    'plain = dataclasses.replace(cfg, layout="default") if (cfg.layout == "fused") or True else cfg':
        'a copy of a default-layout config with layout="default" is the same config',
    'plain = dataclasses.replace(cfg, layout=None) if cfg.layout == "fused" else cfg':
        'the consumers only test layout == "fused"',
    'plain = dataclasses.replace(cfg, layout="XXdefaultXX") if cfg.layout == "fused" else cfg':
        'the consumers only test layout == "fused"',
    'plain = dataclasses.replace(cfg, layout="DEFAULT") if cfg.layout == "fused" else cfg':
        'the consumers only test layout == "fused"',
    # greedy.build_curves, fused units: tie_curves keeps the counts both curves have, and the
    # default candidates of Q/K and V (multiples of round_to and each one's own dim) have exactly
    # the filtered list in common; E(k) at a given k and the scale do not depend on the list
    "ks = None": "fused: tie_curves intersects the default Q/K and V candidates to the same list",
    'qc, vc = qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, None), v_curve(b, _need(stats.vo, b, "V/O"), cfg, ks)':
        "fused: tie_curves intersects the default Q/K candidates with the V ones to the same list",
    'qc, vc = qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, ), v_curve(b, _need(stats.vo, b, "V/O"), cfg, ks)':
        "fused: tie_curves intersects the default Q/K candidates with the V ones to the same list",
    'qc, vc = qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, ks), v_curve(b, _need(stats.vo, b, "V/O"), cfg, None)':
        "fused: tie_curves intersects the default V candidates with the Q/K ones to the same list",
    'qc, vc = qk_curve(b, _need(stats.qk, b, "Q/K"), cfg, ks), v_curve(b, _need(stats.vo, b, "V/O"), cfg, )':
        "fused: tie_curves intersects the default V candidates with the Q/K ones to the same list",
    "order = torch.sort(scores, descending=True, stable=True).indices": "torch.sort's default dim is -1 (the same call)",
    "order = torch.sort(scores, dim=+1, descending=True, stable=True).indices": "scores are (H, d): dim 1 is dim -1",
    "l, info = torch.linalg.cholesky_ex(a + jitter * torch.eye(a.shape[1], dtype=a.dtype))": "a is square",
    # errors.normalise: `residual` and `energy[c.block] or ...` are read only when every block's
    # energy is known and > 0
    "total += e or 1.0": "the residual sums are used only when every energy is known and > 0",
    "c.scale = e0 * residual[c.block] / (qk_weight * float(energy[c.block] or 2.0))":
        "this branch runs only when every energy is known and > 0",
    'gamma = getattr(layer_scale, "gamma", None) if (layer_scale is not None) or True else None':
        "getattr(None, 'gamma', None) is None",
    # --- issue 43: embed, smoothquant, gptq, quant_fallback (docs/mutation.md, its section) ---
    # weight_rounding.round_weights: exported weights are float32 (or float16) initializers, whose
    # float32 and float64 copies hold the same values (GPTQ works in float64, scales are float32)
    "s64 = s.astype(None)": "numpy's astype(None) is float64 (the same cast)",
    "q[k] = qk.astype(None)": "q is int8: the row of whole numbers in [-127, 127] is cast on assignment",
    "w = numpy_helper.to_array(inits[g.w]).astype(None)":
        "float32/float16 initializers: the float64 copy holds the same values as the float32 one",
    # recipe_tensorrt: GemmNode.flops_per_image divides the rows by the batch n = shape[0]
    # (MatMul/Gemm: prod(shape) // (n k); Conv: the spatial axes only), so the default shape's batch
    # size does not matter; a FLOP total of 0 means every row has 0 FLOPs (numerator 0)
    "flops = g.flops_per_image(stats.shapes.get(g.x, (2, 1, g.k)))":
        "flops_per_image divides the batch size out: (2, 1, k) and (1, 1, k) give one row",
    'return [{"node": g.name, "flops": g.flops_per_image(stats.shapes.get(g.x, (2, 1, g.k))),':
        "flops_per_image divides the batch size out: (2, 1, k) and (1, 1, k) give one row",
    'total = sum(r["flops"] for r in out) or 2.0':
        "a total of 0 FLOPs means every GEMM has 0: the int8 share is 0 / any positive number",
    'total_flops = sum(float(r["flops"]) for r in rows) or 2.0':
        "a total of 0 FLOPs means every row has 0: (used + 0) / any positive number is 0",
    '"rel_err": float("NAN")} for g in todo]': 'float("NAN") is float("nan")',
    # embed: the moment is square (D, D); slice_embed's `reference` is read only when refit is set
    # (and then it is the deep copy)
    "u = ones_complement(moment.shape[1])": "the moment is square (D, D)",
    'reference = ""': "`reference` is read only under `if refit`, where it is the deep copy",
    "if refit or reference is not None:": "reference is not None exactly when refit is set",
    # smoothing.choose_alpha: the max of a float32 |W| cast to float64 either way
    "w_amax = np.max(np.stack([np.abs(w).max(axis=1) for w in ws]), axis=0).astype(None)":
        "numpy's astype(None) is float64 (the same cast)",
    "return np.max(np.stack(ws), axis=0).astype(None)": "numpy's astype(None) is float64 (the same cast)",
    "err = output_error(x, ws, float((chan_amax / s).max()), None if (a is None) and False else s)":
        "for a = None, s is all ones: x / 1 and W * 1 are exact",
    "def smooth_onnx(src: Path, dst: Path, images: np.ndarray, alpha: float = 0.5, batch_size: int = 33,":
        "the batch size of the statistics pass: a per-channel max does not depend on the batching",
    "stats = collect_stats(src, [s.output for s in sites], images, rows=0, threads=threads)":
        "collect_stats's default batch size 8 for 32: a per-channel max does not depend on the batching",
    # --- issue 43: the latency / allocation code (kept in one block) ---
    # allocation.rules.Grid.sizes: the candidates are multiples of a rounding >= 1 (and the dense size >= 1), so a
    # missing lower bound of 0 or 1 keeps the same list
    "return [k for k in ks if k >= self.lower.get(key, 1)] or [dense]":
        "candidate sizes start at round_to >= 1: a default bound of 1 drops nothing",
    # budget.correction_loop.correct: `target` is set in round 0 before it is read (the loop runs at least once,
    # max_rounds >= 0), and the loop ends at `k == max_rounds` before its range does
    "target = None": "overwritten in round 0 before any read",
    "target = 1.0": "overwritten in round 0 before any read",
    "for k in range(max_rounds + 2):": "the loop breaks at k == max_rounds: the extra round is never reached",
    # latency.table.LatencyTable.check_model: a field missing from the key must differ from the model's dim; no dim
    # is negative, so -1 and -2 both do
    "if int(self.key.get(name, -2)) != int(have[name]):": "no model dim is negative: -1 and -2 both differ",
    # nuwa.budget.DimGrid.allowed: the result is the least allowed dim >= k, else dense; adding dense to the list, or
    # taking the list at k == dense (all of it >= dense, so none kept), gives dense again
    "return min([d for d in self.head_dims if k <= d <= dense and d % self.head_dim == 0] or [dense])":
        "dense is the fallback anyway: the min is the same",
    "if self.head_dims is None or k > dense:": "at k == dense the rule branch returns dense too",
    # nuwa.measured.measure_and_correct: table_measurer returns a measurer or a reason, never neither
    'not_measured(first.record, budget, reason or "XXno measurerXX", view)': "the fallback reason is unreachable",
    'not_measured(first.record, budget, reason or "NO MEASURER", view)': "the fallback reason is unreachable",
    # (the sampled runs, docs/mutation.md "Issue 43 item 2")
    # budget.latency.LatencyCost._merged_tokens: the budget is a Budget, a dataclass whose field tokens_merge
    # defaults to None: getattr without a default reads the same value
    'elif getattr(budget, "tokens_merge", ) is not None:': "Budget always has the field tokens_merge (default None)",
    # nuwa.budget.dim_grid / check_feasible / smallest_dims: a table's rules always hold positive mlp_round_to and
    # head_dim_round_to (latency.schema: both required), so dim_grid's round_to is read only without rules, where
    # the callers use round_to itself (g.rules is None); the MLP's round-to is >= 1, so a lower bound of 0 or 1 is
    # the same max
    "g = dim_grid(cost, )": "with table rules dim_grid ignores round_to (required rules); without, only g.rules is read",
    'return DimGrid(rm, rh, bool(r.get("qk_equals_v")), _up(max(rm, lo.get("mlp", 1)), rm), qk_min, v_min, dict(r),':
        "rm = mlp_round_to >= 1 (schema: positive): max(rm, 0) == max(rm, 1)",
    # allocation.greedy.allocate: without a cost model unit_grid builds the budget's own; the grid reads only its
    # rules and bounds (the table's), which the class-token plan does not change
    "grid = unit_grid(cfg, anatomy, )": "unit_grid makes cfg.budget's cost model: the same table rules and bounds",
    # budget.latency.LatencyCost._block_cost: a class-token block (query_tokens) is the last one, which never merges
    # (tokens.schedule.plan_merges / tokens.apply.merge_plan give it r = 0): its attention and MLP counts are equal
    "n = self.n if merged is None else merged[b.index][1]":
        "a class-token last block has r = 0: the MLP sees the attention's token count",
    # budget.correction_loop.next_value: with m != m0, a quotient and a product of the two differences share their sign
    "if m != m0 and (p - p0) * (m - m0) > 0:  # a rising m(p): the secant": "(a / b > 0) == (a * b > 0) for b != 0",
    # latency.table.LatencyTable.save: json's encoder refuses a NaN when allow_nan is falsy (None as False)
    'atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=None) + "\\n", fsync=True)':
        "json checks `if not allow_nan`: None refuses NaN as False does",
    # budget.correction_loop: latency_check's reason defaults to None, and it reads "absolute" only with a measurement,
    # which not_measured never has
    'chk = latency_check({**view(rec)[0], "target": asked, "absolute": absolute}, measured, )':
        "latency_check's reason defaults to None",
    'rec["latency_check"] = latency_check({**lat, "XXabsoluteXX": budget.unit is not None}, None, reason)':
        'latency_check reads "absolute" only when measured is not None; not_measured passes None',
    'rec["latency_check"] = latency_check({**lat, "absolute": budget.unit is None}, None, reason)':
        'latency_check reads "absolute" only when measured is not None; not_measured passes None',
    # --- end of issue 43 block ---
}

DO_NOT_MUTATE_PATTERNS = (r"^\s*raise \w+(Error|Fault)\(",)


def _setup_cfg(files: list[str], tests: list[str], covered_only: bool) -> str:
    def block(key: str, values) -> str:
        return f"{key} =\n" + "".join(f"    {v}\n" for v in values)

    return ("[mutmut]\n"
            + block("source_paths", ["edgeprune", "exporters", "runners", "devices"])
            + block("only_mutate", files)
            + block("pytest_add_cli_args_test_selection", tests)
            + block("pytest_add_cli_args", ["-p", "no:cacheprovider", "-q"])
            + block("do_not_mutate_patterns", DO_NOT_MUTATE_PATTERNS)
            + "process_isolation = forkserver\n"
            + "use_git_change_detection = false\n"
            + "track_dependencies = false\n"
            + f"mutate_only_covered_lines = {'true' if covered_only else 'false'}\n")


def _prepare(name: str, workdir: Path) -> Path:
    files, tests = MODULES[name]
    d = workdir / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "mutants")
    for item in COPY:
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, d / item, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, d / item)
    missing = [f for f in files if not (d / f).exists()]
    if missing:
        raise SystemExit(f"{name}: {', '.join(missing)} not found (was the module moved? update MODULES)")
    (d / "setup.cfg").write_text(_setup_cfg(files, tests, name in COVERED_LINES_ONLY))
    return d


def _mutmut(d: Path, args: list[str], timeout: float | None, log) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([sys.executable, "-m", "mutmut", *args], cwd=d, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)  # our own process group only
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        return -1


def _results(d: Path) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=d,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    res = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if m:
            res[m.group(1)] = m.group(2).strip()
    return res


def _diff(d: Path, mutant: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=d, capture_output=True,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    lines = [ln for ln in out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    return "\n".join(lines)


#: a mutant name that matches nothing: ``mutmut run`` generates the mutants and the test map, then stops
NO_MUTANT = "edgeprune_mutation_check_list_only__mutmut_0"


def sample_names(population, n: int, seed: int) -> list[str]:
    """A uniform random sample of ``n`` mutant names (all of them when ``n >= len(population)``).

    Seeded and independent of the population's order (the names are sorted first); returned sorted."""
    names = sorted(set(population))
    return sorted(random.Random(seed).sample(names, min(n, len(names))))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion ``k / n`` (z = 1.96: 95%); None for n = 0.

    Source: E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
    JASA 22 (1927): centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n).
    Raises ValueError unless 0 <= k <= n."""
    if not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return None
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(res: dict[str, str], diff_of) -> dict:
    """Counts of one module's mutmut results ``{mutant: status}``; ``diff_of(mutant)`` gives a survivor's diff.

    A survivor is equivalent when the first ``+`` line of its diff is a key of :data:`EQUIVALENT`."""
    counts: dict[str, int] = {}
    for status in res.values():
        counts[status] = counts.get(status, 0) + 1
    survivors = []
    for m, status in sorted(res.items()):
        if status in ("survived", "suspicious"):
            diff = diff_of(m)
            plus = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+")), "")
            survivors.append({"mutant": m, "status": status, "diff": diff,
                              "equivalent": EQUIVALENT.get(plus)})
    killed = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("segfault", 0)
    ran = killed + counts.get("survived", 0) + counts.get("suspicious", 0)
    not_equivalent_survivors = [s for s in survivors if not s["equivalent"]]
    equivalent = len(survivors) - len(not_equivalent_survivors)
    score = killed / (ran - equivalent) if ran - equivalent > 0 else None
    no_tests = counts.get("no tests", 0)
    # strict score: mutants that no selected test even executes count as not killed
    strict = killed / (ran - equivalent + no_tests) if ran - equivalent + no_tests > 0 else None
    not_run = [m for m, st in res.items() if st in ("not checked", "no tests")]
    return {"counts": counts, "killed": killed, "ran": ran, "equivalent": equivalent,
            "no_tests": no_tests, "score": score, "strict_score": strict, "survivors": survivors,
            "not_run": sorted(not_run),
            "interval": wilson(killed, ran - equivalent),
            "strict_interval": wilson(killed, ran - equivalent + no_tests)}


def check_module(name: str, workdir: Path, budget: float, max_children: int,
                 sample: int | None = None, seed: int = 0) -> dict:
    """Run mutmut on one module (on a seeded sample of ``sample`` mutants if given); return its summary."""
    d = _prepare(name, workdir)
    t0 = time.perf_counter()
    population = sampled = None
    with open(d / "mutmut.log", "w") as log:
        if sample is None:
            rc = _mutmut(d, ["run", "--max-children", str(max_children)], budget, log)
        else:
            # generate every mutant and the test map; the run then stops (no mutant has this name)
            rc = _mutmut(d, ["run", "--max-children", str(max_children), NO_MUTANT], budget, log)
            every = _results(d) if rc != -1 and (d / "mutants").exists() else {}  # -1: out of budget
            population = len(every)
            sampled = sample_names(every, sample, seed)
            left = budget - (time.perf_counter() - t0)
            rc = -1 if not sampled or left <= 0 else _mutmut(
                d, ["run", "--max-children", str(max_children), *sampled], left, log)
    seconds = time.perf_counter() - t0
    res = _results(d) if (d / "mutants").exists() else {}
    if sampled is not None:
        res = {m: st for m, st in res.items() if m in set(sampled)}
    out = {"module": name, "files": MODULES[name][0], "tests": MODULES[name][1],
           "finished": rc == 0, "mutmut_rc": rc, "seconds": round(seconds, 1)}
    out.update(summarize(res, lambda m: _diff(d, m)))
    out["workdir"] = str(d)
    if sampled is not None:
        out.update({"population": population, "sample": len(sampled), "seed": seed, "sampled": sampled})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help=f"modules to check (default: {' '.join(DEFAULT)}; 'all' = every one)")
    ap.add_argument("--budget", type=float, default=240.0, help="wall-time seconds per module (default 240)")
    ap.add_argument("--max-children", type=int, default=1, help="parallel mutant workers (default 1)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "edgeprune-mutation",
                    help="where the per-module copies go (default $TMPDIR/edgeprune-mutation)")
    ap.add_argument("--json", type=Path, help="write the full summary (with survivor diffs) here")
    ap.add_argument("--list", action="store_true", help="print the module -> tests map and exit")
    ap.add_argument("--sample", type=int, metavar="N",
                    help="run a uniform random sample of N mutants per module (all are generated first)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's random seed (default 0)")
    args = ap.parse_args(argv)
    if args.sample is not None and args.sample < 1:
        print(f"--sample must be at least 1, got {args.sample}", file=sys.stderr)
        return 2
    if args.list:
        for name, (files, tests) in MODULES.items():
            print(f"{name}: {' '.join(files)}\n    tests: {' '.join(tests)}")
        return 0
    names = list(MODULES) if args.modules == ["all"] else (args.modules or list(DEFAULT))
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown module(s) {', '.join(unknown)} (choose from {', '.join(MODULES)} or all)", file=sys.stderr)
        return 2
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print('mutmut is not installed: pip install "mutmut>=3.8,<4"', file=sys.stderr)
        return 2
    summaries = []
    for name in names:
        print(f"== {name}: {' '.join(MODULES[name][0])} (budget {args.budget:g} s)", flush=True)
        s = check_module(name, args.workdir, args.budget, args.max_children, args.sample, args.seed)
        summaries.append(s)
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        ci = lambda v: "n/a" if v is None else f"[{100 * v[0]:.1f}%, {100 * v[1]:.1f}%]"  # noqa: E731
        if args.sample is not None:
            print(f"   sample {s['sample']} of {s['population']} mutants (seed {s['seed']}): "
                  f"score {pct(s['score'])}, 95% Wilson {ci(s['interval'])} of the non-equivalent that ran; "
                  f"strict {pct(s['strict_score'])} {ci(s['strict_interval'])}", flush=True)
        print(f"   {'finished' if s['finished'] else 'STOPPED (budget or error)'} in {s['seconds']:.0f} s: "
              f"{s['counts']}  score {pct(s['score'])} (killed {s['killed']} of {s['ran']} run, "
              f"{s['equivalent']} equivalent); strict {pct(s['strict_score'])} "
              f"(counting {s['no_tests']} mutants no selected test executes)", flush=True)
        if s["not_run"]:
            funcs = sorted({m.rsplit("__mutmut_", 1)[0] for m in s["not_run"]})
            print(f"   not run / no tests in: {', '.join(funcs)}", flush=True)
        for sv in s["survivors"]:
            tag = f"equivalent: {sv['equivalent']}" if sv["equivalent"] else "SURVIVED"
            print(f"   {tag}: {sv['mutant']}\n      " + sv["diff"].replace("\n", "\n      "), flush=True)
    killed = sum(s["killed"] for s in summaries)
    ran = sum(s["ran"] for s in summaries)
    eq = sum(s["equivalent"] for s in summaries)
    no_tests = sum(s["no_tests"] for s in summaries)
    total = f"{100 * killed / (ran - eq):.1f}%" if ran - eq > 0 else "n/a"
    strict = f"{100 * killed / (ran - eq + no_tests):.1f}%" if ran - eq + no_tests > 0 else "n/a"
    print(f"TOTAL: killed {killed} of {ran} mutants run ({eq} equivalent): score {total} of non-equivalent; "
          f"strict {strict} counting {no_tests} mutants without tests")
    if args.json:
        args.json.write_text(json.dumps({"modules": summaries, "killed": killed, "ran": ran,
                                         "equivalent": eq}, indent=1))
    bad = any(not s["finished"] or any(not sv["equivalent"] for sv in s["survivors"]) for s in summaries)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
