"""The benchmark harness's arithmetic and reporting (the timing itself needs a GPU)."""

import pytest
import torch

import dlm_ops

from benchmarks.__main__ import _markdown, _preset
from benchmarks.contenders import Case, ExactCase
from dlm_ops.geometry import SequenceMask
from dlm_ops.reference import block_diffusion_mask


def test_flops_count_visible_pairs_only():
    case = Case(batch=2, n=40, heads=3, kv_heads=1, head_dim=16, block_size=6)
    pairs = int(block_diffusion_mask(80, 6).sum())
    assert case.flops("fwd") == 4 * pairs * 16 * 3 * 2
    assert case.flops("bwd") == 2.5 * case.flops("fwd")
    assert case.flops("step") == 3.5 * case.flops("fwd")
    causal = ExactCase(batch=1, heads=2, seqlen=10, head_dim=16, causal=True)
    assert causal.flops("fwd") == 4 * 55 * 16 * 2


def test_presets_hold_16k_tokens_per_batch():
    for case in _preset("main"):
        assert case.batch * 2 * case.n == 16 * 1024
        assert case.dtype == torch.bfloat16


def test_markdown_table_has_ratio_columns():
    rows = [dict(case="c", contender=name, mode="step", tflops=t, ratio_vs_ref=r)
            for name, t, r in (("dlm_ops", 300.0, 0.6), ("ref", 500.0, 1.0))]
    table = _markdown(rows, ["step"], ("ref",))
    assert "| dlm_ops / ref |" in table.splitlines()[0]
    assert "| c | step | 300 | 500 | 0.60 |" in table


def test_varlen_and_odd_presets():
    """Packed samples hold at most 16K tokens and count the pairs of every sample; the odd preset's
    halves are not multiples of 128 (the CUTLASS kernels' kStartAny tiles)."""
    from benchmarks.contenders import VarlenCase

    for case in _preset("varlen"):
        assert isinstance(case, VarlenCase) and case.cu_seqlens[-1] <= 16 * 1024
        pairs = sum(SequenceMask.block_diffusion(2 * n, case.block_size).num_pairs for n in case.halves)
        assert case.flops("fwd") == 4 * pairs * case.head_dim * case.heads
        assert case.flops("bwd") == 2.5 * case.flops("fwd")
    assert all(case.n % 128 for case in _preset("odd"))


def test_packed_samples_of_one_length_have_a_batched_counterpart():
    """The varlen preset's batched contenders do the packing's own work where every sample has the
    same half (equal flops), and refuse a mixed packing (reported as skipped, not timed)."""
    import pytest

    from benchmarks.contenders import _batched

    for case in _preset("varlen"):
        if len(set(case.halves)) == 1:
            batched = _batched(case)
            assert (batched.batch, batched.n) == (len(case.halves), case.halves[0])
            assert batched.flops("fwd") == case.flops("fwd")
        else:
            with pytest.raises(ValueError, match="no batched counterpart"):
                _batched(case)


def test_host_time_says_it_needs_a_gpu(monkeypatch):
    """benchmarks.host_time measures CUDA launches: without a GPU it stops with a clear message
    instead of timing the CPU fallback."""
    import pytest

    from benchmarks import host_time

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        host_time.main(["--calls", "1"])


def test_host_time_nodes_rows_run(monkeypatch, capsys):
    """host_time --nodes (step_nodes) on the CPU with the torch backend: every row runs and prints
    (the GPU's syncs stubbed out: the rows' calls are what this checks, not their times)."""
    from benchmarks import host_time

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    q, k, v = (torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(3))
    host_time.step_nodes(q, k, v, 32, calls=1)
    out = capsys.readouterr().out
    for row in ("trivial C++ node", "trivial Python node", "forward with grad", "ours, step",
                "the backward on the calling thread", "the Python node",
                "backend's bwd on the main thread"):
        assert row in out
    assert out.count("\n| ") == 8  # the header and seven rows


