"""A checkpoint's own MTP weights: found, loaded, and fed post-norm states exactly as pre-norm ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from neural_drafters.drafting import DraftSettings, HeadDrafter
from neural_drafters.heads import TargetParts
from neural_drafters.mtp_loader import find_mtp_layout, load_mtp_head
from verifier.testing import tiny_model

D = 64


def synthetic_mtp(config, prefix: str, names: dict[str, str], seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one MTP module under ``prefix`` (norm weights away from 1 on purpose)."""
    g = torch.Generator().manual_seed(seed)
    block = LlamaDecoderLayer(config, layer_idx=0)
    tensors = {prefix + k: (v + 0.1 * torch.randn(v.shape, generator=g)).contiguous()
               for k, v in block.state_dict().items()}
    tensors[prefix + names["enorm"]] = 1 + 0.3 * torch.randn(D, generator=g)
    tensors[prefix + names["hnorm"]] = 1 + 0.3 * torch.randn(D, generator=g)
    tensors[prefix + names["proj"]] = 0.1 * torch.randn(D, 2 * D, generator=g)
    tensors[prefix + names["norm"]] = 1 + 0.3 * torch.randn(D, generator=g)
    return tensors


DEEPSEEK = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "proj": "eh_proj.weight", "norm": "shared_head.norm.weight"}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny Llama saved with one DeepSeek-layout MTP module (layer index num_hidden_layers)."""
    folder = tmp_path_factory.mktemp("mtp-model")
    model = tiny_model("llama", vocab_size=128, seed=4, init_range=0.3)
    with torch.no_grad():
        model.model.norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(9)))
    model.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    tensors = synthetic_mtp(model.config, "model.layers.2.", DEEPSEEK, seed=5)
    tensors["model.layers.2.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    save_file(tensors, str(folder / "mtp.safetensors"))
    return model, folder, tensors


def reference_logits(model, tensors, ids: list[int]) -> torch.Tensor:
    """DeepSeek-V3's module 1 written with transformers' own layer, fed the *pre*-norm states."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.setdefault("pre", args[0]))
    with torch.inference_mode():
        model(torch.tensor([ids]))
    hook.remove()
    pre = captured["pre"][0, :-1]  # h_0 .. h_{n-2}
    p = "model.layers.2."
    cfg = model.config
    enorm, hnorm, norm = (LlamaRMSNorm(D, eps=cfg.rms_norm_eps) for _ in range(3))
    enorm.weight.data, hnorm.weight.data = tensors[p + "enorm.weight"], tensors[p + "hnorm.weight"]
    norm.weight.data = tensors[p + "shared_head.norm.weight"]
    block = LlamaDecoderLayer(cfg, layer_idx=0)
    block.load_state_dict({k[len(p):]: v for k, v in tensors.items() if k[len(p):] in block.state_dict()})
    with torch.inference_mode():
        emb = model.model.embed_tokens(torch.tensor([ids[1:]]))
        x = torch.cat([enorm(emb), hnorm(pre[None])], -1) @ tensors[p + "eh_proj.weight"].T
        positions = torch.arange(len(ids) - 1)[None]
        cos_sin = LlamaRotaryEmbedding(cfg)(x, positions)
        n = len(ids) - 1
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = block(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return model.lm_head(norm(out))[0]  # [n, V]: row j predicts token j+2


def test_layout_found_and_module_matches_transformers(mtp_model) -> None:
    model, folder, tensors = mtp_model
    assert find_mtp_layout(folder) == ("deepseek", ["model.layers.2."])
    head = load_mtp_head(folder, model.config)
    assert head.config.num_heads == 1 and not head.config.hidden_post_norm
    ids = np.random.default_rng(0).integers(0, 128, 14).tolist()
    expected = reference_logits(model, tensors, ids)
    parts = TargetParts.from_model(model, head.d2t)
    head.set_post_norm_inputs(parts.final_norm)  # the verifier hands post-norm states
    with torch.inference_mode():
        post = model.base_model(torch.tensor([ids])).last_hidden_state[0]
    request = HeadDrafter(head, parts, DraftSettings(top_k=4, depth=3)).start(ids)
    request.observe_hidden(post[:-1])
    draft = request.propose(4)
    probs = torch.softmax(expected[-1], -1)
    assert len(draft) == 4
    for tok, q in zip(draft.token_ids.tolist(), draft.probs.tolist()):
        assert abs(float(probs[tok]) - q) < 1e-4
    assert set(draft.token_ids.tolist()) == set(probs.topk(4).indices.tolist())


def test_model_without_mtp_weights_says_so(tmp_path) -> None:
    model = tiny_model("llama", vocab_size=128, seed=4)
    model.save_pretrained(str(tmp_path))
    assert find_mtp_layout(tmp_path) is None
    with pytest.raises(ValueError, match="ships no multi-token-prediction weights"):
        load_mtp_head(tmp_path, model.config)


def test_mimo_layout_and_unsupported_blocks(tmp_path) -> None:
    model = tiny_model("llama", vocab_size=128, seed=4)
    model.save_pretrained(str(tmp_path))
    names = {"enorm": "token_layernorm.weight", "hnorm": "hidden_layernorm.weight", "proj": "input_proj.weight",
             "norm": "final_layernorm.weight"}
    tensors = synthetic_mtp(model.config, "model.mtp_layers.0.", names, seed=6)
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    assert find_mtp_layout(tmp_path) == ("mimo", ["model.mtp_layers.0."])
    head = load_mtp_head(tmp_path, model.config)
    assert torch.equal(head.module(1).enorm.weight, tensors["model.mtp_layers.0.token_layernorm.weight"])
    tensors["model.mtp_layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ValueError, match="mlp.experts.0.up_proj.weight"):
        load_mtp_head(tmp_path, model.config)
