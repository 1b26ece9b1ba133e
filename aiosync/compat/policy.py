"""Small helpers a policy worker uses while it starts up.

These are the process-level odds and ends around a training worker: which worker class to
launch, which Hugging Face auto class loads a checkpoint, what the worker's environment
says about engines, ranks and profiling, and where the initial Megatron checkpoint goes.

Nothing here imports transformers or any quantization library at module import time; each
function imports what it needs when it is called. Errors keep the builtin types NeMo-RL
raises and are also :class:`~aiosync.AiosyncError` (see :mod:`aiosync.compat.errors`).

Environment variables read by this module:

``NRL_VLLM_USE_V1`` (fallback ``VLLM_USE_V1``)
    ``"0"`` (or ``false``/``no``/``off``) turns the vLLM V1 engine off; anything else,
    or unset, leaves it on.
``NRL_NSYS_WORKER_PATTERNS``
    Comma-separated :mod:`fnmatch` patterns; a policy worker whose name matches one of
    them gets Nsight Systems profiling settings in its runtime env.
``NRL_NSYS_PROFILE_STEP_RANGE``
    Passed through to profiled workers only, e.g. ``"3:5"``.
``NRL_MEGATRON_CHECKPOINT_DIR``, ``HF_HOME``
    Where :func:`get_megatron_checkpoint_dir` puts the converted checkpoint.
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``CUDA_VISIBLE_DEVICES``
    Reported by :func:`get_gpu_info`.

In every case a value that is empty or only whitespace counts as unset.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from aiosync.compat.errors import CompatImportError, CompatValueError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AUTOMODEL_FACTORY",
    "POLICY_WORKER_OVERRIDES",
    "configure_dynamo_cache",
    "get_gpu_info",
    "get_megatron_checkpoint_dir",
    "get_runtime_env_for_policy_worker",
    "is_vllm_v1_engine_enabled",
    "resolve_model_class",
    "resolve_policy_worker_cls",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# Policy worker class selection
# --------------------------------------------------------------------------------------

_NRL_WORKERS = "nemo_rl.models.policy.workers"
_NRL_QUANT_WORKERS = "nemo_rl.modelopt.models.policy.workers"

POLICY_WORKER_OVERRIDES: dict[str, str] = {
    f"{_NRL_WORKERS}.megatron_policy_worker.MegatronPolicyWorker": (
        f"{_NRL_QUANT_WORKERS}.megatron_quant_policy_worker.MegatronQuantPolicyWorker"
    ),
    f"{_NRL_WORKERS}.dtensor_policy_worker.DTensorPolicyWorker": (
        f"{_NRL_QUANT_WORKERS}.dtensor_quant_policy_worker.DTensorQuantPolicyWorker"
    ),
    f"{_NRL_WORKERS}.dtensor_policy_worker_v2.DTensorPolicyWorkerV2": (
        f"{_NRL_QUANT_WORKERS}.dtensor_quant_policy_worker_v2.DTensorQuantPolicyWorkerV2"
    ),
}
"""Registry from a default policy worker's dotted name to its quantized counterpart.