def test_rounds_vary_the_measurement_order(monkeypatch):
    """A fixed order within rounds let a position's GPU state favour one contender (session 7:
    up to 15 % in the kernel A/Bs); every (contender, mode) must open some round, every round
    still measures each once, and the predecessors vary."""
    import benchmarks.__main__ as bench

    calls = []
    monkeypatch.setattr(bench, "_time_once", lambda setup, fn, iters: fn() or 1.0)
    monkeypatch.setattr(bench, "_calls_per_measurement", lambda setup, fn: 3)

    def contender(name):
        return lambda case: {m: (None, lambda m=m: calls.append((name, m))) for m in ("fwd", "bwd")}

    names = ["a", "b", "c"]
    case = Case(1, 128, 2, 2, 64, 16)
    rows = bench.bench_case(case, {n: contender(n) for n in names}, ["fwd", "bwd"], 6, ("a",))
    timed = calls[len(calls) - 6 * 6:]  # after the warm-ups: 6 rounds of 6 measurements
    rounds = [timed[i:i + 6] for i in range(0, 36, 6)]
    assert all(sorted(r) == sorted((n, m) for n in names for m in ("fwd", "bwd")) for r in rounds)
    assert {r[0] for r in rounds} == {(n, m) for n in names for m in ("fwd", "bwd")}
    # ... and no key always follows the same one (session 16: the predecessor's GPU state moved a
    # contender by 5-11 %).
    before = {}
    for r in rounds:
        for prev, key in zip(r, r[1:]):
            before.setdefault(key, set()).add(prev)
    assert all(len(p) >= 2 for p in before.values())
    assert len(rows) == 6 and all(r["ratio_vs_a"] == 1.0 for r in rows)


