"""The CUDA kernels' register report: no paged attention kernel spills.

setup.py compiles pagedkv._C's CUDA units with ``-Xptxas=-v`` through scripts/ptxas_log.sh, which
keeps ptxas's report (registers, shared memory, spills per kernel and arch) beside each object;
scripts/ptxas_report.sh reads those logs, compiling nothing, and fails when a classical kernel
spills on sm_90 or a tensor-core one on any arch. No GPU needed, only a CUDA build of the module.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "csrc" / "cuda").glob("attention_*.cu"))


def built_with_cuda() -> bool:
    import torch

    import pagedkv  # noqa: F401  (loads torch.ops.pagedkv)

    return torch._C._dispatch_has_kernel_for_dispatch_key("pagedkv::paged_attention", "CUDA")


@pytest.fixture(scope="module")
def report() -> subprocess.CompletedProcess:
    if not built_with_cuda():
        pytest.skip("pagedkv._C was built without CUDA kernels (CPU-only torch or no nvcc)")
    script = ROOT / "scripts" / "ptxas_report.sh"
    return subprocess.run([str(script), "--logs", str(ROOT / "build")], capture_output=True,
                          text=True)


def test_every_attention_unit_has_a_current_log(report):
    assert "no ptxas log" not in report.stderr, report.stderr


def test_no_paged_attention_kernel_spills(report):
    assert report.returncode == 0, report.stdout[-4000:] + report.stderr
    summary = report.stdout.strip().splitlines()[-1]
    assert summary.endswith("0 paged_attention kernels spill (any on sm_90, tensor-core ones on"
                            " any arch)"), summary
    kernels = int(summary.split()[0])
    # every unit reported, both archs: at least one kernel per unit and arch
    assert kernels >= 2 * len(UNITS), summary
    for arch in ("sm_80", "sm_90"):
        assert any(line.startswith(arch) for line in report.stdout.splitlines()), arch


def test_the_mla_kernels_are_reported_without_spills(report):
    """Every tensor-core MLA configuration (bf16 and f16 queries, 16-bit and fp8 latents, padded
    ranks 64 and 512, 16- and 64-row tiles: 24 kernels) on both archs, none spilling."""
    lines = [line for line in report.stdout.splitlines() if "mla_attention_tc_kernel" in line]
    for arch in ("sm_80", "sm_90"):
        mine = [line.split() for line in lines if line.startswith(arch)]
        assert len(mine) == 24, (arch, len(mine))
        assert all(fields[3] == "0/0" for fields in mine), mine