It starts with NeMo-RL's workers; add entries
(``POLICY_WORKER_OVERRIDES["pkg.Worker"] = "pkg.QuantWorker"``) for your own.
"""


def resolve_policy_worker_cls(default_cls: str, config: Mapping[str, Any]) -> str:
    """Return the dotted name of the worker class to launch for ``config``.

    When ``config.get("quant_cfg")`` is truthy the quantized worker is returned: the
    entry for ``default_cls`` in :data:`POLICY_WORKER_OVERRIDES`; a worker with no entry
    raises :class:`~aiosync.compat.errors.CompatValueError` (a ``ValueError`` and an
    ``AiosyncError``) saying how to register one. When ``quant_cfg`` is missing,
    ``None`` or empty, ``default_cls`` is returned unchanged.

    Only names are handled: no worker module and no quantization library (such as
    ModelOpt) is imported, so this is safe to call where those are not installed.
    """
    if not config.get("quant_cfg"):
        return default_cls
    resolved = POLICY_WORKER_OVERRIDES.get(default_cls)
    if resolved is None:
        raise CompatValueError(
            f"quant_cfg is set but worker {default_cls!r} has no quantized counterpart; "
            "register one in aiosync.compat.policy.POLICY_WORKER_OVERRIDES"
        )
    logger.debug("quant_cfg set: policy worker %s -> %s", default_cls, resolved)
    return resolved


# --------------------------------------------------------------------------------------
# Hugging Face model class selection
# --------------------------------------------------------------------------------------

_HF_INSTALL_HINT = "pip install 'aiosync[hf]'"

_CAUSAL_LM = "AutoModelForCausalLM"
_IMAGE_TEXT_TO_TEXT = "AutoModelForImageTextToText"

AUTOMODEL_FACTORY: dict[str, Any] = {
    "llama": _CAUSAL_LM,
    "mistral": _CAUSAL_LM,
    "mixtral": _CAUSAL_LM,
    "qwen2": _CAUSAL_LM,
    "qwen3": _CAUSAL_LM,
    "qwen3_moe": _CAUSAL_LM,
    "gemma2": _CAUSAL_LM,
    "phi3": _CAUSAL_LM,
    "qwen2_vl": _IMAGE_TEXT_TO_TEXT,
    "qwen2_5_vl": _IMAGE_TEXT_TO_TEXT,
    "llava": _IMAGE_TEXT_TO_TEXT,
    "mllama": _IMAGE_TEXT_TO_TEXT,
    "gemma3": _IMAGE_TEXT_TO_TEXT,
    "idefics3": _IMAGE_TEXT_TO_TEXT,
}
"""Map from a lower-cased Hugging Face ``model_type`` to the auto class that loads it.

A value is either the *name* of a ``transformers`` attribute, looked up only when
:func:`resolve_model_class` runs, or a class object used as is. Users may add entries.
"""

# Older transformers releases name the image-text-to-text auto class differently.
_AUTO_CLASS_FALLBACKS: dict[str, str] = {_IMAGE_TEXT_TO_TEXT: "AutoModelForVision2Seq"}


def _import_transformers() -> ModuleType:
    """Import and return ``transformers``, or raise an ``ImportError`` naming the extra."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise CompatImportError(
            "transformers is required to resolve Hugging Face model classes but it is not "
            f"installed; install the extra with: {_HF_INSTALL_HINT}"
        ) from exc


def _load_hf_config(model_name: str) -> Any:
    """Load the Hugging Face config of ``model_name`` (a hub id or a local directory)."""
    transformers = _import_transformers()
    local = os.path.expanduser(model_name)
    source = local if os.path.exists(local) else model_name
    return transformers.AutoConfig.from_pretrained(source)


def _lookup_auto_class(transformers: ModuleType, entry: Any) -> Any:
    """Turn an :data:`AUTOMODEL_FACTORY` value into a class, or ``None`` if it is unknown."""
    if not isinstance(entry, str):
        return entry
    found = getattr(transformers, entry, None)
    if found is None and entry in _AUTO_CLASS_FALLBACKS:
        found = getattr(transformers, _AUTO_CLASS_FALLBACKS[entry], None)
    return found


def resolve_model_class(model_name: str) -> Any:
    """Return the ``transformers`` auto class that should load ``model_name``.

    The model's config is read with ``transformers.AutoConfig.from_pretrained`` (hub id or
    local path, ``~`` expanded), its ``model_type`` lower-cased and looked up in
    :data:`AUTOMODEL_FACTORY`. Unknown model types, and entries naming a class the
    installed ``transformers`` lacks, fall back to ``transformers.AutoModelForCausalLM``.

    Raises:
        ImportError: ``transformers`` is not installed; the message says to run
            ``pip install 'aiosync[hf]'``. The class raised,
            :class:`~aiosync.compat.errors.CompatImportError`, is also an ``AiosyncError``.
            Errors of ``transformers`` itself while reading the config (an unknown model,
            say) pass through unchanged, as in NeMo-RL.

    """
    transformers = _import_transformers()
    config = _load_hf_config(model_name)
    model_type = str(getattr(config, "model_type", "") or "").lower()
    entry = AUTOMODEL_FACTORY.get(model_type)
    cls = _lookup_auto_class(transformers, entry) if entry is not None else None
    if cls is None:
        if entry is not None:
            logger.debug(
                "transformers has no %r for model_type %r; using %s",
                entry,
                model_type,
                _CAUSAL_LM,
            )
        cls = transformers.AutoModelForCausalLM
    logger.debug("model %s (model_type %r) -> %s", model_name, model_type, cls)
    return cls