def test_host_path_measures_both_ways_and_restores_the_backend(capsys):
    """benchmarks.host_path runs the cutlass backend's Python on CPU with a no-op extension: both
    ways in are timed, and the backend is as before afterwards (dispatch on CPU picks torch)."""
    from benchmarks import host_path
    from dlm_ops.backends import cutlass_diffusion as cd

    before = (cd._EXT, cd._extension, cd.CutlassDiffusionBackend.capabilities)
    assert host_path.main(["--n", "64", "--calls", "3", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    assert "| fwd |" in table and "| step |" in table and "| bwd op | - |" in table
    assert (cd._EXT, cd._extension, cd.CutlassDiffusionBackend.capabilities) == before
    assert "auto_device_types" not in vars(cd.CutlassDiffusionBackend)
    from dlm_ops.backends import select
    from dlm_ops.ops.diffusion import _problem

    q = torch.randn(1, 8, 2, 16)
    assert select(_problem(q, q, 0.0, False, False)).name == "torch"  # CPU: cutlass not eligible
    assert dlm_ops.diffusion_attn_func(q, q, q, 2).shape == q.shape


def test_ncu_stalls_reads_the_source_page():
    """benchmarks.ncu_stalls: ncu's log lines before the table are skipped, predicated opcodes
    counted by their opcode, shares in % of all samples."""
    from benchmarks.ncu_stalls import read, report

    lines = ['==PROF== Connected to process 1', '"Kernel Name","k"',
             '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
             '"0x10","STL [R1+0x100], R6","6","5"',
             '"0x20","@!P0  BRA 0x40","3","1"',
             '"0x30","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","1,000","0"']
    got = read(lines)
    assert [(i.opcode, i.samples) for i in got] == [("STL", 6), ("BRA", 3), ("HGMMA.64x64x16.F32.BF16", 1000)]
    text = report(got, top=2)
    assert "1009 samples" in text and "HGMMA.64x64x16.F32.BF16 99.1%" in text
    assert text.splitlines()[-1].startswith("  0.6%   0.5%     0x10 STL")


def test_ncu_stalls_counts_what_ran():
    """--executed: instructions executed per opcode (modifiers dropped) and the stall samples of
    the instructions grouped by their execution count."""
    from benchmarks.ncu_stalls import executed, read

    lines = ['"Address","Source","Warp Stall Sampling (All Samples)",'
             '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"',
             '"0x10","IMAD R1, R2, R3, RZ","30","5","16,384"',
             '"0x20","@P0 IMAD.HI.U32 R1, R2, R3, RZ","10","1","16,384"',
             '"0x30","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","60","0","81,920"']
    text = executed(read(lines + ['"Kernel Name","another kernel"', lines[0]]))  # a second table
    assert "0.115 M warp instructions executed" in text
    assert "executed by opcode (M): HGMMA 0.082, IMAD 0.033" in text
    assert "       81920x:  60.0%" in text and "       16384x:  40.0%" in text


def test_result_rows_name_the_kernel_sources(tmp_path, monkeypatch):
    """The device machine's copy of .git may be stale (session 16's rows named a commit three
    behind): every row and table header also carries the hash of csrc/, which a source edit
    changes and the extensions' build directories are named by."""
    import benchmarks.__main__ as bench
    from dlm_ops.backends import cutlass

    monkeypatch.setenv("DLM_COMMIT", "abc1234")
    meta = bench.run_meta()
    assert meta["commit"] == "abc1234" and meta["csrc"] == cutlass.source_hash()
    assert len(meta["csrc"]) == 16
    bench.write_results(tmp_path, "t", [dict(meta, ms=1.0)], meta, "what", "| table |")
    header = (tmp_path / "t.md").read_text().splitlines()[0]
    assert f"commit abc1234, csrc {meta['csrc']};" in header


def test_knob_ab_knobs_name_what_the_backends_read():
    """Every knob is an attribute of its backend module (the A/B sets it and restores it), and its
    modes are what its cases' runs offer."""
    from benchmarks import knob_ab, sparse

    for name, knob in knob_ab.KNOBS.items():
        assert hasattr(knob.module, knob.attribute), name
        assert len(knob.settings) == 2 and knob.settings[0] != knob.settings[1], name
        sparse_cases = [isinstance(c, sparse.SparseCase) for c in knob.cases]
        assert all(sparse_cases) or not any(sparse_cases), name
        want = {"block", "column"} if all(sparse_cases) else {"fwd", "bwd", "step"}
        assert set(knob.modes) <= want, name


def test_knob_ab_times_an_aa_arm_beside_the_two_settings():
    """The A/B's third arm is the first setting again, and its speed over the first is reported
    beside the A/B's (medians per arm)."""
    from benchmarks import knob_ab

    assert knob_ab.arms((0, 1024)) == (0, 1024, 0)
    times = {(0, "fwd"): [2.0, 2.2, 1.9], (1, "fwd"): [1.0, 1.1, 0.9], (2, "fwd"): [2.0, 2.1, 2.5]}
    t0, t1, speed, aa = knob_ab.speeds(times, "fwd")
    assert (t0, t1) == (2.0, 1.0) and speed == 2.0 and aa == 2.0 / 2.1


def test_step_gap_and_power_say_they_need_a_gpu(monkeypatch):
    import pytest

    from benchmarks import power, step_gap

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (step_gap, power):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            module.main([])


def test_step_gap_row_divides_by_forward_plus_backward():
    from benchmarks.step_gap import HEAD, row

    line = row("c", "x", {"fwd": 0.25, "bwd": 0.75, "step": 1.08, "graph step": 1.01})
    assert line == "| c | x | 0.250 | 0.750 | 1.000 | 1.080 | 1.010 | 1.080 | 1.010 |"
    assert line.count("|") == HEAD.splitlines()[0].count("|")


def test_power_settles_on_the_samples_after_the_first_third():
    from benchmarks.power import settled

    lines = ["1980, 120.5, 40", "1700, 690.0, 61", "1650, 689.0, 62", "not a sample",
             "1640, 691.0, 63", "1635, 690.5, 63", "1630, 688.0, 62", "1645, 690.0, 62"]
    assert settled(lines) == (1640.0, 690.0, 62.0)
    assert all(x != x for x in settled([]))  # NaN: nothing sampled


def test_build_ab_cases_are_benchmark_cases():
    """benchmarks.build_ab's shapes build the benchmark's Case (labels distinct) and its build
    loader derives the module name from the directory's hash, as cutlass.build names it."""
    from benchmarks import build_ab
    from benchmarks.contenders import Case

    labels = [Case(*shape).label for shape in build_ab.CASES]
    assert len(set(labels)) == len(labels)
    import pytest

    with pytest.raises(ImportError):  # nothing built there: the loader names the file it wanted
        build_ab.load_build("/nonexistent/dlm_diffusion_sm90-torch2-cu13-nvcc13-0123456789abcdef")


def test_build_ab_selects_cases_and_modes():
    """--cases / --modes pick rows of the table by index and name, and reject what is not there
    before any process starts."""
    import pytest

    from benchmarks import build_ab

    assert build_ab.selected(None, None) == (build_ab.CASES, build_ab.MODES)
    shapes, modes = build_ab.selected("0,5", "fwd")
    assert shapes == (build_ab.CASES[0], build_ab.CASES[5]) and modes == ("fwd",)
    with pytest.raises(SystemExit, match="--modes"):
        build_ab.selected(None, "fwd,forward")
    for bad in ("99", "x"):
        with pytest.raises(SystemExit, match="--cases"):
            build_ab.main(["/nowhere", "--cases", bad])


def test_sparse_profile_kernel_labels():
    """benchmarks.sparse_profile names the sparse ops' kernels by their template flags."""
    from benchmarks.sparse_profile import kernel_label

    plain = ("void dlm::sm90::block_sparse_fwd_kernel<dlm::sm90::FreeFirstTurn<dlm::sm90::FwdConfig<"
             "cutlass::bfloat16_t, 128, 128, 128, 2, true, 0, 2, true, true, true, false> >, {}, {}>"
             "(dlm::sm90::SparseFwdParams<dlm::sm90::FreeFirstTurn<...> >)")
    assert kernel_label(plain.format("false", "false")) == "attention"
    assert kernel_label(plain.format("true", "false")) == "attention (column form)"
    assert kernel_label(plain.format("true", "true")) == "attention (column form), split tail"
    assert kernel_label(plain.format("false", "true")) == "attention, split tail"
    assert kernel_label("void dlm::sm90::column_gather_detail::column_gather_kernel<uint4>(...)") == "column_gather"
    assert kernel_label("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>") == "fill"


def test_switched_contenders_flip_one_switch_only_while_they_run():
    """`dlm_ops dq snake` / `dlm_ops python node` run a contender's setup and timed call with one
    cutlass_diffusion switch turned off and restore it afterwards, an exception included; their A/A
    arm, `dlm_ops switch a/a`, goes through the same wrapper and changes no switch."""
    from benchmarks.contenders import CONTENDERS, VARLEN_CONTENDERS, dq_snake, python_node, switch_aa
    from dlm_ops.backends import cutlass_diffusion as cd

    for name in ("dlm_ops dq snake", "dlm_ops switch a/a"):
        assert name in CONTENDERS and name in VARLEN_CONTENDERS
    shipped = (cd.DQ_SCHEDULE, cd.NATIVE_BACKWARD)
    seen = lambda: (cd.DQ_SCHEDULE, cd.NATIVE_BACKWARD)  # noqa: E731

    def fails():
        raise RuntimeError("inside")

    modes = {"fwd": (None, seen), "step": (seen, fails)}
    assert shipped == (True, True)  # both on as shipped: each contender shows what its switch adds
    for wrap, want in ((dq_snake, (False, True)), (python_node, (True, False)), (switch_aa, shipped)):
        wrapped = wrap(modes)
        assert wrapped["fwd"][0] is None and wrapped["fwd"][1]() == want
        assert wrapped["step"][0]() == want
        with pytest.raises(RuntimeError, match="inside"):
            wrapped["step"][1]()
        assert seen() == shipped
