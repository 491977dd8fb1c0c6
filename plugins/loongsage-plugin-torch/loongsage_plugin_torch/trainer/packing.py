"""Padding-free micro-batches (rows packed by a token budget into one sequence each), and a
group's shared prompt run once.

With ``[train] max_tokens_per_micro_batch`` set, the torch trainer cuts a mini-batch (and the
rows of a scoring pass) into micro-batches by tokens instead of rows (:func:`plan_micro_batches`,
like verl's dynamic batch size), and runs each as **one** sequence: the rows' real tokens
concatenated, position ids restarting at 0 for every row, and attention kept within each row.
On the SDPA / eager attention paths that is a block-diagonal causal mask (and, for a model with
sliding-window layers, a second one limited to the window); with
``flash_attention_2`` (``[model] attn_implementation``) the restarting position ids are what the
varlen kernel reads its ``cu_seqlens`` from. No FLOP is spent on padding, and the per-token
outputs are scattered back into the batch's ``[b, T]`` layout, so the loss pipeline sees exactly
what the padded path gives it (equal within float32 tolerance, tested).

Rows that begin with the same prompt (the samples of a GRPO group) can also run that prompt once
(:func:`prompt_groups`, ``[train] backend_args.share_prompts``): in the packed sequence a sharing
row keeps only its tokens after the prompt, at their own positions, and its mask lets them see
the first row's copy of the prompt. Every scored token is then predicted by the same hidden state
as in its own row, so the log-probs, loss and gradients are again those of the padded path.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from . import banded_attention
from .prompt_tree import PromptTreeLayout, Segment, prompt_tree_attention, uses_tree

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .grammar_replay import LogitFilter


TREE_PAIRS_PER_TOKEN = 256
"""Below this many query-key pairs saved per packed token the masked attention is kept: the per-row
attention gathers each layer's queries, keys and values and scatters its output, which cost about
as much as 256 pairs a token on a 2-core CPU (measured: a GRPO group of 8 rows packed on its own,
about 120-170 pairs a token saved, ran 0-4% slower per row; a micro-batch of 4 such groups, 500-740,
ran 13-14% faster, a training step of a 135M model included)."""


def plan_micro_batches(lengths: Sequence[int], max_tokens: int,
                       groups: "list[list[tuple[int, int]]] | None" = None) -> list[list[int]]:
    """Row indices per micro-batch, each micro-batch at most ``max_tokens`` real tokens (a longer
    row goes alone). Longest first, each into the first micro-batch it fits (first-fit
    decreasing), so few micro-batches are nearly full; rows keep ascending order inside one.

    With ``groups`` (:func:`prompt_groups`) the rows of a group are placed together, a sharing
    row counting only the tokens it keeps; a group over the budget is cut into pieces, the first
    row of each piece keeping the prompt."""
    if max_tokens < 1:
        raise ValueError(f"[train] max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    if groups is None:
        groups = [[(r, 0)] for r in range(len(lengths))]
    units: list[tuple[int, list[int]]] = []  # (tokens, rows)
    for group in groups:
        rows: list[int] = []
        tokens = 0
        for row, shared in group:
            cost = int(lengths[row]) - (shared if rows else 0)
            if rows and tokens + cost > max_tokens:
                units.append((tokens, rows))
                rows, tokens, cost = [], 0, int(lengths[row])
            rows.append(row)
            tokens += cost
        if rows:
            units.append((tokens, rows))
    bins: list[list[int]] = []
    room: list[int] = []
    for tokens, rows in sorted(units, key=lambda u: (-u[0], u[1][0])):
        for b, free in enumerate(room):
            if tokens <= free:
                bins[b].extend(rows)
                room[b] -= tokens
                break
        else:
            bins.append(list(rows))
            room.append(max_tokens - tokens)
    return [sorted(b) for b in bins]


def canonical_order(input_ids: "torch.Tensor", lengths: Sequence[int], names: Sequence[Any] | None = None) -> list[int]:
    """The rows sorted by their real tokens, then by ``names`` (a name per row that stays with it,
    such as the batch's ``trajectory_id`` and ``segment``): the rows that begin with the same
    prompt side by side, and one order for a set of rows whatever order it comes in. Without
    names, rows with equal tokens keep their relative order."""
    ids = input_ids.detach().cpu().numpy()
    # a row's tokens as bytes: equal prefixes are equal byte prefixes, so the rows that share one
    # sort side by side (the bytes' order is not the tokens', which does not matter here)
    rows = [ids[r, :int(n)].tobytes() for r, n in enumerate(lengths)]
    tie = [str(x) for x in names] if names is not None else [""] * len(rows)
    return sorted(range(len(rows)), key=lambda r: (rows[r], tie[r], r))


#: A row's shared prompt must be at least this long to be run once for its group.
MIN_SHARED_TOKENS = 4


def prompt_groups(input_ids: "torch.Tensor", lengths: Sequence[int], wanted: "torch.Tensor",
                  hidden_size: int | None = None, routes: "torch.Tensor | None" = None) -> list[list[tuple[int, int]]]:
    """Rows that begin with the same prompt, as groups ``[(row, shared), ...]``: the first row
    (the group's *anchor*) keeps all its tokens (``shared`` 0), each other one shares its first
    ``shared`` tokens with the anchor and keeps only the rest.

    A row's prompt is its tokens before the first ``wanted`` one (the first token scored), so a
    shared token is never scored and every scored token still has its own position; rows with
    nothing wanted, or a prompt under :data:`MIN_SHARED_TOKENS`, stay alone. With ``hidden_size``
    (the groups become rows of their own, each attending over all of its tokens through a mask;
    attending per row, :mod:`.prompt_tree`, costs less still) a group is kept
    only when the attention it adds (``L**2 - sum(n**2)`` for its packed length ``L`` and its
    rows' lengths ``n``) is below the projections it saves (about ``6 * hidden_size`` per shared
    token, the ratio of a token's matrix-product FLOPs to a query-key pair's); without it (one
    sequence for the whole micro-batch) every group saves. Groups keep the rows' order.

    With ``routes`` (``[b, T, ...]``, the experts a Router Replay forward replays per token) rows
    share a prompt only when it was also routed alike, so the anchor's copy replays every row's."""
    import torch

    ids = input_ids.detach().cpu().numpy()
    routed = None if routes is None else routes.detach().cpu().numpy()
    wanted = wanted.detach().cpu()
    has = wanted.any(dim=1)
    firsts = torch.where(has, wanted.to(torch.uint8).argmax(dim=1), torch.zeros_like(has, dtype=torch.long)).tolist()
    keys: dict[bytes, list[int]] = {}
    groups: list[list[int]] = []
    for r, n in enumerate(lengths):
        if n == 0:
            continue
        prompt = int(firsts[r])
        if prompt < MIN_SHARED_TOKENS:
            groups.append([r])
            continue
        key = ids[r, :prompt].tobytes()  # the prompt's length is in the key: its byte count
        if routed is not None:
            key += routed[r, :prompt].tobytes()
        if key not in keys:
            keys[key] = []
            groups.append(keys[key])
        keys[key].append(r)
    out: list[list[tuple[int, int]]] = []
    for rows in groups:
        if len(rows) == 1:
            out.append([(rows[0], 0)])
            continue
        shared = int(firsts[rows[0]])
        packed = shared + sum(int(lengths[r]) - shared for r in rows)
        added = packed * packed - sum(int(lengths[r]) ** 2 for r in rows)
        if hidden_size is not None and added >= 6 * hidden_size * shared * (len(rows) - 1):
            out.extend([(r, 0)] for r in rows)
            continue
        out.append([(rows[0], 0)] + [(r, shared) for r in rows[1:]])
    return out


class PackedRows:
    """The real tokens of right-padded rows ``[b, T]`` packed into sequences ``[R, L]``.

    By default every row goes into one sequence (``R = 1``), one after the other, positions
    restarting at 0 for each, attention kept within each row. With ``groups`` (from
    :func:`prompt_groups`) the rows of a group share their anchor's prompt: a sharing row keeps
    only its tokens after the prompt, at their own positions, and attends to the anchor's prompt
    tokens and its own, so its hidden states are those of the whole row while the prompt is run
    once for the group (a tree of one level, the prompt its trunk). With ``one_row=False`` each
    group is a sequence of its own, right-padded to the longest: attention then costs each
    group's length squared rather than the whole micro-batch's.
    """

    def __init__(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor",
                 groups: "list[list[tuple[int, int]]] | None" = None, *, one_row: bool = True) -> None:
        import torch

        device = input_ids.device
        self.shape = tuple(input_ids.shape)
        self.real = attention_mask > 0
        self.lengths = self.real.sum(dim=1)
        lengths = self.lengths.tolist()
        if groups is None:
            groups = [[(r, 0)] for r in range(len(lengths)) if lengths[r] > 0]
            one_row = True
        # per packed token: source row and column, packed row and column, the anchor row it may read
        src_row, src_col, dst_row, dst_col, anchor_row, shared_of, anchor_at = [], [], [], [], [], [], []
        ends = [0] * (1 if one_row else len(groups))
        self.segments: list[Segment] = []  # every row's place, for the tree attention (.prompt_tree)
        for index, group in enumerate(groups):
            packed_row = 0 if one_row else index
            anchor, anchor_start = group[0][0], ends[packed_row]
            for row, shared in group:
                n, col = lengths[row] - shared, ends[packed_row]
                self.segments.append(Segment(packed_row, col, n, anchor_start, shared))
                src_row.append(torch.full((n,), row))
                src_col.append(torch.arange(shared, lengths[row]))
                dst_row.append(torch.full((n,), packed_row))
                dst_col.append(torch.arange(col, col + n))
                anchor_row.append(torch.full((n,), anchor if shared else -1))
                shared_of.append(torch.full((n,), shared))
                anchor_at.append(torch.full((n,), anchor_start))
                ends[packed_row] += n
        self.packed_lengths = list(ends)
        cat = (lambda parts: torch.cat(parts).to(device)) if src_row else (
            lambda parts: torch.zeros(0, dtype=torch.long, device=device))
        self.src_row, self.src_col = cat(src_row), cat(src_col)
        self.dst_row, self.dst_col = cat(dst_row), cat(dst_col)
        rows, cols = len(ends), max(max(ends), 1)
        where = (self.dst_row, self.dst_col)

        def layout(values: "torch.Tensor", fill: int) -> "torch.Tensor":
            out = torch.full((rows, cols), fill, dtype=values.dtype, device=device)
            out[where] = values
            return out

        self.input_ids = layout(input_ids[self.src_row, self.src_col], 0)
        self.position_ids = layout(self.src_col, 0)
        self.valid = layout(torch.ones_like(self.src_row, dtype=torch.bool), False)
        self.row_of_token = layout(self.src_row, -1)  # the source row, -1 on padding
        self._anchor_row = layout(cat(anchor_row), -2)
        self._shared = layout(cat(shared_of), 0)
        # the flat index ([R * L]) of the hidden state that predicts each packed token: the token
        # before it in its row, which for a sharing row's first kept token is the anchor's
        before = self.dst_col - 1
        from_anchor = self.src_col - 1 < cat(shared_of)
        before = torch.where(from_anchor, cat(anchor_at) + self.src_col - 1, before)
        self.predictor = self.dst_row * cols + before  # meaningless where src_col is 0
        self.shares = any(shared for group in groups for _, shared in group)
        n = self.lengths
        starts = torch.cumsum(n, 0) - n
        self.cu_seqlens = torch.cat([starts, starts[-1:] + n[-1:]]).to(torch.int32)  # without groups only

    def pack(self, values: "torch.Tensor", fill: int | float) -> "torch.Tensor":
        """Per-token ``values`` ``[b, T, ...]`` laid out as the packed tokens ``[R, L, ...]``
        (``fill`` on padding), e.g. the experts a Router Replay forward replays."""
        import torch

        rows, cols = self.input_ids.shape
        out = torch.full((rows, cols, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
        out[self.dst_row, self.dst_col] = values[self.src_row, self.src_col]
        return out

    def unpack(self, values: "torch.Tensor", fill: int | float) -> "torch.Tensor":
        """Per packed token ``values`` ``[R, L]`` back in the rows' layout ``[b, T]`` (``fill``
        where no packed token stands: padding, a sharing row's prompt)."""
        import torch

        out = torch.full(self.shape, fill, dtype=values.dtype, device=values.device)
        out[self.src_row, self.src_col] = values[self.dst_row, self.dst_col]
        return out

    @property
    def total(self) -> int:
        """Packed tokens, padding included."""
        return int(self.input_ids.numel())

    def predicting_states(self, hidden: "torch.Tensor", wanted: "torch.Tensor",
                          ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        """The hidden states (``[K, H]`` of the packed ``hidden`` ``[R, L, H]``) that predict the
        kept tokens ``wanted`` (bool ``[b, T]``) marks, a row's first token never among them, and
        those tokens' rows and columns in the ``[b, T]`` layout."""
        take = wanted[self.src_row, self.src_col] & (self.src_col > 0)
        states = hidden.reshape(-1, hidden.shape[-1])[self.predictor[take]]
        return states, self.src_row[take], self.src_col[take]

    @contextlib.contextmanager
    def attention(self, config: Any, *, tree: bool | None = None) -> "Iterator[tuple[Any, dict[str, Any]]]":
        """The attention of a forward over these packed sequences by a model with ``config``: the
        mask and keyword arguments to pass the decoder inside the block. Where a sequence holds
        several rows and the model attends through SDPA or eager attention, each row attends over
        its shared prompt and itself (:mod:`.prompt_tree`: no mask, a ``prompt_tree`` layout)
        when :meth:`tree_saves` (``tree`` ``None``) or always (``True``); so does a sequence longer
        than one :data:`.banded_attention.BLOCK`, whose rows then attend block by block instead of
        through an ``L x L`` mask. Else (``tree`` off, flash kernels) :meth:`attention_mask` over
        the whole sequence."""
        several = len(self.segments) > self.input_ids.shape[0]
        long = self.input_ids.shape[1] > banded_attention.BLOCK
        wanted = tree if tree is not None else long or (several and self.tree_saves())
        if (several or long) and uses_tree(config) and wanted:
            layout = PromptTreeLayout.build(self.segments, self.input_ids.shape[1], self.input_ids.device)
            with prompt_tree_attention(config):
                yield None, {"prompt_tree": layout}
        else:
            yield self.attention_mask(config), {}

    def tree_saves(self) -> bool:
        """Whether attending per row (:mod:`.prompt_tree`) pays for its gathers: the masked
        attention over whole packed sequences computes at least :data:`TREE_PAIRS_PER_TOKEN` more
        query-key pairs per packed token than the rows need."""
        masked = sum(int(n) ** 2 for n in self.packed_lengths)
        per_row = sum(s.count * (s.shared + s.count) for s in self.segments)
        return masked - per_row >= TREE_PAIRS_PER_TOKEN * max(sum(self.packed_lengths), 1)

    def attention_mask(self, config: Any) -> "torch.Tensor | dict[str, torch.Tensor] | None":
        """The attention mask of the packed sequences for a model with ``config``.

        ``None`` for ``flash_attention_2`` (varlen from the position ids, which restart for every
        row; the kernel applies any sliding window itself; no shared prompts). Else the 4-D mask
        ``[R, 1, L, L]`` (True: attend): a token sees the earlier tokens of its own row and, in a
        sharing row, its anchor's prompt; for a model with sliding-window layers, a mask per layer
        type as transformers takes them, the ``sliding_attention`` one also limited to the window
        (positions ``q - window < k <= q``). A plain 4-D mask would be used as given by every
        layer, sliding ones included. A padding position sees only itself (its output is unused)."""
        import torch

        attn_implementation = getattr(config, "_attn_implementation", None)
        if attn_implementation and "flash" in attn_implementation:
            if self.shares or self.input_ids.shape[0] != 1:
                raise ValueError("shared prompts and one sequence per group need an attention mask; "
                                 f"{attn_implementation} takes none")
            return None
        row, pos = self.row_of_token, self.position_ids
        q_row, k_row = row[:, :, None], row[:, None, :]
        q_pos, k_pos = pos[:, :, None], pos[:, None, :]
        own = q_row == k_row
        trunk = (self._anchor_row[:, :, None] == k_row) & (k_pos < self._shared[:, :, None])
        mask = (own | trunk) & (k_pos <= q_pos) & self.valid[:, None, :]
        eye = torch.eye(pos.shape[1], dtype=torch.bool, device=pos.device)[None]
        mask = mask | (eye & ~self.valid[:, :, None])
        if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
            return mask[:, None]
        window = mask & (k_pos > q_pos - int(config.sliding_window))
        return {"full_attention": mask[:, None], "sliding_attention": window[:, None]}


def packed_token_outputs(model: Any, input_ids: "torch.Tensor", attention_mask: "torch.Tensor", *,
                         compute_dtype: "torch.dtype", fp32_lm_head: bool, entropy_grad: bool,
                         scored: "torch.Tensor | None" = None,
                         groups: "list[list[tuple[int, int]]] | None" = None,
                         one_row: bool = True,
                         on_packed: "Callable[[PackedRows], None] | None" = None,
                         tree_attention: bool | None = None,
                         logit_filter: "LogitFilter | None" = None,
                         ) -> "tuple[torch.Tensor, torch.Tensor]":
    """Log-probs and entropies ``[b, T]`` of right-padded rows from one packed forward (the
    padded path's ``logprobs[:, t] = log p(ids[t] | ids[:t])``, 0 at position 0 and on padding;
    with ``scored`` (bool ``[b, T]``) only at those tokens, see :func:`.logits.next_token_logits`).

    With ``groups`` (:func:`prompt_groups` of the same ``scored`` tokens) the rows that begin
    with the same prompt run it once (:class:`PackedRows`): the same log-probs, fewer tokens
    through the model; ``one_row=False`` packs each group as a sequence of its own. ``on_packed``
    is called with the :class:`PackedRows` before the forward (to lay other per-token inputs out
    alike, such as the experts Router Replay replays). ``tree_attention``: whether rows packed
    together attend per row through :mod:`.prompt_tree` (each over its shared prompt and itself)
    instead of a mask over each whole packed sequence, which costs its length squared (``None``:
    where :meth:`PackedRows.tree_saves`; see :meth:`PackedRows.attention`). ``logit_filter``
    ``(logits [K, V], rows, cols) -> logits`` rewrites the logits predicting ``input_ids[rows,
    cols]`` before they are scored (constrained turns, :mod:`.grammar_replay`)."""
    from .logits import decoder_hidden, output_logits
    from .token_scores import token_scores

    real = attention_mask > 0
    wanted = real if scored is None else scored & real
    packed = PackedRows(input_ids, attention_mask, groups, one_row=one_row)
    if on_packed is not None:
        on_packed(packed)
    with packed.attention(getattr(model, "config", None), tree=tree_attention) as (mask, attention_kwargs):
        hidden = decoder_hidden(model, packed.input_ids, mask, compute_dtype=compute_dtype,
                                position_ids=packed.position_ids, **attention_kwargs)
    states, rows, cols = packed.predicting_states(hidden, wanted)
    logits = output_logits(model, states, compute_dtype=compute_dtype, fp32_lm_head=fp32_lm_head)
    if logit_filter is not None:
        logits = logit_filter(logits, rows, cols)
    picked, entropy = token_scores(logits, input_ids[rows, cols], entropy_grad=entropy_grad)
    assert entropy is not None

    def per_token(values: "torch.Tensor") -> "torch.Tensor":
        out = values.new_zeros(packed.shape)
        out[rows, cols] = values
        return out

    return per_token(picked), per_token(entropy)


__all__ = ["MIN_SHARED_TOKENS", "PackedRows", "canonical_order", "packed_token_outputs", "plan_micro_batches",
           "prompt_groups"]
