"""Planted bugs in the Metal launch: the kernels' source and the host's plan.

Each kernel mutant is the plan's header (the kernel file as MLX compiles it) with one
replacement; ``#line`` in the header keeps reported lines those of paged_attention.metal.
Each host mutant is the launch plan of ``metal_launch.cpp`` edited the way a bug in it
would edit it (a wrong grid, params out of order, a missing padding, a wrong template
argument, a wrong threadgroup). Every one must be caught, in the way the test expects: a
mismatch with the float64 reference, a difference between thread schedules, an
out-of-bounds or barrier report naming the buffer or the line, or a compile error.
Cases and launch helpers: tests/test_metal_kernels.py.

With ``--learner`` the kernel is the learner's: a bug planted in the code around the tasks is
planted there too, and one planted in a task's code (which the learner wrote their own way)
is skipped with the task's name, since only the reference holds its lines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tiny_llm.course import workspace as course

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from metal_emulator import (  # noqa: E402
    DEFAULT_SCHEDULES,
    BarrierError,
    MetalCompileError,
    OutOfBoundsError,
    ScheduleMismatch,
    run_plan,
)
from test_metal_kernels import (  # noqa: E402
    CASE_BY_NAME,
    PAGED,
    PLANS,
    TOLERANCE,
    MetalCase,
    close_to_ref,
    inputs,
    mx_inputs,
    needs_emulator,
    plan_for,
    run_case,
)

pytestmark = pytest.mark.device_independent  # the emulator runs launch plans, on any device

# ------------------------------------------------------- planted kernel bugs

REFERENCE_KERNEL = Path("extensions/metal/paged_attention.metal")  # relative to src/


def task_of(anchor: str) -> str | None:
    """The course task whose region of the reference kernel holds ``anchor``, if any."""
    text = (course.SRC.parent / REFERENCE_KERNEL).read_text()
    assert text.count(anchor) == 1, (
        f"the mutation's anchor is {'not' if anchor not in text else 'more than once'} in "
        f"src/{REFERENCE_KERNEL}: {anchor!r}")
    first = text[: text.index(anchor)].count("\n")
    last = first + anchor.count("\n")
    return next((task_id for region, task_id, _, _ in course.regions_in(text, REFERENCE_KERNEL)
                 if region.start < last and first < region.end), None)


def mutated(old: str, new: str, plan: str):
    """``plan`` for a case, with exactly one occurrence of ``old`` in the kernel source
    replaced by ``new``. On a learner's kernel, a bug planted in a task's code cannot be: the
    learner wrote that code their own way, so the test is skipped, saying so (it runs on the
    reference); a bug in the code around the tasks is planted in the learner's file too."""
    task = task_of(old)

    def mutant(case: MetalCase) -> dict[str, Any]:
        if task is not None and PAGED != course.SRC.parent / REFERENCE_KERNEL:
            pytest.skip(f"this bug is planted in Task {task}'s code, which your kernel ({PAGED}) "
                        "writes its own way; it is the reference's (run without --learner)")
        launch = plan_for(case, plan)
        header = launch["header"]
        found = header.count(old)
        assert found == 1, (f"the mutation's anchor is {'not' if found == 0 else 'more than once'}"
                            f" in the kernel source ({PAGED}): {old!r}")
        return {**launch, "header": header.replace(old, new)}

    return mutant


def line_of(needle: str, nth: int = 0, path: Path = PAGED) -> int:
    """1-based line of the ``nth`` line of ``path`` containing ``needle``."""
    return [i + 1 for i, s in enumerate(path.read_text().splitlines()) if needle in s][nth]


def cases(*names: str) -> list[MetalCase]:
    return [CASE_BY_NAME[n] for n in names]


# The vector schedule (paged_attention_impl), through Day 4's plan.

