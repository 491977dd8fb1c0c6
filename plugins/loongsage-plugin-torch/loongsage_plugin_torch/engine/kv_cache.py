"""Key/value storage of the embedded engine: per-slot KV rows and a prefix cache.

``SlotKVCache`` holds one KV row per running request ("slot") for every layer, in tensors of shape
``[slots, kv_heads, capacity, head_dim]``. Running requests always occupy slots ``0..B-1``, so a
decode step attends over a plain view ``cache[:B, :, :L]`` with no gather; when a request leaves,
the last slot is moved into its place. Both axes grow by doubling, so memory follows the running
batch and its longest sequence, not the configured batch size and context length.

``PrefixCache`` keeps KV copies of recently computed token sequences (prompts after their prefill,
whole sequences after they finish) so that a later request that starts with the same tokens (the
other samples of a group, the next turn of a multi-turn agent) skips their prefill. Lookup hashes
fixed-size token blocks, so finding the longest cached prefix costs time linear in the prompt.
Entries are tagged with the weight version that computed them and only serve that version; a
``namespace`` (the LoRA adapter a request names, when the engine applies adapters per request)
seeds the block hashes, so KV computed with an adapter never serves a request without it. An
entry that extends an older one (the next turn of a conversation) replaces it, so a conversation
keeps one copy of its shared prefix; the budget ``capacity_tokens`` bounds the memory held
(``tokens x layers x 2 x kv_heads x head_dim x dtype size`` bytes) and least recently used
entries are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch


class SlotKVCache:
    """Per-layer KV tensors ``[slots, kv_heads, capacity, head_dim]`` indexed by slot.

    Both the slot axis and the sequence axis are allocated on demand (next power of two, at most
    ``num_slots`` slots), so memory follows the running batch and its longest sequence;
    :meth:`reset` gives the memory back when the engine goes idle. Storage is zero-initialised:
    positions past a row's length are masked, and zeros keep them finite.
    """

    def __init__(self, *, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: "torch.dtype", route_layers: int = 0, top_k: int = 0) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.route_layers = route_layers
        self.top_k = top_k
        self.slots = 0
        self.capacity = 0
        self.keys: list["torch.Tensor"] = []
        self.values: list["torch.Tensor"] = []
        # a mixture-of-experts model's routing: per MoE layer ``[slots, capacity, top_k]`` expert
        # ids, kept with the KV of the same positions so that every copy of KV (prefix cache, a
        # duplicate prompt, a slot moved) carries the experts that computed it
        self.routes: list["torch.Tensor"] = []

    def ensure(self, slots: int, length: int) -> None:
        """Make room for slots ``0..slots-1`` holding ``length`` positions each."""
        import torch

        if slots <= self.slots and length <= self.capacity:
            return
        if slots > self.num_slots:
            raise ValueError(f"KV cache: {slots} slots requested, the engine has {self.num_slots}")
        new_slots = max(self.slots, min(self.num_slots, 1 << (max(slots, 1) - 1).bit_length()))
        new_cap = max(self.capacity, 64, 1 << (max(length, 1) - 1).bit_length())
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        keys, values = [], []
        for layer in range(self.num_layers):
            k = torch.zeros(shape, dtype=self.dtype)
            v = torch.zeros(shape, dtype=self.dtype)
            if self.slots and self.capacity:
                k[: self.slots, :, : self.capacity].copy_(self.keys[layer])
                v[: self.slots, :, : self.capacity].copy_(self.values[layer])
            keys.append(k)
            values.append(v)
        routes = []
        for layer in range(self.route_layers):
            r = torch.full((new_slots, new_cap, self.top_k), -1, dtype=torch.int16)
            if self.slots and self.capacity:
                r[: self.slots, : self.capacity].copy_(self.routes[layer])
            routes.append(r)
        self.keys, self.values, self.routes = keys, values, routes
        self.slots, self.capacity = new_slots, new_cap

    def reset(self) -> None:
        """Drop all storage (the next :meth:`ensure` allocates afresh)."""
        self.keys, self.values, self.routes = [], [], []
        self.slots = self.capacity = 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        if src == dst or length <= 0:
            return
        self.ensure(max(src, dst) + 1, length)
        for k, v in zip(self.keys, self.values):
            k[dst, :, :length].copy_(k[src, :, :length])
            v[dst, :, :length].copy_(v[src, :, :length])
        for r in self.routes:
            r[dst, :length].copy_(r[src, :length])

    def read(self, slot: int, length: int) -> "tuple[list[torch.Tensor], list[torch.Tensor]]":
        """Copies of the first ``length`` positions of ``slot``: per layer ``[kv_heads, length, head_dim]``."""
        return ([k[slot, :, :length].clone() for k in self.keys],
                [v[slot, :, :length].clone() for v in self.values])

    def read_routes(self, slot: int, length: int) -> "list[torch.Tensor]":
        """Copies of the expert ids of the first ``length`` positions of ``slot``: per MoE layer
        ``[length, top_k]`` (empty for a model without experts)."""
        return [r[slot, :length].clone() for r in self.routes]

    def write(self, slot: int, keys: "Sequence[torch.Tensor]", values: "Sequence[torch.Tensor]",
              length: int, routes: "Sequence[torch.Tensor] | None" = None) -> None:
        """Store the first ``length`` positions of per-layer KV copies (and of the routing
        :meth:`read_routes` gave) into ``slot``."""
        self.ensure(slot + 1, length)
        for layer in range(self.num_layers):
            self.keys[layer][slot, :, :length].copy_(keys[layer][:, :length])
            self.values[layer][slot, :, :length].copy_(values[layer][:, :length])
        for layer, route in enumerate(routes or ()):
            self.routes[layer][slot, :length].copy_(route[:length])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@attrs.define(eq=False)
class PrefixEntry:
    """KV of ``tokens`` (per layer ``[kv_heads, len(tokens), head_dim]``) computed at ``version``."""

    tokens: list[int]
    keys: list
    values: list
    version: int
    block_hashes: list[int]
    routes: list | None = None  # a mixture-of-experts model's expert ids of the same positions


class PrefixCache:
    """LRU store of KV for token sequences, looked up by longest common prefix.

    ``capacity_tokens`` bounds the total number of cached positions (0 disables the cache).
    Sequences are indexed at every ``block``-token boundary by a chained hash; a lookup walks the
    query's blocks while they hit, then extends the match token by token inside the entry.
    """

    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        self.capacity_tokens = capacity_tokens
        self.block = block
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._by_hash: dict[int, int] = {}  # chained block hash -> entry id
        self._next_id = 0
        self.tokens = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _hashes(self, tokens: Sequence[int], namespace: str | None) -> list[int]:
        out, h, b = [], hash(namespace), self.block
        for end in range(b, len(tokens) + 1, b):
            h = hash((h, tuple(tokens[end - b: end])))
            out.append(h)
        return out

    def clear(self) -> None:
        self._entries.clear()
        self._by_hash.clear()
        self.tokens = 0

    def insert(self, tokens: Sequence[int], keys: list, values: list, version: int,
               namespace: str | None = None, routes: list | None = None) -> None:
        """Remember KV copies for ``tokens`` (computed in ``namespace``); evicts least recently used
        entries to stay in budget."""
        n = len(tokens)
        if self.capacity_tokens <= 0 or n < self.block or n > self.capacity_tokens:
            return
        hashes = self._hashes(tokens, namespace)
        # An entry whose every block is already indexed by an entry of the same length or longer adds
        # nothing beyond a few tail tokens; skip exact duplicates cheaply.
        last = self._by_hash.get(hashes[-1])
        if last is not None:
            other = self._entries.get(last)
            if other is not None and other.version == version and len(other.tokens) >= n \
                    and other.tokens[:n] == list(tokens):
                self._entries.move_to_end(last)
                return
        # Entries whose tokens are a prefix of ``tokens`` (the previous turn of this conversation)
        # are subsumed by the new entry: drop them, so a long conversation holds one copy of its
        # shared prefix, as a radix tree would.
        owners = {owner for h in hashes if (owner := self._by_hash.get(h)) is not None}
        for owner in owners:
            other = self._entries[owner]
            if len(other.tokens) <= n and other.tokens == list(tokens[: len(other.tokens)]):
                self._remove(owner)
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = PrefixEntry(list(tokens), keys, values, version, hashes, routes)
        for h in hashes:
            self._by_hash[h] = entry_id
        self.tokens += n
        while self.tokens > self.capacity_tokens and self._entries:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        self._remove(next(iter(self._entries)))

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for h in entry.block_hashes:
            if self._by_hash.get(h) == entry_id:
                del self._by_hash[h]
        self.tokens -= len(entry.tokens)

    def lookup(self, tokens: Sequence[int], version: int, max_len: int,
               namespace: str | None = None) -> tuple[PrefixEntry | None, int]:
        """The entry of ``namespace`` sharing the longest prefix with ``tokens`` (at most ``max_len``)
        and its length."""
        if not self._entries or max_len < self.block:
            return None, 0
        best_id, h, b = None, hash(namespace), self.block
        for end in range(b, min(len(tokens), max_len) + 1, b):
            h = hash((h, tuple(tokens[end - b: end])))
            entry_id = self._by_hash.get(h)
            if entry_id is None or self._entries[entry_id].version != version:
                break
            best_id = entry_id
        if best_id is None:
            return None, 0
        entry = self._entries[best_id]
        limit = min(len(entry.tokens), len(tokens), max_len)
        matched = 0
        # hashes can collide: verify the whole match token by token
        while matched < limit and entry.tokens[matched] == tokens[matched]:
            matched += 1
        if matched == 0:
            return None, 0
        self._entries.move_to_end(best_id)
        self.hits += 1
        self.hit_tokens += matched
        return entry, matched
