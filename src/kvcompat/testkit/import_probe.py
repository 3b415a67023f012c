"""``python -m kvcompat.testkit.import_probe``: does the vLLM code every test needs import?

The runner asks when a cell's suite errored, a test of it errored, or no test passed: if this fails,
the cell is an import error (vLLM's fault or its environment's), never a test verdict, and a bisect
skips it.  It imports, on the platform the suite uses, the modules that every connector test builds on,
where the installed distribution ships them (a probe of its RECORD, so an absent module is skipped,
never mistaken for a broken one), then MultiConnector's two children as the release resolves them: its
KVConnectorFactory's registry by name (NixlConnector, and the CPU-offload child the suite deploys),
else the child's module.  A child that does not import ends with one line naming it.
"""

from __future__ import annotations

import importlib
import sys

from kvcompat.testkit import probes

MARK = "KVCOMPAT-PROBE vllm imported"
MODULES = (
    "vllm",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
)
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def children() -> list[tuple[str, str, str]]:
    """(what, registered name, module) of each child the suite deploys, as this release ships them."""
    from kvcompat.testkit.adapter import capabilities as cap

    offload = cap.V1 + (".simple_cpu_offload_connector" if cap.has_simple_cpu_offload() else ".offloading_connector")
    return [
        ("the Nixl child", "NixlConnector", cap.nixl_module()),
        ("the CPU-offload child", cap.offload_child_name(), offload),
    ]


def import_child(registry: dict, name: str, module: str) -> None:
    if name in registry:
        registry[name]()  # the factory's loader: imports the child's module, returns its class
    elif probes.has_module(module):
        importlib.import_module(module)


def main() -> None:
    if probes.has_module("vllm.platforms.cpu"):
        from kvcompat.testkit.adapter import select_cpu_platform

        select_cpu_platform()
    for name in MODULES:
        if name == "vllm" or probes.has_module(name):
            importlib.import_module(name)
    registry = importlib.import_module(FACTORY).KVConnectorFactory._registry if probes.has_module(FACTORY) else {}
    for what, name, module in children():
        try:
            import_child(registry, name, module)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            why = " ".join(str(exc).split())  # one line, however the error wraps
            print(f"ImportError: {what} {name} does not import: {type(exc).__name__}: {why}", file=sys.stderr)
            sys.exit(1)
    print(MARK)


if __name__ == "__main__":
    main()
