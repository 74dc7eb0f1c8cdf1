"""Tensors in, logits out: one forward over every scheduled sequence's new tokens, then the
head and the log-softmax only for the rows somebody asked about (echo positions, the row a
token is sampled from), in chunks of at most `head_rows` rows, so peak memory is set by the
flags and not by the request."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch

from . import kernels
from .attention import KEY_ALIGN, AttnGroup, Kept, masks
from .kv_cache import EchoCache
from .log import log
from .model import UnsupportedModel
from .tables import row_reports, top_lists, with_chosen
from .sequence import Sequence

PAD_ROWS = 32                 # the multiple a general-path step is padded to where its modules need it
NUMERICS_PROBE = 48           # tokens of the fixed sequence whose numbers the fingerprint digests
INVARIANCE_COUNTS = 64        # the general path's rows are compared at every count up to this ...
INVARIANCE_WIDE = 128         # ... with the same rows of a forward this wide
KEPT_KEYS_BYTES = 1 << 30     # default: at most this much of one decode group's gathered keys is kept between steps


def row_bucket(n: int) -> int:
    """The query rows attention gives an item with n new rows: a power of two up to 16, then a
    multiple of 16 (a 132-row prompt attends as 144 rows, not 256). Padding changes no bit:
    the score and value GEMMs reduce each row the same way for any row count."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16


def row_buckets(max_rows: int) -> list[int]:
    """Every row count attention can give an item in a step of up to max_rows rows, ascending."""
    return sorted({row_bucket(n) for n in range(1, max_rows + 1)})