MERGE_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  float factor[GROUP];"
ROUND_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n  }\n  if (sg == 0) {"
IDLE_RETURN = "  for (int j = int(sg); j < num_pages; j += kSimdgroups) {"


@needs_emulator
def test_mutation_missing_barrier_before_merge() -> None:
    # Without it, a thread reads tg_m/tg_l slots that other simdgroups' lane 0 has not
    # written yet: NaN poison under round-robin, and different bits per schedule.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(MERGE_BARRIER, "  float factor[GROUP];", "vector")
    forward = run_case(case, mutant(case), "forward")
    assert np.isnan(forward).any() and not close_to_ref(forward, case)
    with pytest.raises(ScheduleMismatch, match="buffer 'out' differs"):
        run_case(case, mutant(case))


@needs_emulator
def test_mutation_page_boundary_off_by_one_reads_nan_slot() -> None:
    # One key past the context when it is not a multiple of the page size: that slot
    # is NaN garbage (or a future key of a multi-query row), so the output is NaN.
    chosen = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8", "ragged_f16_mha")
    mutant = mutated(
        "min(page_size, num_keys - j * page_size)",
        "min(page_size, num_keys - j * page_size + 1)",
        "vector",
    )
    for case in chosen:
        got = run_case(case, mutant(case))  # deterministic: same bits under all schedules
        assert np.isnan(got).any() and not close_to_ref(got, case), case


@needs_emulator
def test_mutation_block_table_next_entry_reads_before_k_pages() -> None:
    # The last page of each row becomes the table's -1: page -1 reads k_pages before
    # its start, and the emulator names the buffer and the faulting line.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(
        "block_table[b * max_pages + j]", "block_table[b * max_pages + j + 1]", "vector")
    with pytest.raises(OutOfBoundsError) as err:
        # guard="start": any read before the start faults, whatever the pool's size
        # (by default a small underflow may land in NaN-poisoned slack instead).
        run_case(case, mutant(case), "forward", guard="start")
    msg = str(err.value)
    assert "read of buffer(1) 'k_pages'" in msg and "before its start" in msg
    assert f"paged_attention.metal:{line_of('kr[i] = d < HEAD_DIM')}" in msg


@needs_emulator
def test_mutation_block_table_next_row_reads_past_the_table() -> None:
    # The next sequence's row: wrong (valid) pages for all but the last sequence, whose
    # lookup runs past the end of block_table.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(
        "block_table[b * max_pages + j]", "block_table[(b + 1) * max_pages + j]", "vector")
    with pytest.raises(OutOfBoundsError) as err:
        run_case(case, mutant(case), "forward")
    msg = str(err.value)
    assert "read of buffer(3) 'block_table'" in msg and "past its end" in msg
    assert (
        f"paged_attention.metal:{line_of('const int page = block_table[b * max_pages + j]')}" in msg
    )


@needs_emulator
def test_mutation_early_return_of_idle_simdgroup_is_a_barrier_error() -> None:
    # A simdgroup that owns no page returns before the merge barrier.
    (case,) = cases("ragged_f32_mha")  # 1-7 pages per row: idle simdgroups everywhere
    mutant = mutated(
        IDLE_RETURN, "  if (int(sg) >= num_pages) return;\n" + IDLE_RETURN, "vector")
    barrier_line = line_of("threadgroup_barrier") + 1  # one line was inserted above it
    for schedule in DEFAULT_SCHEDULES[:4]:
        with pytest.raises(BarrierError) as err:
            run_case(case, mutant(case), schedule)
        assert f"paged_attention.metal:{barrier_line}" in str(err.value), schedule
        assert "returned" in str(err.value), schedule


@needs_emulator
def test_mutation_missing_barrier_in_merge_rounds() -> None:
    # No synchronisation point is left after the merge barrier, so each thread runs to
    # the end in one go: simdgroup 0 writes round 0 (which ignores tg_acc) and reads
    # back only its own lanes' values. Every schedule gives the same bits, so only the
    # reference catches it: rows whose context spans several simdgroups' pages come out
    # as simdgroup 0's share; single-page rows (simdgroup 0 only) stay right.
    (case,) = cases("ragged_decode_f32_gqa3")  # page 8; contexts 1, 7, 8 | 9, 61
    mutant = mutated(ROUND_BARRIER, "  }\n  if (sg == 0) {", "vector")
    got = run_case(case, mutant(case))  # bit-identical under all schedules
    tol = TOLERANCE[case.dtype]
    ref = inputs(case).ref
    np.testing.assert_allclose(got[:3], ref[:3], atol=tol, rtol=tol)
    assert np.isfinite(got).all()
    for row in (3, 4):
        assert not np.allclose(got[row], ref[row], atol=1e-3), row


