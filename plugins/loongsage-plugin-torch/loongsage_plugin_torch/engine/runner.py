"""Batched forward passes of a transformers causal LM against the engine's slot KV cache.

The runner reuses the model's own weights and sub-modules (embeddings, rotary-embedding tables,
RMSNorm epsilons, activation, output head) and replaces the per-layer bookkeeping with a lean
path built for many short decode steps:

* the q/k/v projections and the gate/up projections of each layer are fused into one matrix each,
  and every projection matrix is stored transposed (``[in, out]``, the faster layout for CPU
  matrix products with few rows); the model's parameters become (transposed) views into that
  storage, so an in-place weight update of ``...q_proj.weight`` updates what the runner uses;
  with ``packed_weights`` the products use a copy packed for oneDNN (:mod:`.packed_linear`),
  faster for bfloat16 and for large float32 models, packed again after the parameters change in
  place;
* keys and values go into :class:`~.kv_cache.SlotKVCache` rows and every query attends to its own
  row with a causal, length-aware mask; a sliding-window layer (``layer_types`` /
  ``sliding_window``, as transformers reads them) also masks keys older than its window and reads
  only the keys its window reaches;
* a LoRA adapter applied unmerged (``lora_mode = "unmerged"``) rides on the fused projections:
  ``x @ W + scaling * (x @ A) @ B`` for the tokens of the rows that name it, with each fused
  matrix's ``A`` stacked and ``B`` block-diagonal, so one fused projection stays two extra
  products however many of its parts are adapted;
* one call serves prefill/extend (new tokens of ``P`` rows packed back to back, for slots that
  already hold ``starts[i]`` positions: 0 for a fresh prompt, ``p`` after a prefix-cache hit,
  earlier chunks of a long prompt) and decode (one token per row). Projections and MLPs see only
  real tokens, never padding.

At construction the runner checks its fast RMSNorm and rotary formula against the model's own
modules on random inputs and refuses to run when they disagree, so a family with a different
convention fails loudly instead of producing wrong log-probabilities. Log-probabilities agree
with a plain full-sequence forward of the same model to float32 rounding (tests check 1e-5).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import attrs

from .kv_cache import SlotKVCache
from .packed_linear import PackedWeight, packing_works, worth_packing
from .vision import VISION_MODEL_TYPES, VisionInputs

if TYPE_CHECKING:  # pragma: no cover
    import torch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe", "mixtral", "qwen2_vl")
"""The families the runner runs; ``qwen2_vl`` is a vision-language model (:mod:`.vision`): its text
model runs here with multimodal rotary positions, its vision encoder as the model has it."""
FUSED_DECODE_KEYS = 4096
"""From this many keys a decode step's attention uses the fused SDPA kernel, which splits the keys
across threads (a 6-layer, 384-wide model decoding 4 rows at 20K keys on 2 threads: 57 ms a step
instead of 62 ms); at a few hundred keys the two plain matrix products are faster."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the embedded engine can run; the message says why."""


@attrs.define(eq=False)
class _Norm:
    weight: Any
    eps: float


@attrs.define(eq=False)
class _LoraDelta:
    """An unmerged LoRA update of one fused projection: ``scaling * (x @ a_t) @ b_t``, with
    ``a_t`` ``[in, R]`` (the adapted parts' ``A`` stacked) and ``b_t`` ``[R, out]`` (their ``B``
    on the block diagonal, each in its part's output columns)."""

    a_t: Any
    b_t: Any
    scaling: float


AdapterTokens = Any
"""Which packed tokens get the unmerged adapter: ``None`` (none), ``slice(None)`` (all) or a
``[N, 1]`` 0/1 mask (a mixed batch: the low-rank product runs on every token and is masked,
cheaper than gathering and scattering the adapter's tokens)."""


