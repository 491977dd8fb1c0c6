"""Write the tiny vision-language fixture under tests/data/vlm/: tokenizer plus image processor.

The tokenizer is tests/data/tokenizer/ (same vocabulary, chat template and special tokens) with
the three Qwen2-VL vision tokens appended (``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>``: ids 512, 513, 514); the image processor is transformers' Qwen2-VL one with
4-pixel patches and at most 64x64 pixels, so an image costs a few dozen tokens. The model itself is
built from :data:`loongsage_plugin_torch.modeling.TINY_QWEN2_VL` (random weights, no files). Re-run
with ``python scripts/make_tiny_vlm.py`` to regenerate the directory.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "data" / "tokenizer"
OUT = ROOT / "tests" / "data" / "vlm"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def main() -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(SOURCE))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(OUT))
    processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64})
    processor.save_pretrained(str(OUT))
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    print(f"wrote {OUT}: vision token ids {dict(zip(VISION_TOKENS, ids))}")


if __name__ == "__main__":
    main()
