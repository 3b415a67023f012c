"""The CPU-offload child's class, named in its ``kv_connector_module_path``: the release's own, unchanged.

vLLM's factory imports this module for the child (its extension point for connectors outside the
registry) and takes the class from it by the child's ``kv_connector`` name.  The classes here are
the release's own class objects; importing the module on vLLM's CpuPlatform also installs
:mod:`kvcompat.testkit.cuda_transport` in SimpleCPUOffload's worker modules, the one thing a CPU
lacks.  Because the factory imports it, the substitution travels with the configuration, into any
process that builds the connector (an engine core, a worker).

Releases whose factory consults its registry before the module path (0.19-0.23) would never import
this module for a registered name, so the class is also exported under an unregistered alias
(``OFFLOAD_CHILD_ALIAS``); :func:`kvcompat.testkit.adapter.config.offload_child_config` picks the
name by a probe of the factory.

Up to 0.18 the CPU-offload child is OffloadingConnector, whose CPU worker is not run on a CPU (see
:mod:`kvcompat.testkit.adapter.offload_script`); its class is re-exported as is.
"""

from __future__ import annotations

import importlib

from kvcompat.testkit import probes

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"

# KvcompatCPUOffloadConnector is kvcompat.testkit.adapter.config.OFFLOAD_CHILD_ALIAS.
if probes.has_module(_V1 + ".simple_cpu_offload_connector"):
    SimpleCPUOffloadConnector = importlib.import_module(_V1 + ".simple_cpu_offload_connector").SimpleCPUOffloadConnector
    KvcompatCPUOffloadConnector = SimpleCPUOffloadConnector
else:
    OffloadingConnector = importlib.import_module(_V1 + ".offloading_connector").OffloadingConnector
    KvcompatCPUOffloadConnector = OffloadingConnector

from vllm.platforms import current_platform  # noqa: E402

if current_platform.device_type == "cpu" and probes.has_module(_V1 + ".simple_cpu_offload_connector"):
    from kvcompat.testkit import cuda_transport

    cuda_transport.install()