@attrs.define(eq=False)
class _Linear:
    """``x @ weight_t + bias`` with ``weight_t`` stored ``[in, out]``, plus an unmerged LoRA
    update on the tokens :data:`AdapterTokens` selects."""

    weight_t: Any
    bias: Any
    lora: _LoraDelta | None = None
    packed: PackedWeight | None = None

    def __call__(self, x: "torch.Tensor", adapter_tokens: AdapterTokens = None) -> "torch.Tensor":
        import torch

        if self.packed is not None:
            y = self.packed.linear(x, self.bias)
        elif self.bias is None:
            y = torch.mm(x, self.weight_t)
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        lora = self.lora
        if lora is None or adapter_tokens is None:
            return y
        low_rank = torch.mm(x, lora.a_t)
        if not isinstance(adapter_tokens, slice):
            low_rank.mul_(adapter_tokens)
        return y.addmm_(low_rank, lora.b_t, alpha=lora.scaling)


@attrs.define(eq=False)
class _Experts:
    """A mixture-of-experts block (Qwen3-MoE's layout): the router's ``[E, H]`` weight, the
    experts' stacked ``[E, 2I, H]`` gate/up and ``[E, H, I]`` down projections (the model's own
    parameters, so in-place weight updates reach them), and the routing rule."""

    router: Any
    gate_up: Any
    down: Any
    act: Any
    top_k: int
    norm_topk_prob: bool


@attrs.define(eq=False)
class _Layer:
    """The tensors one decoder layer needs, fused where that saves matrix multiplications; a
    mixture-of-experts layer has ``experts`` in place of the dense MLP's projections."""

    attn_norm: _Norm
    qkv: _Linear
    qk_norm: tuple[_Norm, _Norm] | None
    o_proj: _Linear
    mlp_norm: _Norm
    gate_up: _Linear | None
    act: Any
    down: _Linear | None
    experts: _Experts | None = None


def _fuse_linears(linears: Sequence[Any]) -> tuple[_Linear, list[tuple[int, int]]]:
    """Stack ``linears`` along the output axis into one transposed ``[in, out]`` matrix (and one
    bias) and make each module's parameters views into it, so in-place updates reach both;
    returns it with each linear's ``(first column, width)`` in it."""
    import torch

    weight_t = torch.cat([lin.weight.detach() for lin in linears], 0).t().contiguous()
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if all(has_bias):
        bias = torch.cat([lin.bias.detach() for lin in linears], 0).contiguous()
    elif any(has_bias):
        raise UnsupportedModelError("embedded engine: projections of one layer mix biased and unbiased linears")
    spans, offset = [], 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight_t[:, offset: offset + rows].t()
        if bias is not None:
            lin.bias.data = bias[offset: offset + rows]
        spans.append((offset, rows))
        offset += rows
    return _Linear(weight_t, bias), spans


ATTENTION_TYPES = ("full_attention", "sliding_attention")


def _attention_windows(config: Any) -> list[int | None]:
    """Each decoder layer's attention window: ``None`` for full attention, ``w`` for a sliding
    window (a query at position ``q`` sees keys ``q - w < k <= q``, the transformers convention)."""
    count = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * count)
    unknown = sorted(set(layer_types) - set(ATTENTION_TYPES))
    if unknown:
        raise UnsupportedModelError(f"embedded engine: layer types {unknown} are not supported "
                                    f"(supported: {', '.join(ATTENTION_TYPES)})")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise UnsupportedModelError(f"embedded engine: sliding-attention layers need a positive "
                                    f"'sliding_window', the config has {window!r}")
    return [window if kind == "sliding_attention" else None for kind in layer_types[:count]]


def _norm_of(module: Any) -> _Norm:
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
    if eps is None or not hasattr(module, "weight"):
        raise UnsupportedModelError(f"embedded engine: unsupported norm module {type(module).__name__}")
    return _Norm(module.weight, float(eps))