def kv_blocks(model, gib: float, block_size: int) -> int:
    """Blocks of `block_size` positions that `gib` of KV pool holds (with each position's hidden
    state and echo entry), at least two: block 0 pads tables."""
    per_token = model.kv_bytes_per_token() + model.hidden_size * 4 + EchoCache.BYTES_PER_TOKEN
    return max(2, int(gib * (1 << 30)) // (per_token * block_size) + 1)


@dataclass
class SeqResult:
    """What one step produced for one sequence."""
    echo: list[tuple] = field(default_factory=list)  # (position, logprob, table[, row reports])
    logits: torch.Tensor | None = None   # raw logits of the row to sample from
    lp: torch.Tensor | None = None       # its log-softmax


@dataclass(frozen=True)
class HeadRow:
    """A row the head runs over: a row of `rows` (the step's hidden rows, then echo rows read
    back from the pool), for sequence `seq` of the batch, to sample from or for an echo entry."""
    row: int
    seq: int
    sample: bool
    position: int = 0   # echo: the prompt position the entry is for
    slot: int = 0       # echo: the pool slot of the row before it (where the entry is cached)


class ModelRunner:
    """`model`: a built model (models.build), whose KV pool this runner allocates."""

    def __init__(self, model, num_blocks: int, block_size: int, threads: int | None = None,
                 head_rows: int = 128, max_rows: int = 512,
                 kept_keys_bytes: int = KEPT_KEYS_BYTES):
        if threads:
            torch.set_num_threads(threads)
        cfg = model.cfg
        self.block_size = block_size
        self.model = model
        # one block past the scheduler's: where the rows that pad a step write (see pad_rows)
        self.scratch = num_blocks
        model.allocate(num_blocks + 1, block_size)
        # each position's final hidden state, so echo for a cached prefix is the head over the
        # very rows that were computed (the head is row-invariant: identical logits)
        self.hidden = torch.zeros((num_blocks + 1) * block_size, model.hidden_size)
        self.echo = EchoCache((num_blocks + 1) * block_size)
        # a step's rows are padded up to a multiple of this (the general path, where the
        # startup check finds transformers' modules need it); the padding rows are one-token
        # sequences in the scratch block, the same objects every step
        self.pad_rows = 1
        self._pads = [_ProbeRow([0], [self.scratch]) for _ in range(PAD_ROWS - 1)]
        self.max_rows = max_rows
        # a decode group's attention in one kernel where the build has it (the same operations
        # as the general path: the same bits)
        self.model.fused_decode = kernels.fused_decode()
        log(f"numbers computed by: {kernels.describe()}")
        self.kept_keys_bytes = kept_keys_bytes
        self.vocab_size = self.model.vocab_size
        self.context_length = int(getattr(cfg.get_text_config(), "max_position_embeddings", None) or 2048)
        self.head_rows = head_rows
        self.align = KEY_ALIGN // block_size
        # the decode group whose gathered keys the model keeps: its sequences (held, so their
        # identity cannot be reused), key blocks and block tables
        self.kept: tuple[list, int, list[list[int]]] | None = None
        self.kept_bytes_per_key = model.kv_bytes_per_token()
        if hasattr(model, "reference"):   # the general path: measure that it is exact here
            self._check_fidelity()
            self._check_invariance()

    def numerics_digest(self) -> str:
        """The raw bits of this engine's numbers on a fixed sequence (NUMERICS_PROBE tokens drawn
        from seed 3, run whole, every position's log-softmax over the vocabulary), as a digest:
        what the weights, the kernels, the libraries and their instruction-set path make of it.
        A forward's rows are bit-identical at any row count, chunking and batch (the engine's
        invariance), so one forward stands for every step; two engines whose digests differ give
        different numbers, and the fingerprint says so."""
        gen = torch.Generator().manual_seed(3)
        # (run whole in one step: a step budget below it probes fewer tokens, so its digest differs)
        n = min(NUMERICS_PROBE, (self.scratch - 1) * self.block_size, self.max_rows)
        ids = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
        lp = kernels.log_softmax(self.model.logits(self._probe_rows([ids])))
        return hashlib.sha256(lp.contiguous().numpy().tobytes()).hexdigest()[:8]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------ startup checks (general path)
    def _probe_rows(self, seqs: list[list[int]]) -> torch.Tensor:
        """The final hidden rows of `seqs`, each run whole in one step from free blocks (at
        startup, before the scheduler hands out any)."""
        rows, nxt = [], 1
        for ids in seqs:
            need = self.blocks_for(len(ids))
            rows.append(_ProbeRow(ids, list(range(nxt, nxt + need))))
            nxt += need
        if nxt > self.scratch:
            raise UnsupportedModel("the KV pool is too small for the startup checks: raise --kv-cache-gib")
        hidden, _ = self.forward([(r, len(r.tokens)) for r in rows])
        self.kept = None
        self.model.kv.drop_kept()
        return hidden

    def _check_fidelity(self) -> None:
        """The general path must give transformers' own numbers (eager attention, fp32) on a
        probe sequence: next-token logprobs and each position's top 32, within FIDELITY."""
        from .transformers_model import FIDELITY

        m = self.model
        ids = m.reference_ids
        ours = kernels.log_softmax(m.logits(self._probe_rows([ids])))
        ref = torch.log_softmax(m.reference, -1)
        rows, nxt = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
        top = torch.topk(ref, min(32, ref.shape[-1]), dim=-1).indices
        gap = max((ours[rows, nxt] - ref[rows, nxt]).abs().max().item(),
                  (ours.gather(1, top) - ref.gather(1, top)).abs().max().item())
        m.reference = None
        if not gap <= FIDELITY:
            raise UnsupportedModel(f"model type {m.family!r}: probity's general path differs from transformers' "
                                   f"forward by {gap:.3g} on a probe sequence (allowed {FIDELITY:g}); "
                                   "vLLM may serve it: --backend vllm")
        log(f"general path: within {gap:.2g} of transformers' forward on a {len(ids)}-token probe")

    def _check_invariance(self) -> None:
        """Every row of the general path's forward must be bit-identical whatever the row count.
        One-token sequences run together at counts up to INVARIANCE_COUNTS and at several places
        in the step, each row compared with the same row of an INVARIANCE_WIDE-row forward,
        through one layer of each kind the model has (the rest repeat them). transformers' modules may apply an
        elementwise op to a tensor whose length depends on the row count (a [rows, 1] gate), and
        torch computes the last elements of a run that is not a multiple of its vector block
        another way; padding the step to a multiple of PAD_ROWS rows makes every such length a
        multiple of it. Where a count differs, steps are padded and everything checked again; if
        that does not hold either, the model is refused."""
        m = self.model
        widest = min(INVARIANCE_WIDE, self.scratch - 1, self.max_rows)
        gen = torch.Generator().manual_seed(2)
        seqs = [[t] for t in torch.randint(0, m.vocab_size, (widest,), generator=gen).tolist()]
        probes = [(n, j) for n in (*range(1, 34), 40, 47, 48, 63, 64) for j in (0, 3, 37)
                  if n + j <= min(widest, INVARIANCE_COUNTS + 37)]

        def differing() -> list[tuple[int, int]]:
            return [(n, j) for n, j in probes if not torch.equal(self._probe_rows(seqs[j:j + n]), wide[j:j + n])]
        with m.representative_layers():
            wide = self._probe_rows(seqs)
            bad = differing()
            if bad and widest % PAD_ROWS == 0:
                self.pad_rows = PAD_ROWS
                still = differing()
            else:
                still = bad
        if still:
            raise UnsupportedModel(f"model type {m.family!r}: on this CPU transformers' modules give a row other "
                                   f"bits in a forward of {still[0][0]} rows than of {widest}; "
                                   "vLLM may serve it: --backend vllm")
        log(f"general path: rows bit-identical at {len(probes)} row counts and offsets"
            + (f", with steps padded to a multiple of {PAD_ROWS} rows (unpadded, a forward of {bad[0][0]} rows "
               "gave other bits)" if bad else ""))

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds, by part (docs/engine.md, Memory)."""
        m = self.model
        parts = {"weights_kernels": 0, "weights_stored": 0}
        for lin in {id(lin): lin for lin in m.linears()}.values():
            for k, v in lin.weight_bytes().items():
                parts[k] += v
        other = sum(_nbytes(t) for t in {id(t): t for t in m.weight_tensors()}.values())
        return {**parts, "weights_other": other,
                "kv_pool": m.kv.nbytes(), "hidden_pool": _nbytes(self.hidden),
                "echo_cache": self.echo.nbytes(), "kept_keys_max": self.kept_keys_bytes, "resident": resident_bytes()}

    # ------------------------------------------------------------ attention groups
    def _groups(self, batch: list[tuple[Sequence, int]], starts: list[int]) -> list[AttnGroup]:
        """Sequences are attended together when their new rows fall in the same `row_bucket`
        and their key blocks in the same power-of-two bucket (decodes: one row each), so a step
        runs a few batched attention GEMMs instead of one per sequence. Grouping and padding
        change no bit: every row is computed the same way whatever its companions."""
        bs = self.block_size
        assert all(n <= self.max_rows for _, n in batch), "a step's rows exceed the measured buckets"
        # each sequence's key blocks after this step, aligned to whole KEY_ALIGN slices
        nbs = [-(-self.blocks_for(seq.num_computed + n) // self.align) * self.align for seq, n in batch]
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, ((seq, n), nb) in enumerate(zip(batch, nbs)):
            rows = row_bucket(n)
            buckets.setdefault((rows, 1 << (nb - 1).bit_length() if nb > self.align else nb), []).append(i)
        specs = []
        for (rows, _), members in buckets.items():
            nb = max(nbs[i] for i in members)
            idx, dest, keep, qpos, blocks = [], [], [], [], []
            for j, i in enumerate(members):
                seq, n = batch[i]
                a = seq.num_computed
                idx += [starts[i] + min(r, n - 1) for r in range(rows)]
                qpos.append([a + min(r, n - 1) for r in range(rows)])
                dest += range(starts[i], starts[i] + n)
                keep += range(j * rows, j * rows + n)
                used = seq.blocks[: self.blocks_for(a + n)]
                blocks += used + [0] * (nb - len(used))
            # keys before the group's earliest query position are visible to all its rows: the
            # slices of KEY_ALIGN keys before it are not masked
            lead = min(p[0] for p in qpos) // KEY_ALIGN * KEY_ALIGN
            visible, hide = masks(lead, nb * bs, qpos)
            decode = all(batch[i][1] == 1 for i in members)
            specs.append(dict(
                items=len(members), rows=rows, nb=nb, length=nb * bs, qpos=torch.tensor(qpos),
                idx=torch.tensor(idx), dest=torch.tensor(dest),
                keep=None if len(keep) == len(idx) else torch.tensor(keep), lead=lead, visible=visible, hide=hide,
                blocks=torch.tensor(blocks), decode=decode, pos=torch.tensor([p[0] for p in qpos]) if decode else None,
                members=[batch[i][0] for i in members]))
        self._plan_kept_keys(specs)
        return [AttnGroup(**{k: v for k, v in spec.items() if k != "members"}) for spec in specs]

    def _plan_kept_keys(self, specs: list[dict]) -> None:
        """Decoding sequences attend over keys gathered from the pool, and a gather is a copy of
        all of them every step. The largest decode group keeps its gathered keys (within
        --kept-keys-gib) and the next step writes only its new positions into them, as long as
        it holds the same sequences with the same key length and their tables have only grown."""
        spec = max((s for s in specs if s["decode"]), key=lambda s: s["items"], default=None)
        if spec is None or spec["items"] * spec["nb"] * self.block_size * self.kept_bytes_per_key > self.kept_keys_bytes:
            if self.kept is not None:
                self.kept = None
                self.model.kv.drop_kept()
            return
        members, nb = spec["members"], spec["nb"]
        tables = [seq.blocks[: self.blocks_for(seq.num_computed + 1)] for seq in members]
        old = self.kept
        if (old is not None and old[1] == nb and len(old[0]) == len(members)
                and all(a is b for a, b in zip(old[0], members))
                and all(t[: len(o)] == o for t, o in zip(tables, old[2]))):
            L = nb * self.block_size
            spec["kept"] = Kept.REUSE
            spec["new_at"] = torch.tensor([j * L + seq.num_computed for j, seq in enumerate(members)])
        else:
            spec["kept"] = Kept.KEEP
        self.kept = (members, nb, tables)

    # ------------------------------------------------------------ a step
    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """The final hidden rows of every sequence's next `n` positions (whose blocks the
        scheduler has allocated), and where each sequence's rows start."""
        tokens, positions, slots, starts = [], [], [], []
        bs = self.block_size
        real = sum(n for _, n in batch)
        pad = -real % self.pad_rows
        if pad:
            batch = batch + [(row, 1) for row in self._pads[:pad]]
        for seq, n in batch:
            starts.append(len(tokens))
            a = seq.num_computed
            tokens += seq.tokens[a:a + n]
            for p in range(a, a + n):
                positions.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
        slots_t = torch.tensor(slots)
        hidden = self.model.forward(torch.tensor(tokens), torch.tensor(positions), slots_t, self._groups(batch, starts))
        self.hidden[slots_t] = hidden
        self.echo.void(slots_t)
        return hidden[:real], starts[:len(starts) - pad]

    @torch.inference_mode()
    def step(self, batch: list[tuple[Sequence, int]], wants_sample) -> list[SeqResult]:
        """Run one forward. `wants_sample(seq)` says whether a token is to be sampled once the
        sequence's positions are all computed. Does not advance `num_computed`."""
        hidden, starts = self.forward(batch)
        results = [SeqResult() for _ in batch]
        wanted, echo_slots, shared = self._head_rows(batch, starts, len(hidden), wants_sample, results)
        rows = torch.cat([hidden, self.hidden[torch.tensor(echo_slots)]]) if echo_slots else hidden
        computed: dict[tuple, tuple[float, list | None]] = {}
        for c in range(0, len(wanted), self.head_rows):
            self._head(batch, rows, wanted[c:c + self.head_rows], results, computed if shared else None)
        for i, p, key in shared:
            v, table = computed[key]
            results[i].echo.append((p, v, None if table is None else list(table)))
        for r in results:  # cached entries and computed ones, in position order
            r.echo.sort(key=lambda e: e[0])
        return results

    def _head_rows(self, batch, starts: list[int], n_hidden: int, wants_sample,
                   results: list[SeqResult]) -> tuple[list[HeadRow], list[int], list[tuple[int, int, tuple]]]:
        """Which rows need the head: (rows, the pool slots of echo rows read back, echo entries
        another sequence of the step computes). Echo rows come from the pool of final hidden
        states, so positions served by the prefix cache have theirs; positions whose entry the
        echo cache holds need no head at all (their entries go straight into `results`). An
        entry two sequences of this step both need (a block one fills and another shares in the
        same step) is computed once, given to both."""
        bs = self.block_size
        wanted: list[HeadRow] = []
        echo_slots: list[int] = []
        first: set[tuple] = set()
        shared: list[tuple[int, int, tuple]] = []
        for i, (seq, n) in enumerate(batch):
            a = seq.num_computed
            if seq.echo_next:
                k = seq.request.sampling.logprobs
                # whole rows (distribution, score_tokens) are not kept: such positions are computed
                rows = seq.request.sampling.reports_rows
                pos = list(range(seq.echo_next, min(a + n, len(seq.prompt) - 1) + 1))
                slots = [seq.blocks[(p - 1) // bs] * bs + (p - 1) % bs for p in pos]
                hits = (self.echo.lookup(slots, [seq.prompt[p] for p in pos], k) if pos and not rows
                        else [None] * len(pos))
                for p, slot, hit in zip(pos, slots, hits):
                    key = (slot, seq.prompt[p], k)
                    if hit is not None:
                        results[i].echo.append((p, *hit))
                    elif key in first and not rows:
                        shared.append((i, p, key))
                    else:
                        first.add(key)
                        wanted.append(HeadRow(n_hidden + len(echo_slots), i, False, p, slot))
                        echo_slots.append(slot)
            if a + n == len(seq.tokens) and wants_sample(seq):
                wanted.append(HeadRow(starts[i] + n - 1, i, True))
        return wanted, echo_slots, shared

    def _head(self, batch, rows: torch.Tensor, chunk: list[HeadRow], results: list[SeqResult],
              computed: dict | None) -> None:
        """The head and the log-softmax over one chunk of rows: a sampled row's logits go to its
        result; echo rows become entries (value and table), stored in the echo cache and, where
        another sequence of the step shares them, in `computed`."""
        logits = self.model.logits(rows[torch.tensor([w.row for w in chunk])])
        lp = kernels.log_softmax(logits)
        echo_rows: dict[int, list[int]] = {}
        for j, w in enumerate(chunk):
            if w.sample:
                results[w.seq].logits, results[w.seq].lp = logits[j], lp[j]
            else:
                echo_rows.setdefault(w.seq, []).append(j)
        for i, js in echo_rows.items():
            seq = batch[i][0]
            pos = [chunk[j].position for j in js]
            targets = [seq.prompt[p] for p in pos]
            sub = lp[torch.tensor(js)]
            vals = sub[torch.arange(len(js)), torch.tensor(targets)].tolist()
            k = seq.request.sampling.logprobs
            lists = top_lists(sub, k) if k is not None else None
            self.echo.store([chunk[j].slot for j in js], targets, vals, k, lists)
            tables = ([with_chosen(ls, t, v) for ls, t, v in zip(lists, targets, vals)] if lists is not None
                      else [None] * len(js))
            s = seq.request.sampling
            rows = row_reports(sub, s.distribution, s.score_tokens) if s.reports_rows else None
            results[i].echo += list(zip(pos, vals, tables, rows)) if rows else list(zip(pos, vals, tables))
            if computed is not None:
                for j, t, v, table in zip(js, targets, vals, tables):
                    computed[(chunk[j].slot, t, k)] = (v, table)


class _ProbeRow:
    """What the runner reads of a sequence, for the startup checks."""

    def __init__(self, tokens: list[int], blocks: list[int]):
        self.tokens, self.blocks, self.num_computed = tokens, blocks, 0


def _nbytes(t) -> int:
    if t is None:
        return 0
    try:
        return t.untyped_storage().nbytes()
    except NotImplementedError:  # oneDNN's packed weight is opaque: its logical size (its layout may pad)
        return t.numel() * t.element_size()


def resident_bytes() -> int:
    """This process's resident set (Linux), or 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
