"""Loading a checkpoint's own multi-token-prediction weights (when the target ships them).

Layouts understood (key prefixes in the model's safetensors):

* DeepSeek-V3 / GLM-4.5: ``model.layers.{N + k}.`` for k < ``num_nextn_predict_layers`` (N =
  ``num_hidden_layers``) with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder layer;
* MiMo: ``model.mtp_layers.{k}.`` with ``token_layernorm``, ``hidden_layernorm``, ``input_proj``,
  ``final_layernorm`` and a decoder layer.

The decoder layer must be a dense Llama-style block (q/k/v/o projections, SwiGLU MLP); multi-head
latent attention and mixture-of-experts blocks are refused with the key that shows them. Token
embeddings and the output head are the target's (DeepSeek-V3 shares them; copies in the MTP layer are
ignored). These modules were trained on pre-final-norm states: the loaded head is marked so the drafter
feeds the verifier's post-norm states through ``MTPHead.set_post_norm_inputs``.

SmolLM2-135M (the default target) has no MTP weights: ``find_mtp_layout`` returns None and
``load_mtp_head`` raises ValueError saying so; train a head with ``reprise train-drafter --kind mtp``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from neural_drafters.config import HeadConfig
from neural_drafters.heads import MTPHead

# our module's parameter -> the name of each layout's tensor (decoder-layer names are shared)
_NAMES = {
    "deepseek": {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                 "norm.weight": "shared_head.norm.weight"},
    "mimo": {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
             "eh_proj.weight": "input_proj.weight", "norm.weight": "final_layernorm.weight"},
}
_BLOCK = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_IGNORED = ("embed_tokens.weight", "shared_head.head.weight")
_UNSUPPORTED = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "experts", "mlp.gate.weight", "q_norm", "k_norm")


def _tensor_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                index[key] = path
    return index


def find_mtp_layout(folder: str | Path) -> tuple[str, list[str]] | None:
    """(layout name, one key prefix per MTP module) of a model folder, or None when it has none."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    index = _tensor_index(folder)
    n_layers = int(config.get("num_hidden_layers", 0))
    n_mtp = int(config.get("num_nextn_predict_layers", 0) or 0)
    prefixes = [f"model.layers.{n_layers + k}." for k in range(n_mtp)]
    if prefixes and all(p + "eh_proj.weight" in index for p in prefixes):
        return "deepseek", prefixes
    k = 0
    mimo = []
    while f"model.mtp_layers.{k}.input_proj.weight" in index:
        mimo.append(f"model.mtp_layers.{k}.")
        k += 1
    return ("mimo", mimo) if mimo else None


def load_mtp_head(folder: str | Path, target_config: Any) -> MTPHead:
    """The target's own MTP modules as an ``MTPHead`` (full vocabulary, pre-norm inputs)."""
    folder = Path(folder)
    found = find_mtp_layout(folder)
    if found is None:
        raise ValueError(f"the model at {str(folder)!r} ships no multi-token-prediction weights "
                         "(no num_nextn_predict_layers modules, no mtp_layers): train a head instead")
    layout, prefixes = found
    index = _tensor_index(folder)
    for key in index:
        if any(key.startswith(p) for p in prefixes) and any(u in key for u in _UNSUPPORTED):
            raise ValueError(f"unsupported MTP block in {folder}: {key!r} (only dense Llama-style blocks load)")
    config = HeadConfig.for_target(target_config, "mtp", num_heads=len(prefixes), target=str(folder))
    config = HeadConfig.from_dict({**config.to_dict(), "hidden_post_norm": False})
    head = MTPHead(config)
    state: dict[str, torch.Tensor] = {}
    for k, prefix in enumerate(prefixes):
        names = {**_NAMES[layout], **{f"block.{b}": b for b in _BLOCK}}
        for ours, theirs in names.items():
            key = prefix + theirs
            if key not in index:
                raise ValueError(f"MTP module {k} in {folder} lacks {key!r}")
            with safe_open(str(index[key]), framework="pt") as fh:
                state[f"modules_.{k}.{ours}"] = fh.get_tensor(key).float()
        extra = [key for key in index if key.startswith(prefix) and key[len(prefix):] not in
                 set(names.values()) | set(_IGNORED)]
        if extra:
            raise ValueError(f"MTP module {k} in {folder} has tensors this loader does not know: {extra[:3]}")
    state["d2t"] = torch.as_tensor(head.d2t)
    head.load_state_dict(state, strict=True)
    return head.eval()