@needs_emulator
def test_mutation_page_stride_is_caught_only_past_eight_pages() -> None:
    # Simdgroup s must walk pages s, s + 8, ...: a wrong stride only skips pages when a
    # context has more pages than there are simdgroups.
    chosen = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8", "many_pages_f32_gqa4")
    mutant = mutated("j += kSimdgroups) {", "j += kSimdgroups + 1) {", "vector")
    for case in chosen[:2]:  # at most 8 pages
        assert close_to_ref(run_case(case, mutant(case)), case), case
    case = chosen[2]  # 13 pages
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_no_causal_offset_is_caught_only_by_multi_query_rows() -> None:
    # Every row sees the whole context: the keys past a row's position are valid data,
    # so only the values of multi-query rows (L > 1) are wrong.
    decode, case = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8")
    mutant = mutated("(int(row) - query_start_loc[b])", "(query_len - 1)", "vector")
    assert close_to_ref(run_case(decode, mutant(decode)), decode)  # L == 1 everywhere
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)
    single = inputs(case).query_start_loc[1]  # the row of the 1-token sequence
    np.testing.assert_allclose(got[single], inputs(case).ref[single], atol=2e-5)


@needs_emulator
def test_mutation_sequence_lookup_boundary() -> None:
    # `<` instead of `<=`: the first row of each later sequence is attributed to the
    # previous sequence.
    (case,) = cases("mixed_f16_gqa4")
    old = "query_start_loc[b + 1] <= int(row)"
    mutant = mutated(old, old.replace("<=", "<"), "vector")
    assert not close_to_ref(run_case(case, mutant(case)), case)


@needs_emulator
def test_mutation_gqa_head_mapping() -> None:
    # Interleaved instead of grouped heads: query head h must read KV head h // GROUP.
    (case,) = cases("mixed_f16_gqa4")  # GROUP 4 with 2 KV heads
    old = "const int head = int(kv_head) * GROUP + g;\n    for (int i = 0; i < PER_LANE; ++i) {"
    new = old.replace("int(kv_head) * GROUP + g", "int(kv_head) + g * n_kv_heads")
    mutant = mutated(old, new, "vector")  # the q load (the output loop is indented deeper)
    assert not close_to_ref(run_case(case, mutant(case)), case)


@needs_emulator
def test_mutation_merge_without_rescale() -> None:
    # Simdgroups' partial outputs added without exp(m_s - global_m).
    (case,) = cases("many_pages_f32_gqa4")
    mutant = mutated("factor[g] = exp(m[g] - global_m);", "factor[g] = 1.0f;", "vector")
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_merge_reads_uninitialised_accumulator() -> None:
    # Round 0 adds to tg_acc instead of overwriting it: threadgroup memory starts as
    # NaN poison in the emulator (garbage on a GPU).
    (case,) = cases("ragged_f16_mha")
    mutant = mutated(
        "s == 0 ? 0.0f : tg_acc[g * HEAD_DIM + d]", "tg_acc[g * HEAD_DIM + d]", "vector")
    assert np.isnan(run_case(case, mutant(case))).all()


# The tiled (FlashAttention) schedule (paged_flash_impl), through Day 5's plan.

MULTI_QUERY = ("mixed_prefill_f32_gqa8", "prefill_f32_gqa3", "mixed_f16_gqa4")


@needs_emulator
def test_mutation_tiled_missing_loop_end_barrier_is_seen_only_under_run_ahead() -> None:
    # A fast simdgroup stages the next key tile while others still read this one.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "    // Everyone is done with this key tile before the next one overwrites it.\n"
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
        "", "flash")
    for case in chosen:
        lockstep = run_plan(mutant(case), PAGED, schedules=("forward", "reverse"))
        lockstep = lockstep["out"].astype(np.float64)
        assert close_to_ref(lockstep, case), case
        for schedule in ("run_ahead", "run_ahead_shuffled:1"):
            assert not close_to_ref(run_case(case, mutant(case), schedule), case), case


@needs_emulator
def test_mutation_tiled_missing_staging_barrier() -> None:
    # Simdgroups multiply a key tile before the whole threadgroup has staged it: they
    # read the NaN poison of fresh threadgroup memory.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n\n"
        "    simdgroup_matrix<float, 8, 8> s =",
        "\n    simdgroup_matrix<float, 8, 8> s =", "flash")
    for case in chosen:
        for schedule in DEFAULT_SCHEDULES[:4]:
            assert np.isnan(run_case(case, mutant(case), schedule)).any(), (case, schedule)


