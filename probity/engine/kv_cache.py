"""The KV block pool: fixed-size blocks preallocated once, handed to sequences as block tables,
the exact prefix cache over them, and the echo cache beside them.

A full block is content-addressed by the SHA-256 chain of its tokens (the parent block's digest
and the block's token ids), so equal digests mean equal prefixes. A request's `cache_salt`
roots its chain in a digest of the salt (the unsalted chain's root is empty), so blocks are
shared only among requests with the same salt, or none. A new sequence reuses the
longest chain of full blocks that are cached or that a sequence of the same step fills
(scheduler.py). Blocks are reference-counted: a block nobody uses stays
cached until the pool needs room (least recently released first); a block in use is never
evicted. Block 0 is never handed out: it is the zero block that pads block tables."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from ..protocol import MAX_LOGPROBS
from .tables import with_chosen


def chain(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least two blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.free: deque[int] = deque(range(1, num_blocks))
        self.refs = [0] * num_blocks
        self.digest: dict[int, bytes] = {}          # cached block -> its chain digest
        self.by_digest: dict[bytes, int] = {}       # chain digest -> cached block
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, oldest first

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free) - len(self.idle)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self.free) + len(self.idle)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend `table` to hold `tokens` positions (the caller checked can_grow)."""
        for _ in range(self.blocks_for(tokens) - len(table)):
            if self.free:
                b = self.free.popleft()
            else:  # evict the least recently released cached block
                b, _ = self.idle.popitem(last=False)
                del self.by_digest[self.digest.pop(b)]
            self.refs[b] = 1
            table.append(b)

    def release(self, table: list[int]) -> None:
        for b in reversed(table):  # a chain's tail is evicted before its head
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.digest:
                    self.idle[b] = None
                else:
                    self.free.append(b)
        table.clear()

    # ------------------------------------------------------------ prefix cache
    def digests(self, tokens: list[int], upto: int, salt: str | None = None) -> list[bytes]:
        """Chain digests of the full blocks within tokens[:upto], rooted in the salt's digest."""
        parent = b"" if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()
        out, bs = [], self.block_size
        for j in range(upto // bs):
            parent = chain(parent, tokens[j * bs:(j + 1) * bs])
            out.append(parent)
        return out

    def cached_prefix(self, digests: list[bytes]) -> int:
        """How many leading blocks of the chain are cached (no side effects)."""
        return len(self.prefix_blocks(digests, {}))

    def prefix_blocks(self, digests: list[bytes], inflight: dict[bytes, int]) -> list[int]:
        """The blocks of the longest leading run of the chain that is cached or being filled in
        this step (`inflight`: digest -> block). No side effects."""
        out = []
        if not self.prefix_cache:
            return out
        for d in digests:
            b = self.by_digest.get(d)
            if b is None:
                b = inflight.get(d)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int], table: list[int]) -> None:
        """Append shared blocks (cached or in flight) to an empty table, as a user of each."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.idle[b]
            self.refs[b] += 1
            table.append(b)

    def register(self, block: int, digest: bytes) -> None:
        """A block just filled: cache it under its digest unless an equal block already is."""
        if self.prefix_cache and digest not in self.by_digest and block not in self.digest:
            self.by_digest[digest] = block
            self.digest[block] = digest


class EchoCache:
    """What echo reported at each pool position, kept beside its K/V: the next token the entry
    is for, its logprob, and the top list (up to MAX_LOGPROBS ids and values) with its width.

    An entry is the head over that position's final hidden state, so a sequence that reaches
    the position through the prefix cache, with the same next token and a top table no wider,
    gets the very floats a recomputation would give without running the head. Writing a
    position's hidden state (a new owner of the block) voids its entry."""

    BYTES_PER_TOKEN = 8 + 4 + 4 + MAX_LOGPROBS * 8

    def __init__(self, slots: int):
        self.next = torch.full((slots,), -1, dtype=torch.long)   # -1: no entry
        self.width = torch.full((slots,), -1, dtype=torch.int32)  # -1: logprob only
        self.lp = torch.zeros(slots)
        self.ids = torch.zeros(slots, MAX_LOGPROBS, dtype=torch.int32)
        self.vals = torch.zeros(slots, MAX_LOGPROBS)

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.next, self.width, self.lp, self.ids, self.vals))

    def void(self, slots: torch.Tensor) -> None:
        self.next[slots] = -1

    def lookup(self, slots: list[int], targets: list[int], k: int | None) -> list[tuple[float, list | None] | None]:
        st = torch.tensor(slots)
        ok = (self.next[st] == torch.tensor(targets)) & (self.width[st] >= (-1 if k is None else k))
        found = torch.nonzero(ok).flatten()
        out: list = [None] * len(slots)
        if not len(found):
            return out
        at = st[found]
        vals = self.lp[at].tolist()
        if k is None:
            tables = [None] * len(vals)
        else:
            ids, tv = self.ids[at, :k].tolist(), self.vals[at, :k].tolist()
            tables = [with_chosen(list(zip(i, v)), targets[j], val)
                      for i, v, j, val in zip(ids, tv, found.tolist(), vals)]
        for j, val, table in zip(found.tolist(), vals, tables):
            out[j] = (val, table)
        return out

    def store(self, slots: list[int], targets: list[int], vals: list[float], k: int | None,
              lists: list[list[tuple[int, float]]] | None) -> None:
        st = torch.tensor(slots)
        self.next[st] = torch.tensor(targets)
        self.lp[st] = torch.tensor(vals)
        self.width[st] = -1 if k is None else k
        if k:
            self.ids[st, :k] = torch.tensor([[i for i, _ in pairs] for pairs in lists], dtype=torch.int32)
            self.vals[st, :k] = torch.tensor([[v for _, v in pairs] for pairs in lists])
