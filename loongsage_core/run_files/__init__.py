"""A run directory's files: checkpoints (verified, pruned, resumed from) and the directory itself
(prepared for a new run, continued, or moved aside; per-step JSONL files cut back to a resumed
step). Shared by ``loongsage run``, ``loongsage sft`` and ``loongsage eval``, below all of them."""
