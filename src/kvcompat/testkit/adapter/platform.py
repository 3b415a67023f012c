"""Select vLLM's own CpuPlatform in this process, before any connector module reads it.

One function, used by our suite's conftest and by the upstream suite's pytest plugin.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvcompat.testkit import probes


def _target_device_env_selects_cpu() -> bool:
    """Probe, without importing vLLM: does this release's ``cpu_platform_plugin``
    (vllm/platforms/__init__.py) honour VLLM_TARGET_DEVICE?"""
    import ast

    path = probes.vllm_distribution().locate_file("vllm/platforms/__init__.py")
    tree = ast.parse(Path(str(path)).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "cpu_platform_plugin":
            return "VLLM_TARGET_DEVICE" in ast.unparse(node)
    return False


def _cpu_platform_requires_triton() -> bool:
    """Probe, without importing vLLM: does this release's CpuPlatform refuse x86 without Triton?

    From 0.34.0 ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires
    Triton (triton-cpu)" when ``vllm.triton_utils.HAS_TRITON`` is False, and the official CUDA
    wheel's Triton counts as usable only with exactly one active GPU driver.
    """
    path = probes.vllm_distribution().locate_file("vllm/platforms/cpu.py")
    return "requires Triton (triton-cpu)" in Path(str(path)).read_text()


def _platform_values_reread(platform: object) -> list[str]:
    """Values vLLM froze from the platform while it was being imported (before ours was set), read
    again from CpuPlatform, as a CPU build of vLLM has them from the start.

    ``vllm.utils.torch_utils.PIN_MEMORY`` (0.24-0.27) is ``is_pin_memory_available()`` at import: the
    unspecified platform says True, CpuPlatform False, and SimpleCPUOffload's worker would pin its CPU
    pool through CUDA.  Modules that copied it (``from ... import PIN_MEMORY``) get it too.
    """
    torch_utils = sys.modules.get("vllm.utils.torch_utils")
    if torch_utils is None or not hasattr(torch_utils, "PIN_MEMORY"):
        return []
    cpu_value = platform.is_pin_memory_available()
    if torch_utils.PIN_MEMORY == cpu_value:
        return []
    fixed = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "PIN_MEMORY", cpu_value) != cpu_value:
            mod.PIN_MEMORY = cpu_value
            fixed.append(name)
    return [f"PIN_MEMORY read again from CpuPlatform ({cpu_value}) in {', '.join(sorted(fixed))}"]


def select_cpu_platform() -> str:
    """Select vLLM's own CpuPlatform for this process (construction only); return how.

    The official CUDA wheels resolve to ``UnspecifiedPlatform`` on a GPU-less
    box.  From 0.28.0 ``VLLM_TARGET_DEVICE=cpu`` makes vLLM's own resolver pick
    ``CpuPlatform``; older releases get ``vllm.platforms._current_platform`` set
    to a ``CpuPlatform`` before any connector module reads it.

    Raises if the platform is not CpuPlatform afterwards, or if an already
    imported vLLM module holds another platform (it would keep using it).
    """
    notes = []
    if _cpu_platform_requires_triton() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            # Construction only: the refusal guards running models on x86 CPUs, which the suite
            # never does.  With no GPU visible (true here), vllm/triton_utils/importing.py takes
            # the installed Triton as usable (its "distributed environment" branch).
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            notes.append("CUDA_VISIBLE_DEVICES='' (the release's CpuPlatform requires Triton on x86)")
    if _target_device_env_selects_cpu():
        # Before vllm.envs / vllm.platforms are imported (some releases cache env reads).
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        how = "VLLM_TARGET_DEVICE=cpu"
        import vllm.platforms as platforms
    else:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
        how = "vllm.platforms._current_platform = CpuPlatform()"
        notes += _platform_values_reread(platforms._current_platform)
    current = platforms.current_platform
    if current.device_type != "cpu":
        raise RuntimeError(f"could not select CpuPlatform ({how}); got {type(current).__name__}")
    stale = sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("vllm") and getattr(mod, "current_platform", current) is not current
    )
    if stale:
        raise RuntimeError(f"{how}, but these modules already hold another platform: {', '.join(stale)}")
    return "; ".join([how, *notes])