class ModelRunner:
    """Owns the model and the slot KV cache; computes next-token logits for batches of slots."""

    def __init__(self, model: Any, *, num_slots: int, fp32_lm_head: bool = False,
                 packed_weights: bool | str = False) -> None:
        """``fp32_lm_head`` computes the output layer in float32 on a half-precision model (the
        trainer's ``[model] fp32_lm_head``), so sampled log-probs match the trainer's more closely.
        ``packed_weights`` multiplies by weights packed for oneDNN (:mod:`.packed_linear`) where
        this torch build does that right (``"auto"``: only where that is faster for this model's
        precision and size, :func:`~.packed_linear.worth_packing`); else by the plain weights."""
        import torch

        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"embedded engine: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        self.vision = model_type in VISION_MODEL_TYPES
        text_config = config.get_text_config() if self.vision else config
        self.windows = _attention_windows(text_config)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self._torch = torch
        self.model = model
        self.config = config
        self.text_config = text_config
        base = model.model.language_model if self.vision else model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm = _norm_of(base.norm)
        self.lm_head = model.lm_head
        self.fp32_lm_head = fp32_lm_head
        decoder_layers = list(base.layers[: text_config.num_hidden_layers])
        attn0 = decoder_layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.scaling = float(attn0.scaling)
        self.num_heads = int(text_config.num_attention_heads)
        self.kv_heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
        self.vocab_size = int(text_config.vocab_size)
        self.dtype = next(model.parameters()).dtype
        self._check_conventions(decoder_layers[0])
        # the fused matrix, column offset and width of every projection weight, by its HF name
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._parts: dict[str, tuple[_Linear, int, int]] = {}
        self.has_unmerged_adapter = False
        self.fused_decode_keys = FUSED_DECODE_KEYS
        if packed_weights == "auto":
            packed_weights = worth_packing(self.dtype, sum(p.numel() for p in model.parameters()))
        self.packed_weights = bool(
            packed_weights and model.device.type == "cpu"
            and packing_works(self.dtype, text_config.hidden_size, self.num_heads * self.head_dim))
        self.layers = [self._prepare(layer) for layer in decoder_layers]
        self._packed_head = (PackedWeight(lambda: self.lm_head.weight, [self.lm_head.weight],
                                          plain_single_row=self.dtype == torch.float32)
                             if self.packed_weights and getattr(self.lm_head, "bias", None) is None else None)
        #: the decoder layers with experts (their routing is kept with the KV, see :meth:`routed_experts`)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if layer.experts is not None]
        self.moe_top_k = max((self.layers[i].experts.top_k for i in self.moe_layers), default=0)
        self.cache = SlotKVCache(num_layers=len(self.layers), num_slots=num_slots, kv_heads=self.kv_heads,
                                 head_dim=self.head_dim, dtype=self.dtype, route_layers=len(self.moe_layers),
                                 top_k=self.moe_top_k)

    # ------------------------------------------------------------------------------------------
    def _prepare(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        common = dict(attn_norm=_norm_of(layer.input_layernorm),
                      qkv=self._fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                      qk_norm=self._qk_norms(attn) if qk_norm else None,
                      o_proj=self._fuse([attn.o_proj]), mlp_norm=_norm_of(layer.post_attention_layernorm))
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            return _Layer(**common, gate_up=None, act=None, down=None, experts=self._experts_of(mlp))
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, name):
                raise UnsupportedModelError(f"embedded engine: MLP without '{name}' ({type(mlp).__name__})")
        return _Layer(**common, gate_up=self._fuse([mlp.gate_proj, mlp.up_proj]), act=mlp.act_fn,
                      down=self._fuse([mlp.down_proj]))

    @staticmethod
    def _experts_of(block: Any) -> _Experts:
        """The :class:`_Experts` of a sparse MoE block with Qwen3-MoE's layout, or a clear refusal."""
        experts, gate = block.experts, block.gate
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        weight = getattr(gate, "weight", None)
        if gate_up is None or down is None or weight is None or gate_up.dim() != 3 or down.dim() != 3:
            raise UnsupportedModelError(f"embedded engine: mixture-of-experts block {type(block).__name__} is not "
                                        "in the supported layout (a router 'gate.weight' [E, H], experts' "
                                        "stacked 'gate_up_proj' [E, 2I, H] and 'down_proj' [E, H, I])")
        return _Experts(router=weight, gate_up=gate_up, down=down, act=experts.act_fn, top_k=int(gate.top_k),
                        norm_topk_prob=bool(getattr(gate, "norm_topk_prob", True)))  # Mixtral: always

    def _fuse(self, linears: Sequence[Any]) -> _Linear:
        """:func:`_fuse_linears`, remembering where each projection's columns went."""
        fused, spans = _fuse_linears(linears)
        for lin, (offset, rows) in zip(linears, spans):
            self._parts[self._module_names[id(lin)] + ".weight"] = (fused, offset, rows)
        if self.packed_weights:  # packed again when any of the parts' parameters changes in place
            sources = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
            fused.packed = PackedWeight(lambda: fused.weight_t.t(), sources,
                                        plain_single_row=self.dtype == self._torch.float32)
        return fused

    # ------------------------------------------------------------------------------------------
    @property
    def adaptable_weights(self) -> frozenset[str]:
        """The weights an unmerged adapter may change: every attention and MLP projection."""
        return frozenset(self._parts)

    def set_unmerged_adapter(self, factors: Mapping[str, tuple["torch.Tensor", "torch.Tensor"]],
                             scaling: float) -> None:
        """Apply ``scaling * B @ A`` of each ``weight name -> (A [r, in], B [out, r])`` unmerged, to
        the tokens of the rows :meth:`forward` is told use it; replaces any earlier adapter."""
        torch = self._torch
        unknown = sorted(set(factors) - set(self._parts))
        if unknown:
            raise ValueError(f"'{unknown[0]}' is not an attention or MLP projection")
        grouped: dict[int, tuple[_Linear, list[tuple[int, int, Any, Any]]]] = {}
        for name, (a, b) in factors.items():
            fused, offset, rows = self._parts[name]
            grouped.setdefault(id(fused), (fused, []))[1].append((offset, rows, a, b))
        for fused, _, _ in self._parts.values():
            fused.lora = None
        for fused, parts in grouped.values():
            parts.sort(key=lambda part: part[0])
            a_t = torch.cat([a for _, _, a, _ in parts], 0).t().to(self.dtype).contiguous()
            b_t = a_t.new_zeros(a_t.shape[1], fused.weight_t.shape[1])
            r0 = 0
            for offset, rows, a, b in parts:
                b_t[r0: r0 + a.shape[0], offset: offset + rows] = b.t()
                r0 += a.shape[0]
            fused.lora = _LoraDelta(a_t, b_t, float(scaling))
        self.has_unmerged_adapter = bool(grouped)

    @staticmethod
    def _qk_norms(attn: Any) -> tuple[_Norm, _Norm]:
        q_norm, k_norm = _norm_of(attn.q_norm), _norm_of(attn.k_norm)
        if q_norm.eps != k_norm.eps:
            raise UnsupportedModelError("embedded engine: q_norm and k_norm with different epsilons")
        return q_norm, k_norm

    def _check_conventions(self, layer: Any) -> None:
        """Compare the fast RMSNorm and rotary formulas with the model's own modules."""
        torch = self._torch
        gen = torch.Generator().manual_seed(0)
        tol = 1e-5 if self.dtype == torch.float32 else 3e-2  # half precision rounds the two paths apart
        with torch.no_grad():
            x = torch.randn(2, 3, self.text_config.hidden_size, generator=gen, dtype=self.dtype)
            ref = layer.input_layernorm(x)
            got = self._rms(x, _norm_of(layer.input_layernorm))
            if not torch.allclose(ref, got, atol=tol, rtol=tol):
                raise UnsupportedModelError(
                    f"embedded engine: {type(layer.input_layernorm).__name__} is not a standard RMSNorm")
            q = torch.randn(2, 3, self.num_heads, self.head_dim, generator=gen, dtype=self.dtype)
            k = torch.randn(2, 3, self.kv_heads, self.head_dim, generator=gen, dtype=self.dtype)
            pos = torch.tensor([[0, 5, 9], [3, 4, 100]])
            cos, sin = self.rotary(x, pos)
            family_rope = sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb
            ref_q, ref_k = family_rope(q, k, cos, sin, unsqueeze_dim=2)
            sin_signed = self._signed_sin(sin).unsqueeze(2)
            got_q, got_k = self._rope(q, cos.unsqueeze(2), sin_signed), self._rope(k, cos.unsqueeze(2), sin_signed)
            close = all(torch.allclose(a, b, atol=tol, rtol=tol) for a, b in ((ref_q, got_q), (ref_k, got_k)))
            if not close:
                raise UnsupportedModelError("embedded engine: the model's rotary embedding convention is not supported")

    def _rms(self, x: "torch.Tensor", norm: _Norm) -> "torch.Tensor":
        return self._torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)

    def _signed_sin(self, sin: "torch.Tensor") -> "torch.Tensor":
        half = self.head_dim // 2
        return self._torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _rope(self, x: "torch.Tensor", cos: "torch.Tensor", sin_signed: "torch.Tensor") -> "torch.Tensor":
        # rotate-half RoPE: x*cos + [x2, x1]*[-sin1, sin2]
        return self._torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin_signed)

    # ------------------------------------------------------------------------------------------
    def forward(self, tokens: "torch.Tensor", slot_start: int, starts: "torch.Tensor",
                counts: "torch.Tensor", *, all_logits: bool = False,
                adapter_rows: "torch.Tensor | None" = None,
                vision: "Sequence[VisionInputs | None] | None" = None) -> "torch.Tensor":
        """Append new tokens to slots ``slot_start .. slot_start + P - 1``.

        ``tokens`` ``[N]`` holds the new tokens of all rows back to back (``counts[i]`` of row
        ``i``, ``N = counts.sum()``); row ``i``'s KV already holds ``starts[i]`` positions. Returns
        float32 logits of each row's last new token ``[P, V]``, or of every new token ``[N, V]``.
        ``adapter_rows`` (bool ``[P]``): the rows the unmerged adapter applies to (none if unset).
        ``vision`` (a vision-language model): per row, its images (:class:`~.vision.VisionInputs`,
        embeddings computed) or ``None``; see :meth:`_vision_inputs`.

        Projections and MLPs run on the ``N`` packed tokens (no padding); only attention uses a
        padded ``[P, T]`` layout, where queries past a row's count are computed and discarded.
        """
        torch = self._torch
        F = torch.nn.functional
        P, N = counts.shape[0], tokens.shape[0]
        H, KV, D = self.num_heads, self.kv_heads, self.head_dim
        T = int(counts.max())
        decode = T == 1
        if decode:
            row = torch.arange(P)
            pos = starts
        else:
            row = torch.repeat_interleave(torch.arange(P), counts)
            first = torch.cumsum(counts, 0) - counts
            offset = torch.arange(N) - first[row]
            pos = starts[row] + offset
            pad_index = row * T + offset
        adapter_tokens = self._adapter_tokens(adapter_rows, row, decode)
        key_len = int((starts + counts).max())
        self.cache.ensure(slot_start + P, key_len)
        slots = slice(slot_start, slot_start + P)
        slot = row + slot_start
        # Attention runs per KV head with the G = H / KV query heads sharing it stacked along the
        # query axis ([P, KV, G*T, D]), so grouped keys and values are read once, never repeated.
        # mask[i, 0, g*T + t, k]: query t of row i sees key k iff k <= starts[i] + t (its position),
        # and in a sliding layer k > that position - window
        G = H // KV
        qpos = starts[:, None] + torch.arange(T)[None, :]
        masks = {window: self._attention_mask(qpos, key_len, window, decode) for window in set(self.windows)}

        hidden = self.embed(tokens)
        rope_pos = pos[None, :]
        if self.vision:
            hidden, rope_pos = self._vision_inputs(hidden, pos, row, vision)
        cos, sin = self.rotary(hidden, rope_pos)
        cos, sin_signed = cos[0].unsqueeze(1), self._signed_sin(sin[0]).unsqueeze(1)
        q_size, kv_size = H * D, KV * D
        routes = iter(self.cache.routes)
        for layer, window, k_cache, v_cache in zip(self.layers, self.windows, self.cache.keys, self.cache.values):
            x = self._rms(hidden, layer.attn_norm)
            qkv = layer.qkv(x, adapter_tokens)
            # queries and keys are normalised (Qwen3) and rotated together: fewer, larger ops
            qk = qkv[:, : q_size + kv_size].view(N, H + KV, D)
            v = qkv[:, q_size + kv_size:].view(N, KV, D)
            if layer.qk_norm is not None:
                q_norm, k_norm = layer.qk_norm
                qk = F.rms_norm(qk, (D,), None, q_norm.eps)
                qk[:, :H].mul_(q_norm.weight)
                qk[:, H:].mul_(k_norm.weight)
            qk = self._rope(qk, cos, sin_signed)
            q, k = qk[:, :H], qk[:, H:]
            k_cache[slot, :, pos] = k
            v_cache[slot, :, pos] = v
            first_key, mask = masks[window]
            keys, values = k_cache[slots, :, first_key:key_len], v_cache[slots, :, first_key:key_len]
            if decode and keys.shape[2] >= self.fused_decode_keys:
                # one query per row over many keys: the fused kernel splits the keys across threads
                out = F.scaled_dot_product_attention(q.view(P, KV, G, D), keys, values, attn_mask=mask,
                                                     scale=self.scaling)
            elif decode:
                # one query per row over few keys: plain matmuls beat the fused kernel's masked path
                scores = torch.matmul(q.view(P, KV, G, D), keys.transpose(-1, -2)).mul_(self.scaling).add_(mask)
                out = torch.matmul(torch.softmax(scores, dim=-1), values)
            else:
                q_rows = q.new_zeros(P * T, H, D)
                q_rows[pad_index] = q
                q_rows = q_rows.view(P, T, H, D).transpose(1, 2).reshape(P, KV, G * T, D)
                out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=self.scaling)
            out = out.view(P, H, T, D).transpose(1, 2).reshape(P * T, q_size)
            if not decode:
                out = out[pad_index]
            hidden = hidden + layer.o_proj(out, adapter_tokens)
            x = self._rms(hidden, layer.mlp_norm)
            if layer.experts is not None:
                mixed, chosen = self._mixture(layer.experts, x)
                next(routes)[slot, pos] = chosen.to(torch.int16)  # kept with this position's KV
                hidden = hidden + mixed
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate, up = layer.gate_up(x, adapter_tokens).chunk(2, dim=-1)
            hidden = hidden + layer.down(layer.act(gate) * up, adapter_tokens)
        if not all_logits and not decode:
            hidden = hidden[torch.cumsum(counts, 0) - 1]
        return self.output_logits(hidden)

    def _vision_inputs(self, hidden: "torch.Tensor", pos: "torch.Tensor", row: "torch.Tensor",
                       vision: "Sequence[VisionInputs | None] | None") -> "tuple[torch.Tensor, torch.Tensor]":
        """The token embeddings with each image token's replaced by its vision embedding, and the
        ``[3, 1, N]`` multimodal rotary positions (a text-only row: its index on all three axes,
        as the model's own rule gives)."""
        rope_pos = pos.expand(3, -1).clone()
        for i, inputs in enumerate(vision or ()):
            if inputs is None:
                continue
            sel = (row == i).nonzero()[:, 0]
            p = pos[sel]
            rope_pos[:, sel] = inputs.rope_positions(p)
            inside = p < inputs.embed_row.shape[0]
            embed_row = self._torch.full_like(p, -1)
            embed_row[inside] = inputs.embed_row[p[inside]]
            hit = embed_row >= 0
            if bool(hit.any()):  # the embeddings are a fresh tensor: replaced in place
                hidden[sel[hit]] = inputs.embeddings[embed_row[hit]].to(hidden.dtype)
        return hidden, rope_pos[:, None, :]

    def routed_experts(self, slot: int, length: int) -> Any:
        """The expert ids of the first ``length`` positions of ``slot`` as an int32 array
        ``[length, layers, top_k]`` (SGLang's ``routed_experts`` layout), -1 in dense layers;
        ``None`` for a model without experts."""
        import numpy as np

        if not self.moe_layers:
            return None
        out = np.full((length, len(self.layers), self.moe_top_k), -1, dtype=np.int32)
        for index, route in zip(self.moe_layers, self.cache.read_routes(slot, length)):
            out[:, index, :] = route.numpy()
        return out

    def _mixture(self, block: _Experts, x: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
        """A mixture-of-experts MLP over the packed tokens ``x`` ``[N, H]``: the router's softmax
        (in float32), its top-k experts per token (their weights renormalised when the model says
        so), and each chosen expert's gated MLP weighted and summed, expert by expert in ascending
        order as transformers does, so the sums round alike. Returns the output and the experts
        chosen ``[N, top_k]``."""
        torch = self._torch
        F = torch.nn.functional
        logits = F.linear(x, block.router)
        top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), block.top_k, dim=-1)
        if block.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(top_i).tolist():
            token, slot = torch.where(top_i == expert)
            gate, up = F.linear(x[token], block.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(block.act(gate) * up, block.down[expert]) * top_w[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out, top_i

    def _attention_mask(self, qpos: "torch.Tensor", key_len: int, window: int | None,
                        decode: bool) -> "tuple[int, torch.Tensor]":
        """The first key any query may see and the mask over keys ``first .. key_len - 1`` for
        queries at positions ``qpos`` ``[P, T]``: causal, and within ``window`` when one is set
        (so a sliding layer reads only the keys its window can reach, however long the row).

        Decode gets an additive ``[P, 1, 1, K]`` mask for the plain matmul attention, prefill a
        boolean ``[P, 1, G*T, K]`` one for SDPA, its query axis the ``G`` grouped heads stacked."""
        torch = self._torch
        first = 0 if window is None else max(0, int(qpos[:, 0].min()) - window + 1)
        key = torch.arange(first, key_len)[None, None, :]
        visible = key <= qpos[:, :, None]
        if window is not None:
            visible &= key > qpos[:, :, None] - window
        P, T = qpos.shape
        if decode:
            return first, torch.zeros(P, 1, 1, key_len - first, dtype=self.dtype).masked_fill_(
                ~visible[:, None], float("-inf"))
        G = self.num_heads // self.kv_heads
        return first, visible[:, None, None].expand(P, 1, G, T, key_len - first).reshape(P, 1, G * T, key_len - first)

    def _adapter_tokens(self, adapter_rows: "torch.Tensor | None", row: "torch.Tensor",
                        decode: bool) -> AdapterTokens:
        """The packed tokens of the rows in ``adapter_rows`` (see :data:`AdapterTokens`)."""
        if adapter_rows is None or not self.has_unmerged_adapter:
            return None
        selected = adapter_rows if decode else adapter_rows[row]
        if bool(selected.all()):
            return slice(None)
        if not bool(selected.any()):
            return None
        return selected.to(self.dtype).unsqueeze(1)

    def output_logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """Final norm and output layer: float32 logits ``[..., V]``."""
        import torch

        normed = self._rms(hidden, self.final_norm)
        if self.fp32_lm_head and self.dtype != torch.float32:
            # cast per call: the weight is updated in place by weight transfers, so no stale copy
            return torch.nn.functional.linear(normed.float(), self.lm_head.weight.float())
        if self._packed_head is not None:
            return self._packed_head.linear(normed, None).float()
        return self.lm_head(normed).float()

    # ------------------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, "torch.Tensor"]:
        """Parameters and buffers by their Hugging Face names (tied names included)."""
        out = dict(self.model.named_parameters(remove_duplicate=False))
        for name, buf in self.model.named_buffers(remove_duplicate=False):
            out.setdefault(name, buf)
        return out


def sequence_logprobs(model: Any, tokens: Sequence[int]) -> list[float]:
    """Reference: ``log p(tokens[t] | tokens[:t])`` for ``t >= 1`` from one plain forward of ``model``."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([list(tokens)])
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp.tolist()
