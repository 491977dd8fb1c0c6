"""scripts/make_smollm2.py's conversion on a tiny Llama GGUF file written here with the ``gguf``
writer: the Hugging Face directory it writes computes the same logits as the model the file was
made from, passes ``loongsage validate``, serves through the embedded engine, and its chat
template renders tools, tool calls and tool results the hermes way the router's parser reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "tests" / "data" / "tokenizer"
sys.path.insert(0, str(REPO / "scripts"))

import make_smollm2  # noqa: E402

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2


def llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order in GGUF files (its convert_hf_to_gguf.py ``permute``)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random tiny Llama (the test tokenizer's vocabulary) and the GGUF file written from it."""
    import gguf
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tok))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = {t: i for t, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in data["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        for hf, gg in names.items():
            weight = sd[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                weight = llama_permute(weight, HEADS)
            elif hf == "self_attn.k_proj":
                weight = llama_permute(weight, KV_HEADS)
            w.add_tensor(f"blk.{i}.{gg}.weight", weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model, tok


@pytest.fixture(scope="module")
def converted(slow_fixture, tiny_gguf, tmp_path_factory):
    path, _, _ = tiny_gguf
    return make_smollm2.convert_gguf(path, tmp_path_factory.mktemp("hf") / "model")


def test_the_converted_model_computes_what_the_gguf_file_holds(tiny_gguf, converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, original, tok = tiny_gguf
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    assert not hasattr(model.config, "quantization_config")
    assert sorted(p.name for p in converted.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
    ids = torch.tensor([tok.encode("What is 3 + 4? The answer is 7.")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)
    written = AutoTokenizer.from_pretrained(str(converted))
    text = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>"
    assert written.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert written.eos_token == "<|im_end|>"


def test_the_chat_template_renders_tools_the_hermes_way(converted):
    from loongsage_plugin_agents.tool_parser import parse_hermes
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    tools = [{"type": "function", "function": {"name": "search", "description": "Search the documents.",
                                               "parameters": {"type": "object",
                                                              "properties": {"query": {"type": "string"}}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Kazal"}'}}
    messages = [{"role": "user", "content": "Where is Kazal?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "[1] Kazal: A city in Velonia."}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{make_smollm2.DEFAULT_SYSTEM}\n\n# Tools\n")
    assert json.dumps(tools[0]) in text  # the schema, as JSON, in the system turn
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    rest, calls = parse_hermes(turn)  # the call is written as the router's parser reads it
    assert rest == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"query": "Kazal"})]
    assert "<|im_start|>user\n<tool_response>\n[1] Kazal: A city in Velonia.\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  tokenize=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_loongsage_validates_and_serves_the_converted_model(converted, tmp_path):
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine

    from loongsage_core.config import structure_job
    from loongsage_core.engine_client import EngineClient
    from loongsage_hookspecs import EngineContext

    job = tmp_path / "job.toml"
    job.write_text(f'[model]\npath = "{converted}"\n\n[rollout]\nmax_context_length = 512\n\n'
                   '[[data]]\ngenerator = "arithmetic"\n')
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "validate", str(job)], capture_output=True,
                         text=True)
    assert out.returncode == 0 and f"{job}: OK" in out.stdout, out.stderr
    engine = EmbeddedEngine(EngineContext(job=structure_job({"model": {"path": str(converted)},
                                                             "rollout": {"max_context_length": 512}}),
                                          components=None))
    url = engine.start()
    try:
        [result] = EngineClient(url).generate_sync([3, 4, 5], {"max_new_tokens": 5, "temperature": 0.0,
                                                               "ignore_eos": True})
        assert len(result.output_ids) == 5
    finally:
        engine.shutdown()
