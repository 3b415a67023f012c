"""``python -m kvcompat.testkit.import_probe``: does the vLLM code every test needs import?

The runner asks when a cell's suite errored, or when no test passed: if this fails, the cell
is an import error (vLLM's fault or its environment's), never a test verdict.  It imports,
on the platform the suite uses, the modules that every connector test builds on, where the
installed distribution ships them (a probe of its RECORD, so an absent module is skipped,
never mistaken for a broken one).
"""

from __future__ import annotations

import importlib

from kvcompat.testkit import probes

MARK = "KVCOMPAT-PROBE vllm imported"
MODULES = (
    "vllm",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
)


def main() -> None:
    if probes.has_module("vllm.platforms.cpu"):
        from kvcompat.testkit.adapter import select_cpu_platform

        select_cpu_platform()
    for name in MODULES:
        if name == "vllm" or probes.has_module(name):
            importlib.import_module(name)
    print(MARK)


if __name__ == "__main__":
    main()