# --------------------------------------------------------------------------------------
# Environment queries
# --------------------------------------------------------------------------------------


def _env(name: str) -> str | None:
    """Return the stripped value of env var ``name``, or ``None`` if unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def is_vllm_v1_engine_enabled() -> bool:
    """Return whether the vLLM V1 engine should be used.

    Reads ``NRL_VLLM_USE_V1``; if that is unset or blank, ``VLLM_USE_V1``. The engine is
    off only when the value read is ``"0"`` (or, case-insensitively, ``false``, ``no``
    or ``off``); it is on for any other value and when neither variable is set.
    """
    value = _env("NRL_VLLM_USE_V1")
    if value is None:
        value = _env("VLLM_USE_V1")
    if value is None:
        return True
    return value.lower() not in _FALSE_WORDS


def _env_int(name: str) -> int | None:
    """Return env var ``name`` as an int, or ``None`` if it is unset, blank or not a number."""
    value = _env(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        logger.debug("ignoring non-integer %s=%r", name, value)
        return None


def get_gpu_info(model: torch.nn.Module) -> dict[str, Any]:
    """Describe where this worker and ``model`` run, for logs and debugging.

    The returned dict always has these keys:

    - ``device``: the device of the model's first parameter as a string, ``"cpu"`` when
      the model has no parameters; ``device_type`` is its type (``"cuda"``, ``"cpu"``...).
    - ``rank``, ``local_rank``, ``world_size``: ``RANK``, ``LOCAL_RANK`` and
      ``WORLD_SIZE`` from the environment as ints (``None`` if unset or not integers).
    - ``dist_initialized``; ``dist_rank``, ``dist_world_size``: from
      :mod:`torch.distributed` when it is available and initialized, else ``None``.
    - ``cuda_visible_devices``: ``CUDA_VISIBLE_DEVICES`` as set (``None`` if unset).
    - ``device_name``, ``device_index``, ``memory_total_bytes``,
      ``memory_allocated_bytes``, ``memory_reserved_bytes``: filled in when the model is
      on a CUDA device, ``None`` otherwise.

    Works on CPU and without an initialized process group.
    """
    import torch

    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")

    dist = torch.distributed
    dist_initialized = bool(dist.is_available() and dist.is_initialized())

    info: dict[str, Any] = {
        "device": str(device),
        "device_type": device.type,
        "rank": _env_int("RANK"),
        "local_rank": _env_int("LOCAL_RANK"),
        "world_size": _env_int("WORLD_SIZE"),
        "dist_initialized": dist_initialized,
        "dist_rank": dist.get_rank() if dist_initialized else None,
        "dist_world_size": dist.get_world_size() if dist_initialized else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_name": None,
        "device_index": None,
        "memory_total_bytes": None,
        "memory_allocated_bytes": None,
        "memory_reserved_bytes": None,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        info.update(
            device_name=torch.cuda.get_device_name(index),
            device_index=index,
            memory_total_bytes=int(torch.cuda.get_device_properties(index).total_memory),
            memory_allocated_bytes=int(torch.cuda.memory_allocated(index)),
            memory_reserved_bytes=int(torch.cuda.memory_reserved(index)),
        )
    return info


def configure_dynamo_cache() -> None:
    """Turn off TorchInductor's ``autotune_local_cache``.

    A local autotune cache written with a different order of node bundles can make
    compilation fail in ``cached_autotune`` (pytorch/pytorch#153791); disabling the cache
    avoids that. If torch or the setting does not exist in the installed version this
    does nothing and logs at debug level; it never raises for that reason.
    """
    try:
        inductor_config: Any = importlib.import_module("torch._inductor.config")
        inductor_config.autotune_local_cache = False
    except (ImportError, AttributeError) as exc:
        logger.debug("could not disable inductor autotune_local_cache: %s", exc)


# --------------------------------------------------------------------------------------
# Runtime env, checkpoints
# --------------------------------------------------------------------------------------

_NSYS_PATTERNS_ENV = "NRL_NSYS_WORKER_PATTERNS"
_NSYS_STEP_RANGE_ENV = "NRL_NSYS_PROFILE_STEP_RANGE"


def _nsys_patterns() -> list[str]:
    """Return the non-blank comma-separated patterns of ``NRL_NSYS_WORKER_PATTERNS``."""
    raw = os.environ.get(_NSYS_PATTERNS_ENV, "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def get_runtime_env_for_policy_worker(policy_worker_name: str) -> dict[str, Any]:
    """Return a Ray-style runtime env (``{"env_vars": {...}, ...}``) for a policy worker.

    A fresh dict is returned on each call; ``env_vars`` is always present (and empty
    unless profiling applies). Memory allocator settings such as expandable segments are
    not set here; the worker decides those itself once CUDA is up.

    Profiling is added only when ``policy_worker_name`` matches (case-sensitively, by
    :func:`fnmatch.fnmatchcase`) one of the comma-separated patterns in
    ``NRL_NSYS_WORKER_PATTERNS``. Then the result also carries an ``"nsight"`` entry of
    Nsight Systems options, with output named after the worker, and, when
    ``NRL_NSYS_PROFILE_STEP_RANGE`` is set, that value is passed through in ``env_vars``
    and capture is limited to the CUDA profiler API range the worker opens for it.
    """
    runtime_env: dict[str, Any] = {"env_vars": {}}
    patterns = _nsys_patterns()
    if not any(fnmatch.fnmatchcase(policy_worker_name, p) for p in patterns):
        return runtime_env

    safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", policy_worker_name) or "policy_worker"
    nsight: dict[str, str] = {
        "t": "cuda,cudnn,cublas,nvtx",
        "o": f"'{safe_name}_%p'",
        "stop-on-exit": "true",
    }
    step_range = _env(_NSYS_STEP_RANGE_ENV)
    if step_range is not None:
        runtime_env["env_vars"][_NSYS_STEP_RANGE_ENV] = step_range
        nsight["capture-range"] = "cudaProfilerApi"
        nsight["capture-range-end"] = "stop"
    runtime_env["nsight"] = nsight
    logger.debug("nsys profiling enabled for policy worker %s", policy_worker_name)
    return runtime_env


def get_megatron_checkpoint_dir() -> str:
    """Return the directory for the initial Hugging Face to Megatron checkpoint conversion.

    It should be reachable from every node. The first of these wins:

    1. ``$NRL_MEGATRON_CHECKPOINT_DIR``
    2. ``$HF_HOME/nemo_rl`` (``HF_HOME`` is often mounted everywhere already)
    3. ``~/.cache/huggingface/nemo_rl``

    Empty or whitespace-only values count as unset; values are stripped and ``~`` is
    expanded. The directory is not created. Like NeMo-RL, it announces its choice on
    stdout: ``Using default megatron checkpoint dir: <directory>``.
    """
    explicit = _env("NRL_MEGATRON_CHECKPOINT_DIR")
    hf_home = _env("HF_HOME")
    if explicit is not None:
        directory = os.path.expanduser(explicit)
    elif hf_home is not None:
        directory = os.path.join(os.path.expanduser(hf_home), "nemo_rl")
    else:
        directory = os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "nemo_rl")
    print(f"Using default megatron checkpoint dir: {directory}", flush=True)
    return directory