@needs_emulator
def test_mutation_tiled_staging_past_the_context_reads_nan_garbage() -> None:
    # Keys past the last row's position must be staged as zeros, not loaded: masking
    # their scores is not enough, because P (0) times V (NaN garbage) is NaN.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "const bool in_range = key0 + t < num_keys;", "const bool in_range = true;", "flash"
    )
    for case in chosen:
        assert np.isnan(run_case(case, mutant(case))).any(), case


@needs_emulator
def test_mutation_tiled_causal_mask_off_by_one() -> None:
    # `<` instead of `<=` when computing P: every row loses its own key.
    chosen = cases(*MULTI_QUERY)
    old = "const bool visible = my_valid && key0 + j <= my_pos;\n        const float p"
    mutant = mutated(old, old.replace("<=", "<"), "flash")
    for case in chosen:
        assert not close_to_ref(run_case(case, mutant(case)), case), case


@needs_emulator
def test_mutation_tiled_query_rows_past_the_tile_read_past_q() -> None:
    # Rows past the sequence's last query must not be loaded: for the batch's last
    # sequence they lie past the end of q.
    (case,) = cases("mixed_f16_gqa4")
    mutant = mutated("my_scratch[e] = row < rows_in_tile\n", "my_scratch[e] = true\n", "flash")
    with pytest.raises(OutOfBoundsError) as err:
        run_case(case, mutant(case), "forward")
    msg = str(err.value)
    assert "read of buffer(0) 'q'" in msg and "past its end" in msg
    assert f"paged_attention.metal:{line_of('? float(q[(flat * n_heads + head)')}" in msg



# The rows of a token tree: paged_attention_impl folds each row's drafts after its walk;
# Day 5's dispatch gives those rows their vector threadgroups, never a tile's output.

TREE_CASES = ("tree_f32_gqa3", "tree_f16_9q3kv")


def tree_row_indices(case: MetalCase) -> np.ndarray:
    own = np.concatenate([np.arange(c - q, c) for c, q in case.seqs])
    return np.flatnonzero(inputs(case).tree.start <= own)


def wrong_rows(got: np.ndarray, case: MetalCase, rows: np.ndarray) -> list[int]:
    tol = TOLERANCE[case.dtype]
    ref = inputs(case).ref
    return [int(r) for r in rows if not np.allclose(got[r], ref[r], atol=tol, rtol=tol)]


@needs_emulator
@pytest.mark.parametrize("plan", PLANS)
def test_mutation_tree_rows_that_ignore_their_mask_see_their_siblings(plan: str) -> None:
    # Every draft up to the row's own is folded in: a row sees its elder siblings and
    # cousins. Causal rows, and the first draft (it has no elder), stay right.
    mutant = mutated("if (((mask >> uint64_t(draft)) & 1) == 0) {", "if (false) {", plan)
    for case in cases(*TREE_CASES):
        got = run_case(case, mutant(case))
        rows = tree_row_indices(case)
        assert wrong_rows(got, case, np.arange(case.num_rows)) == \
            wrong_rows(got, case, rows[1:]) != [], case
        assert len(wrong_rows(got, case, rows)) == len(rows) - 1, case


@needs_emulator
def test_mutation_tiles_writing_tree_rows_overwrite_them_causally() -> None:
    # A tile computes each of its rows causally; where it writes a tree row's output too,
    # it overwrites what the row's vector threadgroup (an earlier one) wrote.
    mutant = mutated("!in_tree(tree_start, flat, first_pos + tile_row0 + row)", "true", "flash")
    for case in cases(*TREE_CASES):
        got = run_case(case, mutant(case), "forward")
        rows = tree_row_indices(case)
        assert wrong_rows(got, case, np.arange(case.num_rows)) == \
            wrong_rows(got, case, rows[1:]) != [], case


@needs_emulator
def test_mutation_tree_rows_left_to_the_tiles_are_never_written() -> None:
    mutant = mutated("if (query_len == 1 || in_tree(tree_start, x, own_key)) {",
                     "if (query_len == 1) {", "flash")
    for case in cases(*TREE_CASES):
        got = run_case(case, mutant(case), "forward")
        rows = tree_row_indices(case)
        assert np.isnan(got[rows]).all() and not np.isnan(np.delete(got, rows, 0)).any(), case


