"""Prefix cache: per-step, per-layer keys/values of the complete attention blocks of a stream.

Why it is exact (docs/DESIGN.md, "Prefix cache"): under the 50-frame block-causal mask, every
DiT activation of a frame in block j, at every solver step and in both CFG rows, is a function
of the inputs of blocks <= j only (attention reads keys < the block's end, the conv position
embedding looks 60 frames left, RoPE uses absolute positions, the noise row and t are fixed by
position and step). Those inputs are identical in every later call of the stream as long as the
frame's mu never read a lookahead pad, which holds for all frames a non-final call emits. So a
later call may take the keys/values of such blocks from an earlier call and compute queries only
for its new frames. The cache is an optimisation, never a source of truth: an entry is keyed by
stream, voice and solver schedule AND verified against the token ids its frames depend on, so a
mismatch is a miss, and a miss recomputes the same mel.

Storage: one pool tensor of fixed-size blocks (one 50-frame attention block: steps x layers x
{K, V} x {cond, uncond} x 50 x d in the compute dtype), allocated at first use, with per-block
reference counts. One tensor, not several, because a CUDA graph bakes in the addresses it reads
and writes: graphed solves gather and store blocks by index into it (`IndexedKV`). Blocks
past the budget are never handed out: a zero block that index reads of absent prefix blocks
take (masked keys must still be finite), and scratch blocks for the query blocks a graphed
solve stores nothing of (`IndexedKV` reads every query block back from the pool).
Entries (LRU) list their blocks; a voice entry holds the blocks made only of prompt frames and
shares them with the streams of that voice. Per entry it also keeps the Euler state x of every
cached frame at every step (c channels, ~0.1 % of the K/V bytes): the conv position embedding
of the first new frame reads the 60 frames before it.

Shapes (docs/DESIGN.md "Shape letters"): b calls, r = 2b solver rows, t frames, c mel channels,
d DiT width; q = a row's frames after its cached prefix (its queries), padded to the longest.

Thread safety: `plan` / `commit` / `release` run on the runner thread, `drop` on the event
loop; one lock guards the bookkeeping. A solve pins the blocks it reads (refcount), so an
eviction or a drop during the solve never frees memory under it.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from flow_service.model.requests import FlowRequest
from flow_service.model.solver import euler_cfg, noise_buffer


def all_token_ids(req: FlowRequest) -> torch.Tensor:
    return torch.cat((req.voice.prompt_token.to(torch.int64), req.tokens.to(torch.int64)))


@dataclass
class _Entry:
    blocks: list[int]  # pool block ids, block b = frames [b*B, (b+1)*B)
    ids: torch.Tensor  # prompt + target token ids the cached frames depend on (CPU int64)
    xs: torch.Tensor  # (steps, frames, c) compute dtype: solver input x of each cached frame
    stream: bool  # False: a voice entry (prompt-only blocks)
    used_at: float = 0.0  # clock() of the last lookup or store


@dataclass
class RowPlan:
    """What one request row does with the cache in one solve."""

    prefix: int = 0  # frames taken from the cache (a multiple of the block)
    read: list[int] = field(default_factory=list)  # pinned block ids of the prefix
    xs: torch.Tensor | None = None  # (steps, prefix, c) x of the cached frames
    new: list[int] = field(default_factory=list)  # allocated blocks to fill after `prefix`
    key: tuple | None = None  # stream entry to write (None: no store)
    voice_key: tuple | None = None  # voice entry to write when the row fills prompt blocks
    voice_blocks: int = 0
    ids: torch.Tensor | None = None
    drop: tuple | None = None  # stream entry to drop after the solve (final call)


@dataclass
class PrefixPlan:
    cache: PrefixCache
    rows: list[RowPlan]

    @property
    def active(self) -> bool:
        """Whether the prefix path runs: some row reads or writes cached blocks."""
        return any(r.prefix or r.new for r in self.rows)

    def pad(self, num_rows: int) -> None:
        """Extend to `num_rows` rows copying the last one, for a graph's row bucket (the runner
        pads the batch with copies of its last request): the copies read what it reads (pinned
        once more each) and store nothing."""
        last = self.rows[-1]
        extra = [
            RowPlan(last.prefix, list(last.read), last.xs) for _ in range(num_rows - len(self.rows))
        ]
        with self.cache._lock:
            for row in extra:
                self.cache._incref(row.read)
        self.rows += extra


class PrefixCache:
    def __init__(
        self,
        budget_bytes: int,
        *,
        num_steps: int,
        depth: int,
        dim: int,
        mel_dim: int,
        block_frames: int,
        token_mel_ratio: int,
        lookahead: int,
        schedule_id: tuple,
        dtype: torch.dtype,
        device: torch.device | str,
        share_voice_blocks: bool = True,
        evict_idle_s: float = 0.0,
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes: {budget_bytes} < 0")
        self.num_steps, self.depth, self.dim, self.mel_dim = num_steps, depth, dim, mel_dim
        self.block = block_frames
        self.ratio = token_mel_ratio
        self.lookahead = lookahead
        self.schedule_id = schedule_id
        self.dtype = dtype
        self.device = torch.device(device)
        self.share_voice_blocks = share_voice_blocks
        # Only entries unused for this long are evicted to make room; otherwise a new block is
        # not stored. With many long streams in flight, plain LRU would evict exactly the
        # streams whose next call comes soonest (cyclic access) and nothing would ever hit.
        self.evict_idle_s = evict_idle_s
        self.clock = clock
        self._observe = observe or (lambda name, value: None)
        item = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = num_steps * depth * 2 * 2 * block_frames * dim * item
        self.frame_x_bytes = num_steps * mel_dim * item
        self.capacity = budget_bytes // self.block_bytes  # blocks handed out
        self.zero_block = self.capacity
        self.scratch_query_blocks = scratch_query_blocks(num_steps, depth)
        self.scratch_blocks = self.scratch_query_blocks // (num_steps * depth)
        self._pool: torch.Tensor | None = None
        # min-heap, lowest id first: a row's blocks, and the rows of a batch, get consecutive
        # ids, which the eager solve then moves with one strided copy per run
        self._free = list(range(self.capacity))
        self._refs = [0] * self.capacity
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = dict.fromkeys(
            ("hits", "voice_hits", "misses", "evictions", "reused_frames", "computed_frames"), 0
        )

    @classmethod
    def for_model(cls, model, budget_bytes: int, **kwargs) -> PrefixCache:
        cfg = model.cfg
        dec = model.decoder
        return cls(
            budget_bytes,
            num_steps=len(dec.steps),
            depth=cfg.dit.depth,
            dim=cfg.dit.dim,
            mel_dim=cfg.mel_dim,
            block_frames=cfg.dit.block_frames,
            token_mel_ratio=cfg.token_mel_ratio,
            lookahead=cfg.pre_lookahead_len,
            schedule_id=(tuple(dec.steps), dec.cfg_rate, cfg.dit.block_frames, str(model.dtype)),
            dtype=model.dtype,
            device=model.device,
            **kwargs,
        )

    # -- accounting ----------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        x_frames = sum(e.xs.shape[1] for e in self._entries.values())
        return self.used_blocks * self.block_bytes + x_frames * self.frame_x_bytes

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] += n
        self._observe(name, n)

    def _gauges(self) -> None:
        self._observe("bytes", self.bytes_used)
        self._observe("entries", len(self._entries))

    # -- blocks --------------------------------------------------------------------------------
    def pool(self) -> torch.Tensor:
        """(steps, layers, {K, V}, capacity + 1 + scratch blocks, {cond, uncond}, block, d)."""
        if self._pool is None:
            num = self.capacity + 1 + self.scratch_blocks
            shape = (self.num_steps, self.depth, 2, num, 2, self.block, self.dim)
            # uninitialised: a block is fully written before it is read, but for the zero block
            self._pool = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._pool[:, :, :, self.zero_block].zero_()
        return self._pool

    def _incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def _decref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)

    def _allocate(self, n: int, keep: set) -> list[int]:
        """Up to n free blocks, evicting least recently used entries idle for at least
        `evict_idle_s` (not those in `keep`)."""
        now = self.clock()
        for key in list(self._entries):
            if len(self._free) >= n or now - self._entries[key].used_at < self.evict_idle_s:
                break  # LRU order: every later entry was used more recently
            if key in keep:
                continue
            self._decref(self._entries.pop(key).blocks)
            self._count("evictions")
        got = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        self._incref(got)
        return got

    # -- planning ------------------------------------------------------------------------------
    def _stream_key(self, req: FlowRequest, fp: bytes) -> tuple | None:
        key = getattr(req, "cache_key", None)
        return ("stream", key, fp, self.schedule_id) if key else None

    def _voice_key(self, fp: bytes) -> tuple:
        return ("voice", fp, self.schedule_id)

    def _usable(self, entry: _Entry | None, ids: torch.Tensor, limit_blocks: int) -> int:
        """Blocks of `entry` valid for a request with token ids `ids` (0 on any mismatch)."""
        if entry is None:
            return 0
        n = min(len(entry.blocks), limit_blocks)
        while n > 0:
            need = -(-n * self.block // self.ratio) + self.lookahead
            if ids.shape[0] >= need and torch.equal(ids[:need], entry.ids[:need]):
                return n
            n -= 1  # a shorter prefix may still agree (e.g. a voice's prompt blocks)
        return 0

    def plan(self, requests: Sequence[FlowRequest]) -> PrefixPlan:
        """Look up and pin each row's cached prefix, allocate blocks for what it will store."""
        rows, stores = [], []
        with self._lock:
            pinned_keys: set = set()
            for req in requests:
                row = RowPlan()
                rows.append(row)
                if not req.streaming and not req.cache_key:
                    continue  # neither reads, writes nor ends a stream entry
                fp = req.voice.fingerprint
                key = self._stream_key(req, fp)
                if req.finalize:
                    row.drop = key  # the stream's last call: its entry goes after the solve
                if not req.streaming:
                    continue  # full attention: every frame sees the whole sequence
                ids = all_token_ids(req)
                vkey = self._voice_key(fp)
                limit = (
                    readable_prefix(req.out_start_frame, req.num_seq_frames, True, self.block)
                    // self.block
                )
                entry = self._entries.get(key) if key else None
                use = self._usable(entry, ids, limit)
                kind = "hits"
                if use == 0 and self.share_voice_blocks:
                    entry = self._entries.get(vkey)
                    use = self._usable(entry, ids, limit)
                    kind = "voice_hits"
                if use:
                    row.prefix = use * self.block
                    row.read = entry.blocks[:use]
                    row.xs = entry.xs[:, : row.prefix]
                    self._incref(row.read)
                    entry.used_at = self.clock()
                    self._entries.move_to_end(key if kind == "hits" else vkey)
                    pinned_keys.add(key if kind == "hits" else vkey)
                    self._count(kind)
                elif limit > 0:
                    self._count("misses")
                if not req.finalize:
                    stores.append((row, req, key, vkey, ids))
            # Stores only after every row's prefix is pinned: a row's new blocks never evict
            # the entry a later row of the same batch reads (they would only get fewer blocks).
            for row, req, key, vkey, ids in stores:
                # Blocks complete in this call whose mu read real tokens only: all of them for
                # a non-final call (its lookahead tokens produce no frames).
                end = req.num_seq_frames // self.block
                n_p = req.voice.num_prompt_tokens
                voice_blocks = prompt_blocks(n_p, self.ratio, self.lookahead, self.block)
                want_voice = (
                    self.share_voice_blocks
                    and voice_blocks > 0
                    and row.prefix < voice_blocks * self.block
                    and len(getattr(self._entries.get(vkey), "blocks", ())) < voice_blocks
                )
                if key is None and not want_voice:
                    continue
                if key is None:
                    end = voice_blocks
                todo = end - row.prefix // self.block
                if todo <= 0:
                    continue
                row.new = self._allocate(todo, pinned_keys)
                if not row.new:
                    continue
                row.key = key
                row.ids = ids
                if want_voice:
                    row.voice_key = vkey
                    row.voice_blocks = voice_blocks
            for row, req in zip(rows, requests, strict=True):
                self._count("reused_frames", row.prefix)
                self._count("computed_frames", req.num_seq_frames - row.prefix)
            self._gauges()
        return PrefixPlan(self, rows)

    def commit(self, plan: PrefixPlan, xs_new: list[torch.Tensor | None]) -> None:
        """After a solve: turn each row's filled blocks into entries, drop finished streams,
        unpin. `xs_new[i]` is (steps, frames >= len(new) x block, c), x of the new frames."""
        with self._lock:
            for row, xs in zip(plan.rows, xs_new, strict=True):
                if row.new and xs is not None:
                    blocks = row.read + row.new
                    frames = len(blocks) * self.block
                    parts = [row.xs] if row.prefix else []
                    parts.append(xs[:, : frames - row.prefix])
                    all_xs = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                    need = -(-frames // self.ratio) + self.lookahead
                    if row.key is not None:
                        self._put(row.key, blocks, row.ids[:need].clone(), all_xs, True)
                    if row.voice_key is not None and len(blocks) >= row.voice_blocks:
                        nv = row.voice_blocks
                        need_v = -(-nv * self.block // self.ratio) + self.lookahead
                        self._put(
                            row.voice_key,
                            blocks[:nv],
                            row.ids[:need_v].clone(),
                            all_xs[:, : nv * self.block],
                            False,
                        )
                if row.drop is not None and row.drop in self._entries:
                    self._decref(self._entries.pop(row.drop).blocks)
            self._unpin(plan)
            self._gauges()

    def release(self, plan: PrefixPlan) -> None:
        """A solve that failed: unpin and free its blocks, write nothing."""
        with self._lock:
            self._unpin(plan)
            self._gauges()

    def _unpin(self, plan: PrefixPlan) -> None:
        for row in plan.rows:
            self._decref(row.read)
            self._decref(row.new)
            row.read, row.new = [], []

    def _put(self, key, blocks, ids, xs, stream: bool) -> None:
        old = self._entries.get(key)
        if old is not None and len(old.blocks) >= len(blocks):
            old.used_at = self.clock()
            self._entries.move_to_end(key)
            return  # another call of the stream got at least as far (same values)
        self._incref(blocks)
        self._entries[key] = _Entry(list(blocks), ids, xs.contiguous(), stream, self.clock())
        self._entries.move_to_end(key)
        if old is not None:
            self._decref(old.blocks)

    def drop(self, cache_key: str) -> int:
        """Forget every stream entry of `cache_key` (finalized or cancelled); returns how many."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == "stream" and k[1] == cache_key]
            for k in keys:
                self._decref(self._entries.pop(k).blocks)
            self._gauges()
        return len(keys)

    def clear(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                self._decref(entry.blocks)
            self._entries.clear()
            self._gauges()


# -- the solve ----------------------------------------------------------------------------------
# The keys/values one solve assembles at a time: all rows, all key frames, K and V of a group
# of consecutive layers, (layers, {K, V}, r, t, d). The cached prefix of a whole group is
# gathered in one pass per (block column, run of rows) and its new blocks stored
# likewise, instead of per layer. Extra memory per batch: at most max(KV_BUFFER_BYTES, one
# layer's K and V = 2 r t d x dtype size); e.g. 64 rows x 506 frames, bf16, d 1024: 265 MB a
# layer, 8 layers a group (2.1 GB), where one layer (265 MB) was used before.
KV_BUFFER_BYTES = 2 << 30
# Scratch for the query blocks of one graphed solve (padded rows x query blocks) that are not
# stored: every (step, layer) slice of a scratch block holds one, reused by every layer and
# step. graph_max_frames (12288) keeps a graphed batch of the default runner near 620; a solve
# that would need more runs eagerly (FlowRunner.graphed).
SCRATCH_QUERY_BLOCKS = 640


def readable_prefix(out_start_frame: int, num_seq_frames: int, streaming: bool, block: int) -> int:
    """Frames of a call's sequence it may read from the cache, if its stream's (or voice's)
    earlier calls stored them: whole blocks, never past its first returned frame (a retried
    chunk recomputes its frames) nor into the block its sequence ends in; none for a
    full-attention call (every frame sees the whole sequence)."""
    if not streaming:
        return 0
    return min(out_start_frame, num_seq_frames) // block * block


def prompt_blocks(num_prompt_tokens: int, ratio: int, lookahead: int, block: int) -> int:
    """Blocks made of prompt frames only (their lookahead reads prompt tokens): what a voice
    entry holds and shares with the voice's streams."""
    return max(0, ratio * (num_prompt_tokens - lookahead)) // block


def scratch_query_blocks(num_steps: int, depth: int) -> int:
    """Query blocks a graphed solve may hold in scratch: SCRATCH_QUERY_BLOCKS, rounded up to
    whole scratch blocks of num_steps x depth slices."""
    return -(-SCRATCH_QUERY_BLOCKS // (num_steps * depth)) * num_steps * depth


def query_bucket(blocks: int) -> int:
    """The query blocks a graphed prefix solve of `blocks` pads to: the next power of two.
    A ragged batch's longest query run can be any number of blocks, and each number would be
    a graph of its own, captured inside the first batch that meets it (~0.1 s); padded query
    frames are masked like a shorter row's, so no result changes."""
    return 1 << (blocks - 1).bit_length()


SLICE_RUNS = 2  # new frames: up to this many slice copies per layer, else one index copy


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as the widest integers its rows allow (int64 for d x 2 bytes % 8 == 0): the
    copies below move bits only, and index kernels run per element, so 4x fewer of them."""
    row = t.shape[-1] * t.element_size()
    for wide in (torch.int64, torch.int32, torch.int16):
        if row % wide.itemsize == 0 and wide.itemsize >= t.element_size():
            try:
                return t.view(wide)
            except RuntimeError:  # strides or offset not a multiple of the word: as is
                return t
    return t


def _selector(ids: list[int], dev) -> slice | torch.Tensor:
    """Block ids as a slice when they are evenly spaced (a plain strided copy), else an index
    tensor (a gather / scatter kernel)."""
    step = ids[1] - ids[0] if len(ids) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(ids, ids[1:], strict=False)):
        return slice(ids[0], ids[-1] + 1, step)
    return torch.tensor(ids, device=dev)


class _KVAssembler:
    """The attention hook of one solve: per (step, layer), the keys/values of every row at
    absolute positions, (r, t, d): the cached prefix from the pool, then the new frames; and
    the new frames of stored blocks written into the pool.

    Layers go in groups sharing one buffer (KV_BUFFER_BYTES). At a group's first layer, its
    cached prefix is copied from the pool for all its layers, K and V at once: one copy per
    block column and run of consecutive rows (a
    strided copy when their ids are evenly spaced, as blocks allocated together are, else an
    index_select straight into the buffer). Each layer then places its new frames: one slice
    copy for K and one for V per run of neighbouring rows sharing prefix and query count (one
    run in a batch of one call index of many streams), or an index copy past SLICE_RUNS runs.
    After a group's last layer the new complete blocks of all its layers go to the pool the same
    way as the prefix came. Everything here copies bits (exact)."""

    # Tests switch the slice copies off to compare with the index copies.
    allow_slice_new = True  # new frames
    allow_slice_moves = True  # pool <-> buffer

    def __init__(self, cache: PrefixCache, plan: PrefixPlan, prefix, num_queries, num_keys, dev):
        b = len(plan.rows)
        r, blk, d, depth = 2 * b, cache.block, cache.dim, cache.depth
        q_max = int(num_queries.max())
        self.cache = cache
        self.step = 0
        layer_bytes = 2 * r * num_keys * d * cache.dtype.itemsize
        self.group = max(1, min(depth, KV_BUFFER_BYTES // max(1, layer_bytes)))
        buf = torch.zeros((self.group, 2, r, num_keys, d), dtype=cache.dtype, device=dev)
        self.keys = [buf[i, 0] for i in range(self.group)]  # (r, t, d) contiguous each
        self.values = [buf[i, 1] for i in range(self.group)]
        words = _words(buf)
        by_row = words.unflatten(2, (2, b))  # (layers, 2, {cond, uncond}, b, t, w)

        def moves(placed: list[tuple[int, int, int]]) -> list[tuple]:
            """(block selector, buffer view (layers, 2, n, 2, blk, w)) per run of
            consecutive rows with the same frame offset; `placed` holds
            (row, frame offset, block id)."""
            out, run = [], []
            for item in sorted(placed, key=lambda x: (x[1], x[0])):
                i, f, _ = item
                if run:
                    i0, f0, _ = run[-1]
                    if i != i0 + 1 or f != f0:
                        out.append(run)
                        run = []
                run.append(item)
            out += [run] if run else []
            result = []
            for run in out:
                (i0, f, _), i1 = run[0], run[-1][0] + 1
                ids = [x[2] for x in run]
                sel = (
                    _selector(ids, dev) if self.allow_slice_moves else torch.tensor(ids, device=dev)
                )
                view = by_row[:, :, :, i0:i1, f : f + blk].transpose(2, 3)
                result.append((sel, view))
            return result

        self.reads = moves(
            [(i, j * blk, x) for i, row in enumerate(plan.rows) for j, x in enumerate(row.read)]
        )
        self.stores = moves(
            [
                (i, row.prefix + j * blk, x)  # the new blocks start at the row's first query
                for i, row in enumerate(plan.rows)
                for j, x in enumerate(row.new)
            ]
        )
        self.pool_words = _words(cache.pool())
        # The new frames: query q of row r goes to key position prefix_r + q. Rows next to each
        # other with the same prefix and query count (all of them in a batch of one call index
        # of many streams) take one slice copy for both CFG halves; more than SLICE_RUNS such
        # runs take one index copy.
        runs: list[list[int]] = []  # [first row, end row, prefix, queries]
        for i, (p, q) in enumerate(zip(prefix.tolist(), num_queries.tolist(), strict=True)):
            if runs and runs[-1][2:] == [p, q]:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, p, q])
        self.sliced = self.allow_slice_new and len(runs) <= SLICE_RUNS
        if self.sliced:

            def place(layer: int, kv: int, a: int, e: int, p: int, q: int) -> torch.Tensor:
                keys = buf[layer, kv]  # (r, t, d)
                if len(runs) > 1:
                    keys = keys.unflatten(0, (2, b))[:, a:e]  # (2, rows of the run, t, d)
                return keys[..., p : p + q, :]

            self.new_views = [  # [2 layer + kv][run]: (destination, as words)
                [(x, _words(x)) for x in (place(i, kv, *run) for run in runs)]
                for i in range(self.group)
                for kv in (0, 1)
            ]
            self.runs = runs
        else:
            rows = torch.arange(r)[:, None]
            q = torch.arange(q_max)[None, :]
            valid = q < num_queries.repeat(2)[:, None]
            self.new_src = (rows * q_max + q)[valid].to(dev)
            self.new_dst = (rows * num_keys + prefix.repeat(2)[:, None] + q)[valid].to(dev)
            self.flat = [
                (_words(k).flatten(0, 1), _words(v).flatten(0, 1))
                for k, v in zip(self.keys, self.values, strict=True)
            ]

    def layer(self, index: int) -> Callable:
        return lambda k, v: self._assemble(index, k, v)

    def _move(self, moves: list[tuple], first_layer: int, n: int, store: bool) -> None:
        # the pool's blocks at the current step for n layers: (n, 2, blocks, 2, blk, w)
        pool = self.pool_words[self.step, first_layer : first_layer + n]
        for sel, view in moves:
            view = view if n == self.group else view[:n]
            if isinstance(sel, slice):
                dst, src = (pool[:, :, sel], view) if store else (view, pool[:, :, sel])
                dst.copy_(src)
            elif store:
                pool.index_copy_(2, sel, view)
            else:
                torch.index_select(pool, 2, sel, out=view)

    def _assemble(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        group, i = divmod(layer, self.group)
        first = group * self.group
        n = min(self.group, self.cache.depth - first)
        if i == 0:
            self._move(self.reads, first, n, store=False)
        if self.sliced:
            for new, views in zip((k, v), self.new_views[2 * i : 2 * i + 2]):
                for (dst, dst_words), (a, e, _, q) in zip(views, self.runs, strict=True):
                    src = new if len(views) == 1 else new.unflatten(0, (2, -1))[:, a:e, :q]
                    src_words = _words(src)
                    if src_words.dtype == dst_words.dtype:
                        dst_words.copy_(src_words)
                    else:
                        dst.copy_(src)
        else:
            for new, flat in zip((k, v), self.flat[i], strict=True):
                # (r q, w): a view, also where k and v are column slices of one q/k/v GEMM
                new_flat = _words(new.flatten(0, 1))
                if new_flat.dtype != flat.dtype:  # rows not word-aligned: compact them first
                    new_flat = _words(new.flatten(0, 1).contiguous())
                flat.index_copy_(0, self.new_dst, new_flat.index_select(0, self.new_src))
        if i == n - 1:
            self._move(self.stores, first, n, store=True)
        return self.keys[i], self.values[i]


@dataclass
class DiTPrefix:
    """What `DiT.forward(prefix=...)` needs: the window's context length, which window frames
    lie before position 0 (zeroed after the input projection), per-row rotary tables of the
    query positions, and the per-layer K/V hook."""

    context: int
    keep: torch.Tensor  # (r, context + q, 1)
    rope: tuple[torch.Tensor, torch.Tensor]  # (r, q, e) each: RotaryEmbedding.tables_at
    kv: _KVAssembler

    def layer(self, index: int) -> Callable:
        return self.kv.layer(index)


class IndexedKV:
    """The attention hook of a graphed solve: the same keys/values as `_KVAssembler`, moved by
    index tensors instead of Python-side runs, so one capture serves every batch of its shape.

    Keys are laid out as [P prefix frames | Q query frames] per row, not at absolute positions:
    column p < P is the row's cached frame p (the zero block past its prefix), column P + j its
    query j (frame prefix + j). `window_bias` masks by that layout. Per layer the query frames'
    keys and values are stored first, by whole blocks (Q is a whole number of blocks), into
    the row's new blocks or into scratch where the row stores nothing; then one gather reads
    [prefix | queries] of every row back from the pool. That is three kernels a layer, and a
    cached frame's keys/values move once, as in the eager solve, not gathered and then copied
    into place."""

    def __init__(self, pool, gather_rows, store_rows):
        # pool (steps, L, 2, N, 2, blk, d) as rows of (blk, d): row (((s L + l) 2 + kv) N + n) 2
        # + cfg; the rows of the current step are computed outside (`pool_rows`): no index
        # arithmetic in the graph
        self.rows = pool.view(-1, *pool.shape[5:])
        self.gather_rows = gather_rows  # (L, {K, V}, {cond, uncond}, b, (P + Q) / blk) long
        self.store_rows = store_rows  # (L, {K, V}, {cond, uncond}, b, Q / blk) long

    @staticmethod
    def pool_rows(
        cache: PrefixCache,
        read: torch.Tensor,
        store: torch.Tensor,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a solve reading block ids `read` (b, n_p) and storing the query blocks into
        block ids `store` (b, n_q; -1: store nothing): (gather rows, their move per step,
        store rows, their move per step) on `device` (default: `store`'s); step s uses rows +
        s x move. Query blocks stored nothing of go to scratch rows, the same at every layer
        and step. The scratch bound is checked where `store` lies: pass host tensors and a
        device, so the check reads no count back from the card."""
        nothing = store < 0
        if (n := int(nothing.sum())) > cache.scratch_query_blocks:
            raise ValueError(
                f"{n} query blocks stored nothing of, past the scratch's "
                f"{cache.scratch_query_blocks}"
            )
        dev, depth = torch.device(device or store.device), cache.depth
        read, store, nothing = read.to(dev), store.to(dev), nothing.to(dev)
        num = cache.capacity + 1 + cache.scratch_blocks
        step_rows = depth * 2 * num * 2
        kv = torch.arange(2, device=dev).view(2, 1, 1, 1)
        cfg = torch.arange(2, device=dev).view(1, 2, 1, 1)

        def rows(layer_kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            return (layer_kv * num + blocks) * 2 + cfg

        layer_kv = torch.arange(depth, device=dev).view(depth, 1, 1, 1, 1) * 2 + kv
        m = (nothing.flatten().cumsum(0) - 1).view_as(store)  # scratch slot per block
        per_block = cache.num_steps * depth  # (step, layer) slices of one scratch block
        scratch = rows(m % per_block * 2 + kv, cache.capacity + 1 + m // per_block)
        store_rows = torch.where(nothing, scratch, rows(layer_kv, store.clamp(min=0)))
        store_step = torch.where(nothing, 0, step_rows).expand_as(store_rows)
        read_rows = rows(layer_kv, read)
        gather_rows = torch.cat((read_rows, store_rows), dim=-1)
        gather_step = torch.cat((torch.full_like(read_rows, step_rows), store_step), dim=-1)
        return gather_rows, gather_step, store_rows, store_step.contiguous()

    def layer(self, index: int) -> Callable:
        return lambda k, v: self._assemble(index, k, v)

    def _assemble(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        r, _, d = k.shape
        blk = self.rows.shape[1]
        self.rows.index_copy_(0, self.store_rows[layer, 0].flatten(), k.view(-1, blk, d))
        self.rows.index_copy_(0, self.store_rows[layer, 1].flatten(), v.view(-1, blk, d))
        kv = self.rows.index_select(0, self.gather_rows[layer].flatten()).view(2, r, -1, d)
        return kv[0], kv[1]


class PrefixStep:
    """One solver step of a prefix solve in the `IndexedKV` layout, as a function of tensors
    only (what `GraphedEstimator` captures): x, mu, cond, spks, tau, bias, frame_mask as the
    DiT takes them over the window (context + Q frames), then keep, the rotary tables, and the
    pool rows the step reads and stores (`IndexedKV.pool_rows`)."""

    ALWAYS_COPY = (0, 4, 10, 11)  # x, tau and the step's pool rows change every step

    def __init__(self, dit, cache: PrefixCache):
        self.dit = dit
        self.cache = cache
        self.context = 2 * (dit.cfg.conv_pos_kernel - 1)

    def example_args(self, num_rows: int, prefix: int, queries: int) -> list[torch.Tensor]:
        """Inputs of the shape a solve of `num_rows` requests, prefixes padded to `prefix`
        frames and `queries` query frames gives, to capture its graph before serving: they read
        the zero block and store nothing (into scratch)."""
        cache, dit = self.cache, self.dit
        dev, dtype = cache.device, cache.dtype
        r, w, c = 2 * num_rows, self.context + queries, dit.cfg.mel_dim
        window = torch.zeros(r, w, c, dtype=dtype, device=dev)
        rows = torch.zeros(r, dtype=torch.long, device=dev)
        bias = window_bias(rows, rows + queries, rows == 0, prefix, queries, cache.block, dtype)
        cos, sin = dit.rotary_embed.tables_at(torch.zeros(r, queries, device=dev))
        blocks = (prefix // cache.block, queries // cache.block)
        # block ids on the host, pool rows on the device (the meta device too: bench
        # profile-batch)
        read = torch.full((num_rows, blocks[0]), cache.zero_block)
        moves = IndexedKV.pool_rows(cache, read, torch.full((num_rows, blocks[1]), -1), dev)[::2]
        return [
            window,
            window.clone(),
            window.clone(),
            torch.zeros(r, c, dtype=dtype, device=dev),
            torch.zeros(r, device=dev),
            bias,
            torch.ones(r, queries, 1, dtype=dtype, device=dev),
            torch.ones(r, w, 1, dtype=dtype, device=dev),
            cos,
            sin,
            *moves,
        ]

    def __call__(self, x, mu, cond, spks, tau, bias, frame_mask, keep, cos, sin, gather, store):
        kv = IndexedKV(self.cache.pool(), gather, store)
        ctx = DiTPrefix(self.context, keep, (cos, sin), kv)
        return self.dit(x, mu, cond, spks, tau, bias, frame_mask, prefix=ctx)


def window_bias(prefix, num_queries, streaming, p: int, q: int, block: int, dtype):
    """The attention bias (r, 1, q, p + q) of the `IndexedKV` layout: prefix column c is frame c
    and real below the row's prefix; query column p + j is frame prefix + j and real for j below
    the row's query count; block-causal for streaming rows, as `ragged_attention_bias`."""
    from flow_service.model.dit import bias_from_allowed

    dev = prefix.device
    cols = torch.arange(p + q, device=dev)[None]  # (1, p + q)
    in_prefix = cols < p
    key_pos = torch.where(in_prefix, cols, prefix[:, None] + cols - p)  # (r, p + q)
    real = torch.where(in_prefix, cols < prefix[:, None], cols - p < num_queries[:, None])
    query_pos = prefix[:, None] + torch.arange(q, device=dev)  # (r, q)
    block_end = (query_pos // block + 1) * block
    allowed = (key_pos[:, None, :] < block_end[:, :, None]) | ~streaming[:, None, None]
    return bias_from_allowed(allowed & real[:, None, :], dtype)


def solve_with_prefix(
    model,
    batch,
    plan: PrefixPlan,
    mask_padding=True,
    between_steps=None,
    step=None,
    prefix_multiple: int = 0,
):
    """The Euler/CFG solve of `FlowModel.solve_batch`, computing only each row's frames after
    its cached prefix. Returns (mel (b, q, c) fp32, row i's frame 0 = absolute frame
    prefix_i; per row the (steps, q, c) solver inputs x for the blocks it stores, else None).

    `step`: a `PrefixStep` (or its `GraphedEstimator`) runs each step in the `IndexedKV`
    layout, with the prefix padded to a multiple of `prefix_multiple` frames and the queries
    to whole blocks, so that shapes repeat; else the DiT runs eagerly with `_KVAssembler`."""
    dec = model.decoder
    dit = dec.estimator
    cache = plan.cache
    cache_ctx = 2 * (dit.cfg.conv_pos_kernel - 1)  # the conv position embedding's reach
    b, t = batch.num_rows, batch.num_frames
    dev, dtype = model.device, model.dtype
    mu, spks = model.conditioning(batch)  # (b, t, c), (b, c)
    c = mu.shape[-1]
    prefix = torch.tensor([row.prefix for row in plan.rows])
    # a row's span ends at its sequence length: the host's copy of batch.seq_lens
    num_queries = torch.tensor([stop for _, stop in batch.out_spans]) - prefix
    q_max = int(num_queries.max())
    if step is not None:
        if not mask_padding:
            raise ValueError("mask_padding: the indexed prefix solve always masks padding")
        q_max = query_bucket(-(-q_max // cache.block)) * cache.block
        p_multiple = max(prefix_multiple, cache.block)
        p_max = -(-int(prefix.max()) // p_multiple) * p_multiple
    prefix_d = prefix.to(dev)
    window = prefix_d[:, None] - cache_ctx + torch.arange(cache_ctx + q_max, device=dev)
    gather = window.clamp(0, t - 1)[..., None].expand(-1, -1, c)
    mu_w = mu.gather(1, gather)  # (b, 60 + q, c); frames before 0 are zeroed by `keep`
    cond_w = batch.cond.gather(1, gather)
    keep = (window >= 0).to(dtype)[..., None].repeat(2, 1, 1)  # (r, 60 + q, 1)
    query_pos = prefix_d[:, None] + torch.arange(q_max, device=dev)  # (b, q)
    noise = noise_buffer(dev, model.cfg.max_frames)
    x = noise[query_pos.clamp(max=noise.shape[0] - 1)]  # (b, q, c) fp32, position-locked
    # Solver input x of the context frames, per step: from the cache (zeros before frame 0),
    # stacked in one copy (a row whose prefix covers the context is a view of its entry)
    zeros = torch.zeros(len(dec.steps), cache_ctx, c, dtype=dtype, device=dev)
    context = []
    for row in plan.rows:
        n = min(row.prefix, cache_ctx)
        if n == 0:
            context.append(zeros)
            continue
        tail = row.xs[:, row.prefix - n : row.prefix]
        context.append(tail if n == cache_ctx else torch.cat((zeros[:, n:], tail), 1))
    context_x = torch.stack(context, dim=1)  # (steps, b, 60, c)
    qpos2 = query_pos.repeat(2, 1)
    qn = num_queries.to(dev)
    frame_mask = (torch.arange(q_max, device=dev)[None] < qn[:, None]).to(dtype)
    frame_mask = frame_mask.repeat(2, 1)[..., None]  # (r, q, 1)
    cos, sin = dit.rotary_embed.tables_at(qpos2)
    if step is None:
        bias = dit.attention_mask(
            batch.seq_lens.repeat(2), batch.streaming.repeat(2), t, dtype, qpos2, mask_padding
        )
        kv = _KVAssembler(cache, plan, prefix, num_queries, t, dev)
        ctx = DiTPrefix(cache_ctx, keep, (cos, sin), kv)
    else:
        bias = window_bias(
            prefix_d.repeat(2),
            qn.repeat(2),
            batch.streaming.repeat(2),
            p_max,
            q_max,
            cache.block,
            dtype,
        )
        n_p, n_q = p_max // cache.block, q_max // cache.block
        # block ids per row, padded: past its prefix a row reads the zero block, and its query
        # blocks past those it stores go to scratch (-1)
        z = cache.zero_block
        read = torch.tensor(
            [r.read + [z] * (n_p - len(r.read)) for r in plan.rows], dtype=torch.long
        )
        store = torch.tensor(
            [r.new + [-1] * (n_q - len(r.new)) for r in plan.rows], dtype=torch.long
        )
        gather, gather_step, store, store_step = IndexedKV.pool_rows(cache, read, store, dev)
    mu_in = torch.cat((mu_w, torch.zeros_like(mu_w)))
    cond_in = torch.cat((cond_w, torch.zeros_like(cond_w)))
    spks_in = torch.cat((spks, torch.zeros_like(spks)))
    xs = []

    def velocity(k: int, tau: float, x: torch.Tensor) -> torch.Tensor:
        t_in = torch.full((2 * b,), tau, dtype=torch.float32, device=dev)
        x_q = x.to(dtype)
        xs.append(x_q)
        x_w = torch.cat((context_x[k], x_q), dim=1)  # (b, 60 + q, c)
        x_in = torch.cat((x_w, x_w))
        if step is None:
            kv.step = k
            return dit(x_in, mu_in, cond_in, spks_in, t_in, bias, frame_mask, prefix=ctx)
        args = (keep, cos, sin, gather + k * gather_step, store + k * store_step)
        return step(x_in, mu_in, cond_in, spks_in, t_in, bias, frame_mask, *args)

    x = euler_cfg(x, dec.steps, dec.cfg_rate, velocity, between_steps)
    x_steps = torch.stack(xs)  # (steps, b, q, c)
    new_x = [x_steps[:, i] if row.new else None for i, row in enumerate(plan.rows)]
    return x, new_x