# --------------------------------------------------------- planted host bugs
#
# What a bug in the launcher (metal_launch.cpp) would hand to MLX: the plan, edited.


def edited(case: MetalCase, plan: str, **changes: Any) -> dict[str, Any]:
    return {**plan_for(case, plan), **changes}


@needs_emulator
def test_host_grid_one_row_short_leaves_a_row_unwritten() -> None:
    # The last query row's threadgroups never run: that row keeps the output's
    # uninitialised (NaN) contents.
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "vector")
    x, y, z = launch["grid"]
    got = run_case(case, {**launch, "grid": (x - 256, y, z)}, "forward")
    assert np.isnan(got[-1]).all() and not np.isnan(got[:-1]).any()


@needs_emulator
def test_host_grid_without_tile_threadgroups_leaves_prefill_rows_unwritten() -> None:
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    got = run_case(case, {**launch, "grid": (256 * case.num_rows, case.n_kv_heads, 1)}, "forward")
    multi = np.repeat([q > 1 for _, q in case.seqs], [q for _, q in case.seqs])
    assert np.isnan(got[multi]).all() and not np.isnan(got[~multi]).any()


@needs_emulator
def test_host_grid_sized_with_another_tile_height_is_caught() -> None:
    # The host sizing tiles of 64 // 4 rows while the kernel (group 5) uses 64 // 5:
    # too few tile threadgroups, so the last sequence's tiles never run.
    case = CASE_BY_NAME["gqa5_f32"]
    launch = plan_for(case, "flash")
    tiles = -(-case.num_rows // (64 // 4))
    grid = (256 * (case.num_rows + len(case.seqs) * tiles), case.n_kv_heads, 1)
    assert grid[0] < launch["grid"][0]
    got = run_case(case, {**launch, "grid": grid}, "forward")
    last = case.seqs[-1][1]
    tol = TOLERANCE[case.dtype]
    assert np.isnan(got[-last:]).all()
    np.testing.assert_allclose(got[:-last], inputs(case).ref[:-last], atol=tol, rtol=tol)


@needs_emulator
@pytest.mark.parametrize(
    "swap", [(2, 3), (1, 4)], ids=["n_heads-n_kv_heads", "max_pages-page_size"]
)
def test_host_params_packed_in_the_wrong_order(swap: tuple[int, int]) -> None:
    import mlx.core as mx

    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    params = np.array(launch["inputs"][6])
    i, j = swap
    params[[i, j]] = params[[j, i]]
    inputs_ = [*launch["inputs"][:6], mx.array(params)]
    try:
        got = run_case(case, {**launch, "inputs": inputs_}, "forward")
    except OutOfBoundsError:
        return  # reading the wrong rows ran off a buffer: caught
    assert not close_to_ref(got, case)


@needs_emulator
def test_host_without_padding_does_not_compile() -> None:
    # MLX passes arrays of fewer than 8 elements in the `constant` address space; the
    # kernels take `device` pointers, which Metal (and the emulator) refuse to convert.

    case = CASE_BY_NAME["smollm2_f16_9q3kv"]  # 3 sequences: context_lens has 3 elements
    launch = plan_for(case, "flash")
    raw = mx_inputs(case)
    unpadded = [*launch["inputs"][:4], raw[4], raw[5], launch["inputs"][6]]
    assert unpadded[4].size < 8
    with pytest.raises(MetalCompileError, match="constant_ptr"):
        run_case(case, {**launch, "inputs": unpadded}, "forward")


@needs_emulator
def test_host_template_group_wrong() -> None:
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    args = [(n, case.n_heads if n == "GROUP" else v) for n, v in launch["template_args"]]
    with pytest.raises((OutOfBoundsError, AssertionError)):
        got = run_case(case, {**launch, "template_args": args}, "forward")
        assert close_to_ref(got, case)


@needs_emulator
def test_host_threadgroup_of_four_simdgroups() -> None:
    # The kernels assume 8 simdgroups (pages s, s + 8, ...; 8 rows of pairs per tile):
    # with 4, half of each context and half of each tile are never computed.
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    for plan in PLANS:
        try:
            got = run_case(case, edited(case, plan, threadgroup=(128, 1, 1)), "forward")
        except OutOfBoundsError:
            continue  # twice the threadgroups: the extra ones read rows past q
        assert np.isnan(got).any() or not close_to_ref(got, case), plan



