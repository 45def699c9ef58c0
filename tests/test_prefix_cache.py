"""Prefix cache (issue 17): cached and recomputed mel agree on every path (hit, partial hit,
miss, eviction between calls, prompt blocks shared by a voice, batches mixing cached and
uncached rows), and the bookkeeping (finalize, cancel, failure, bytes) frees what it holds.
CPU, small preset, fp32; one GPU test (marked) for fp32 without TF32 and bf16."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter

import pytest
import torch
from test_flow_model import make_voice

from flow_service.engine import FlowEngine
from flow_service.model import FlowModel, FlowRequest, PrefixCache, Voice, load_flow
from flow_service.scheduler import BatchPolicy
from gateway.schedule import ChunkPlanner

REL = 1e-5  # cached vs recomputed: max |diff| <= REL x max |mel| (fp32)


@pytest.fixture(scope="module")
def model() -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(None, preset="small", seed=0)


def stream_calls(voice: Voice, key: str, num_tokens: int, seed: int) -> list[FlowRequest]:
    """The gateway's calls for one utterance (prompt pad, hops 25.., last call full attention),
    plus a final call with block-causal attention (the proto allows it; it may read the cache)."""
    tokens = torch.randint(0, 6561, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    planner = ChunkPlanner(voice.num_prompt_tokens)
    calls = []
    for ended in (False, True):
        while (c := planner.next_call(num_tokens, ended)) is not None:
            calls.append(
                FlowRequest(
                    voice, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming, key
                )
            )
    last = calls[-1]
    calls.append(dataclasses.replace(last, streaming=True))
    return calls


def new_cache(model: FlowModel, budget_blocks: int = 64, **kw) -> PrefixCache:
    probe = PrefixCache.for_model(model, 0)
    return PrefixCache.for_model(model, budget_blocks * probe.block_bytes, **kw)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        rel = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6)
        assert rel <= REL, f"output {i}: cached vs recomputed {rel:.2e} > {REL:.0e}"


def reference(model: FlowModel, calls: list[FlowRequest]) -> list[torch.Tensor]:
    return [model.generate([c])[0] for c in calls]


def ops_inside(monkeypatch, hook_class):
    """(a Counter, a dispatch mode): under the mode, the ops `hook_class._assemble` dispatches
    (each a kernel launch on a GPU), views excluded; reshape is a view op by schema but counts,
    because it copies where its input is not contiguous."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()
    inside = [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if inside[0] and (not func.is_view or name == "reshape"):
                ops[name] += 1
            return func(*args, **(kwargs or {}))

    assemble = hook_class._assemble

    def counted(self, *args):
        inside[0] = True
        try:
            return assemble(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(hook_class, "_assemble", counted)
    return ops, Count


def test_hits_match_recomputation_and_skip_the_prefix(model):
    voice = make_voice(1, 35)
    calls = stream_calls(voice, "a", 230, seed=1)  # hops 40, 50, 100, then final calls
    want = reference(model, calls)
    cache = new_cache(model)
    got = [model.generate([c], prefix_cache=cache)[0] for c in calls[:-1]]
    assert_close(got, want[:-1])
    # calls 2 and 3 read every block the previous call completed
    assert cache.stats["hits"] == 2 and cache.stats["misses"] == 1
    total = sum(c.num_seq_frames for c in calls[:-1])
    reused = calls[0].num_seq_frames + calls[1].num_seq_frames
    assert cache.stats["reused_frames"] == reused
    assert cache.stats["computed_frames"] == total - reused
    # the final call (full attention) recomputes and drops the stream's entry, not the voice's
    assert cache.num_entries == 1 and cache.used_blocks == 1
    got_final = model.generate([calls[-1]], prefix_cache=cache)[0]  # block-causal final call
    assert_close([got_final], [want[-1]])
    assert cache.stats["voice_hits"] == 1


def test_partial_hits_retry_and_skipped_chunk(model):
    voice = make_voice(2, 35)
    calls = stream_calls(voice, "b", 230, seed=2)
    want = reference(model, calls)
    cache = new_cache(model)
    model.generate([calls[0]], prefix_cache=cache)
    # chunk 2 never came back to this replica: chunk 3 uses what chunk 1 left (3 of 5 blocks)
    got = model.generate([calls[2]], prefix_cache=cache)[0]
    assert_close([got], [want[2]])
    assert cache.stats["reused_frames"] == calls[0].num_seq_frames
    # a retried chunk 2 after chunk 3: the entry reaches past its first frame; only the blocks
    # before that frame are used, and the longer entry stays
    before = cache.used_blocks
    got = model.generate([calls[1]], prefix_cache=cache)[0]
    assert_close([got], [want[1]])
    assert cache.stats["reused_frames"] == calls[0].num_seq_frames + calls[1].out_start_frame
    assert cache.used_blocks == before


@pytest.mark.parametrize("change", ["key", "tokens", "voice"])
def test_mismatch_is_a_miss_never_a_wrong_result(model, change):
    voice = make_voice(3, 35)
    calls = stream_calls(voice, "c", 200, seed=3)
    cache = new_cache(model, share_voice_blocks=False)
    model.generate([calls[0]], prefix_cache=cache)
    second = calls[1]
    if change == "key":
        second = dataclasses.replace(second, cache_key="other")
    elif change == "tokens":  # same key, a different utterance: one early token differs
        tokens = second.tokens.clone()
        tokens[3] = (tokens[3] + 1) % 6561
        second = dataclasses.replace(second, tokens=tokens)
    else:  # same key and tokens, another voice of the same prompt length
        second = dataclasses.replace(second, voice=make_voice(4, 35))
    want = model.generate([second])[0]
    got = model.generate([second], prefix_cache=cache)[0]
    assert_close([got], [want])
    if change == "tokens":
        # token 3 is frame 76 of the sequence: only block 0 (frames 0-49, which read ids up to
        # 27, all prompt) is still valid, and only it is used
        assert cache.stats["hits"] == 1 and cache.stats["reused_frames"] == 50
    else:
        assert cache.stats["hits"] == 0 and cache.stats["misses"] == 2


def test_eviction_between_calls(model):
    voices = [make_voice(5, 35), make_voice(6, 35)]
    streams = [stream_calls(v, f"e{i}", 130, seed=10 + i) for i, v in enumerate(voices)]
    cache = new_cache(model, budget_blocks=5, share_voice_blocks=False)
    for k in range(3):  # interleaved: each stream's entry pushes the other one out
        for calls in streams:
            got = model.generate([calls[k]], prefix_cache=cache)[0]
            assert_close([got], [model.generate([calls[k]])[0]])
            assert cache.used_blocks <= cache.capacity == 5
    assert cache.stats["evictions"] >= 1
    assert cache.stats["misses"] >= 3


def test_prompt_blocks_are_shared_across_streams_of_a_voice(model):
    voice = make_voice(7, 60)  # prompt 120 frames: 2 blocks depend on the prompt alone
    a = stream_calls(voice, "va", 100, seed=20)
    b = stream_calls(voice, "vb", 100, seed=21)
    cache = new_cache(model)
    model.generate([a[0]], prefix_cache=cache)
    got = model.generate([b[0]], prefix_cache=cache)[0]  # first chunk of another stream
    assert_close([got], [model.generate([b[0]])[0]])
    assert cache.stats["voice_hits"] == 1
    assert cache.stats["reused_frames"] == 100
    # first hop 40 (prompt pad 15): 200 frames, 4 blocks per stream, the 2 prompt blocks common
    assert a[0].num_seq_frames == b[0].num_seq_frames == 200
    assert cache.used_blocks == 4 + 4 - 2
    off = new_cache(model, share_voice_blocks=False)
    model.generate([a[0]], prefix_cache=off)
    model.generate([b[0]], prefix_cache=off)
    assert off.stats["voice_hits"] == 0 and off.used_blocks == 8


def test_batch_mixing_cached_and_uncached_rows(model):
    v1, v2 = make_voice(8, 35), make_voice(9, 13)
    s1 = stream_calls(v1, "m1", 230, seed=30)
    s2 = stream_calls(v2, "m2", 120, seed=31)
    cache = new_cache(model)
    model.generate([s1[0], s1[1]], prefix_cache=cache)  # two chunks of one stream, one batch
    batch = [
        s1[2],  # hit
        s2[0],  # first chunk, stores
        s2[-2],  # final, full attention
        dataclasses.replace(s1[1], cache_key=""),  # no key: voice blocks only
        s1[2],  # the same hit twice in one batch
    ]
    got = model.generate(batch, prefix_cache=cache)
    assert_close(got, reference(model, batch))
    assert cache.stats["hits"] >= 2


def test_finalize_cancel_and_failure_free_everything(model):
    voice = make_voice(10, 35)
    calls = stream_calls(voice, "f", 230, seed=40)
    cache = new_cache(model, share_voice_blocks=False)
    model.generate([calls[0]], prefix_cache=cache)
    assert cache.num_entries == 1 and cache.used_blocks == 3
    assert cache.bytes_used == 3 * cache.block_bytes + 150 * cache.frame_x_bytes

    # a solve that fails releases the blocks it pinned and allocated, and stores nothing
    def boom():
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        model.generate([calls[1]], prefix_cache=cache, between_steps=boom)
    assert cache.used_blocks == 3 and cache.num_entries == 1
    # cancellation: the engine drops the stream's entry when its call is cancelled
    engine = FlowEngine(model, BatchPolicy(), prefix_cache=cache)

    async def cancel_one() -> None:
        task = asyncio.ensure_future(engine.submit(calls[1], math.inf))
        await asyncio.sleep(0)  # queued (the scheduling loop is not started)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_one())
    assert cache.num_entries == 0 and cache.used_blocks == 0 and cache.bytes_used == 0
    # finalize drops the entry too
    model.generate(calls[:2], prefix_cache=cache)
    assert cache.num_entries == 1
    model.generate([calls[-2]], prefix_cache=cache)
    assert cache.num_entries == 0 and cache.used_blocks == 0


def test_metrics_hook_and_budget_errors(model):
    seen: dict[str, float] = {}
    cache = new_cache(model, observe=lambda n, v: seen.__setitem__(n, seen.get(n, 0) + v))
    calls = stream_calls(make_voice(11, 35), "g", 130, seed=50)
    model.generate([calls[0]], prefix_cache=cache)
    model.generate([calls[1]], prefix_cache=cache)
    assert seen["hits"] == 1 and seen["misses"] == 1
    assert seen["reused_frames"] == cache.stats["reused_frames"] > 0
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache.for_model(model, -1)
    empty = PrefixCache.for_model(model, 0)  # no room: every call recomputes, nothing breaks
    got = model.generate([calls[1]], prefix_cache=empty)[0]
    assert_close([got], [model.generate([calls[1]])[0]])
    assert empty.used_blocks == 0


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_fp32_and_bf16():
    voice = make_voice(12, 75)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = load_flow(None, preset="cosyvoice3-0.5b", device="cuda", dtype=dtype, seed=0)
        calls = stream_calls(voice, "gpu", 300, seed=60)[:-1]
        cache = PrefixCache.for_model(m, 8 << 30)
        want = [m.generate([c])[0] for c in calls]
        got = [m.generate([c], prefix_cache=cache)[0] for c in calls]
        assert cache.stats["hits"] >= 2
        results[dtype] = (want, got)
        del m, cache
        torch.cuda.empty_cache()
    assert_close(*reversed(results[torch.float32]))
    # bf16: the cached path stays as close to fp32 as bf16 recomputation is (the two bf16
    # paths round differently, so they are compared through their distance to fp32)
    ref32 = results[torch.float32][0]

    def rms(x: torch.Tensor) -> float:
        return float(x.pow(2).mean().sqrt())

    for i, (w, g, r) in enumerate(zip(*results[torch.bfloat16], ref32, strict=True)):
        cached, plain = rms(g - r), rms(w - r)
        assert cached <= 1.1 * plain, f"output {i}: bf16 cached {cached:.3g} vs {plain:.3g} rms"
        cached, plain = float((g - r).abs().max()), float((w - r).abs().max())
        assert cached <= 1.5 * plain, f"output {i}: bf16 cached {cached:.3g} vs {plain:.3g} max"


def test_engine_runs_a_streams_chunks_in_order_so_they_hit(model):
    """The gateway sends several chunks of a stream at once; the engine holds each until the
    earlier ones are done, so every later chunk reads what the previous one stored."""
    calls = stream_calls(make_voice(15, 35), "o", 230, seed=80)[:4]
    want = reference(model, calls)

    async def run() -> tuple[list[torch.Tensor], dict]:
        cache = new_cache(model)
        engine = FlowEngine(model, BatchPolicy(max_wait_ms=50.0), prefix_cache=cache)
        engine.start()
        try:
            results = await asyncio.gather(*(engine.submit(c) for c in calls))  # in seq order
        finally:
            await engine.stop()
        return [r.mel for r in results], cache.stats

    got, ordered = asyncio.run(run())
    assert_close(got, want)
    # chunks 2 and 3 read all of the previous chunk; the final call has full attention
    assert ordered["hits"] == 2 and ordered["misses"] == 1
    assert ordered["reused_frames"] == calls[0].num_seq_frames + calls[1].num_seq_frames


def test_the_engines_estimate_of_a_calls_cached_frames_is_what_the_cache_reads(model):
    """`readable_prefix`, which the engine's scheduler pads by, against `PrefixCache.plan`:
    each call of a stream, once its earlier calls ran, reads exactly that many frames (the
    first chunk the voice's prompt blocks, stored by another stream of the voice; the
    full-attention final call none). The engine gives each call that estimate."""
    from flow_service.model.prefix_cache import readable_prefix

    voice = make_voice(21, 35)
    cache = new_cache(model)
    model.generate([stream_calls(voice, "other", 80, seed=3)[0]], prefix_cache=cache)
    calls = stream_calls(voice, "s", 230, seed=4)
    reads = []
    for c in calls:
        plan = cache.plan([c])
        reads.append(plan.rows[0].prefix)
        cache.release(plan)
        want = readable_prefix(c.out_start_frame, c.num_seq_frames, c.streaming, cache.block)
        assert plan.rows[0].prefix == want, (c.token_offset, c.finalize, c.streaming)
        if not c.finalize:  # a final call would end the stream's entry
            model.generate([c], prefix_cache=cache)
    assert reads[0] > 0 and reads[-2] == 0 and reads[-1] > reads[1] > reads[0]

    async def submitted() -> list[int]:
        engine = FlowEngine(model, BatchPolicy(), prefix_cache=cache)
        got = []
        engine.core.add = got.append  # the queue's view of each call, before it runs
        for c in calls:
            with pytest.raises(asyncio.TimeoutError):  # no loop runs it: only queued
                await asyncio.wait_for(engine._submit_now(c, math.inf, math.inf, 0.0), 0.01)
        return [call.num_cached_frames for call in got]

    assert asyncio.run(submitted()) == reads


@pytest.mark.parametrize("prefix_multiple", [50, 200])
def test_indexed_solve_equals_the_assembled_one(model, prefix_multiple):
    """The graphs' layout (`PrefixStep`: K/V moved by index, [padded prefix | queries], the
    zero block and the scratch), run eagerly here, gives the mel of the eager `_KVAssembler` solve
    and of recomputation, and the cache the same entries: uniform batches of one call index,
    a batch mixing a hit, a first chunk and a final call, one row twice, and a row whose
    6 blocks of queries the graphs' layout pads to 8 (`query_bucket`), and a row of a voice
    with no prompt, whose cached prefix (one block) is shorter than the conv's context."""
    from flow_service.model.prefix_cache import PrefixStep

    streams = [stream_calls(make_voice(50 + i, 35), f"x{i}", 230, seed=130 + i) for i in range(4)]
    bare = stream_calls(make_voice(54, 0), "x4", 150, seed=134)
    batches = [[s[k] for s in streams[:3]] for k in range(3)]
    batches.append([streams[0][3], streams[1][0], streams[2][-2]])
    batches.append([streams[1][1], streams[1][1]])
    batches += [[streams[3][0]], [streams[3][2], streams[0][1]]]  # streams[3][1] skipped
    batches += [[bare[0]], [bare[1], streams[2][3]]]  # bare[1] reads 50 frames
    assembled, indexed = new_cache(model), new_cache(model)
    step = PrefixStep(model.decoder.estimator, indexed)
    for batch in batches:
        want = model.generate(batch, prefix_cache=assembled)
        got = model.generate(
            batch, prefix_cache=indexed, prefix_step=step, prefix_multiple=prefix_multiple
        )
        assert_close(got, want)
        assert_close(got, reference(model, batch))
    assert indexed.stats == assembled.stats and indexed.stats["hits"] >= 6
    assert indexed.used_blocks == assembled.used_blocks
    # the zero block stayed zero: stores of nothing went to the scratch blocks
    assert not indexed.pool()[:, :, :, indexed.zero_block].any()
    assert indexed.pool()[:, :, :, indexed.zero_block + 1 :].any()


def test_padded_rows_read_their_model_row_and_store_nothing(model):
    """A graphed batch is padded with copies of its last request, and the plan with copies
    of its last row (`PrefixPlan.pad`): the real rows' mel is unchanged, the copies pin what
    they read and release it, and the cache ends as it would without them."""
    from flow_service.model.prefix_cache import PrefixStep

    a = stream_calls(make_voice(60, 35), "pa", 230, seed=140)
    b = stream_calls(make_voice(61, 13), "pb", 230, seed=141)
    plain, padded = new_cache(model), new_cache(model)
    step = PrefixStep(model.decoder.estimator, padded)
    for k in range(3):
        batch = [a[k], b[k]]
        want = model.generate(batch, prefix_cache=plain)
        plan = padded.plan(batch)
        plan.pad(4)
        assert len(plan.rows) == 4 and plan.rows[3].read == plan.rows[1].read
        assert not plan.rows[3].new and plan.rows[3].key is None
        got = model.generate(batch + [b[k]] * 2, prefix_cache=padded, plan=plan, prefix_step=step)
        assert_close(got[:2], want)
        assert_close(got[2:], want[1:] * 2)
    assert padded.stats == plain.stats
    assert padded.used_blocks == plain.used_blocks
    assert any(padded._refs)  # the entries still hold their blocks
    padded.clear()
    assert padded.used_blocks == 0 and not any(padded._refs)


@pytest.mark.parametrize(
    "sliced, slices, layers",
    [
        (True, True, 3),
        pytest.param(True, True, 1, marks=pytest.mark.slow),
        pytest.param(True, False, 2, marks=pytest.mark.slow),
        (False, True, 2),
        pytest.param(False, False, 1, marks=pytest.mark.slow),
    ],
)
def test_kv_assembly_paths_agree(model, monkeypatch, sliced, slices, layers):
    """Every way the solve assembles keys/values gives the same bits: new frames by a slice
    copy per run of rows sharing prefix and query count, or by index copy; pool <-> buffer moves as
    strided copies (evenly spaced block ids) or index_select / index_copy_, per run of rows;
    the buffer holding all 3 layers of the small preset, or groups of 1 or 2 (the last group
    shorter)."""
    import flow_service.model.prefix_cache as pc

    made = []
    init = pc._KVAssembler.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(pc._KVAssembler, "__init__", spy)
    streams = [stream_calls(make_voice(20 + i, 35), f"u{i}", 230, seed=100 + i) for i in range(3)]
    batches = [[s[k] for s in streams] for k in range(3)]  # call k of 3 streams: uniform rows
    batches.append([streams[0][3], streams[1][0], streams[2][3]])  # 3 runs: index copy
    batches.append([streams[1][1], streams[1][1], streams[1][0]])  # 2 runs

    def run() -> list[torch.Tensor]:
        cache = new_cache(model, share_voice_blocks=False)
        out = []
        for batch in batches:
            rows, t = 2 * len(batch), max(c.num_seq_frames for c in batch)
            per_layer = 2 * rows * t * model.cfg.dit.dim * 4  # K and V, fp32
            monkeypatch.setattr(pc, "KV_BUFFER_BYTES", layers * per_layer)
            out += model.generate(batch, prefix_cache=cache)
        assert cache.stats["hits"] >= 6
        return out

    default = run()
    made.clear()
    monkeypatch.setattr(pc._KVAssembler, "allow_slice_new", sliced)
    monkeypatch.setattr(pc._KVAssembler, "allow_slice_moves", slices)
    got = run()
    assert all(torch.equal(g, w) for g, w in zip(got, default, strict=True))
    assert_close(got, reference(model, [c for batch in batches for c in batch]))
    assert [a.group for a in made] == [layers] * len(batches)
    assert [a.sliced for a in made] == [sliced] * 3 + [False, sliced]
    assert [len(a.runs) for a in made if a.sliced] == ([1, 1, 1, 2] if sliced else [])
    moves = [m for a in made for m in a.reads + a.stores]
    assert moves and any(isinstance(sel, slice) for sel, _ in moves) == slices


def test_a_rows_store_never_evicts_what_a_later_row_of_the_batch_reads(model):
    """Every row's prefix is pinned before any row allocates: with the pool full, the first
    row of a batch gets no new blocks rather than evicting the second row's entry."""
    a = stream_calls(make_voice(30, 35), "pa", 230, seed=110)
    b = stream_calls(make_voice(31, 35), "pb", 230, seed=111)
    cache = new_cache(model, budget_blocks=6, share_voice_blocks=False)
    model.generate([a[0]], prefix_cache=cache)
    model.generate([b[0]], prefix_cache=cache)
    assert cache.used_blocks == cache.capacity == 6  # 3 blocks each
    got = model.generate([a[1], b[1]], prefix_cache=cache)
    assert_close(got, reference(model, [a[1], b[1]]))
    assert cache.stats["hits"] == 2 and cache.stats["evictions"] == 0
    assert cache.stats["reused_frames"] == a[0].num_seq_frames + b[0].num_seq_frames


def test_uniform_batch_kv_hook_launches(model, monkeypatch):
    """The ops (kernel launches on a GPU) the K/V hook dispatches for a batch of streams at the
    same call: per step, one copy per layer for K and one for V (the new frames), one per block
    column of the prefix for all layers at once, one per stored block column. Views excluded.
    Before the per-group assembly it was 12 index_select / index_copy_ per layer and step."""
    import flow_service.model.prefix_cache as pc

    ops, Count = ops_inside(monkeypatch, pc._KVAssembler)
    streams = [stream_calls(make_voice(40 + i, 35), f"k{i}", 230, seed=120 + i) for i in range(2)]
    cache = new_cache(model, share_voice_blocks=False)
    model.generate([s[0] for s in streams], prefix_cache=cache)
    with Count():
        model.generate([s[1] for s in streams], prefix_cache=cache)
    prefix_blocks = streams[0][0].num_seq_frames // cache.block
    new_blocks = streams[0][1].num_seq_frames // cache.block - prefix_blocks
    assert prefix_blocks == 3 and new_blocks == 2
    per_step = 2 * cache.depth + prefix_blocks + new_blocks
    assert ops == {"copy_": cache.num_steps * per_step}


def test_runner_graphs_small_work_and_runs_large_work_eagerly_with_the_cache(model):
    """--graph-max-frames: a batch whose rows x longest sequence passes the bound leaves the
    graphs for the eager path (unpadded, prefix cache); 0 keeps every batch up to
    --graph-max-batch rows graphed; more rows than that are eager whatever the work."""
    from flow_service.runner import FlowRunner

    calls = stream_calls(make_voice(5, 20), "w", 120, seed=5)  # 40, 60, 100 ... frames
    runner = FlowRunner(model, graph_max_batch=4, graph_max_frames=200)
    assert not runner.graphed(calls[:1])  # no graphs on the CPU
    runner.graphs = object()  # decision only: what a CUDA runner would do
    sizes = [c.num_seq_frames for c in calls]
    for n in (1, 2, 4, 5):
        for c in calls:
            batch = [c] * n
            want = n <= 4 and n * c.num_seq_frames <= 200
            assert runner.graphed(batch) == want, (n, c.num_seq_frames, sizes)
    runner.graph_max_frames = 0
    assert runner.graphed([calls[-1]] * 4) and not runner.graphed([calls[-1]] * 5)
    # with the cache's plan, the work is what the rows compute after their cached prefix
    runner.prefix_graphs = object()
    cache = new_cache(model)
    model.generate(calls[:1], prefix_cache=cache)
    batch = [calls[1]] * 4
    plan = cache.plan(batch)
    assert plan.rows[0].prefix > 0
    runner.graph_max_frames = 4 * (calls[1].num_seq_frames - plan.rows[0].prefix // 2)
    assert runner.graphed(batch, plan) and not runner.graphed(batch)
    runner.graph_max_frames -= 1
    assert not runner.graphed(batch, plan)
    cache.release(plan)
    runner.executor.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("no_tf32")
def test_gpu_runner_graphs_over_the_cache(dtype):
    """Before/after for graphs over the prefix cache: the same calls of three streams, batched
    together (3 rows, padded to 4), through graphs without the cache (every call recomputes its
    prefix), eagerly with the cache, and through the prefix graphs. fp32 (TF32 off): all
    within 1e-5 of each other. bf16: the prefix graphs as close to the fp32 run as bf16 graphs
    without the cache are."""
    from flow_service.runner import FlowRunner

    m = load_flow(None, preset="cosyvoice3-0.5b", device="cuda", dtype=dtype, seed=0)
    streams = [
        stream_calls(make_voice(20 + i, 75), f"g{i}", 300, seed=70 + i)[:-1] for i in range(3)
    ]
    outputs = {}
    for name, budget, bound in (("graphs", 0, 0), ("eager", 8 << 30, 1), ("both", 8 << 30, 0)):
        cache = PrefixCache.for_model(m, budget) if budget else None
        runner = FlowRunner(m, prefix_cache=cache, graph_max_batch=8, graph_max_frames=bound)
        outs, paths = [], []
        for batch in zip(*streams, strict=True):
            outs += [o.cpu() for o in runner.generate(list(batch))]
            paths.append(runner.last_path.split(",")[0])
        outputs[name] = outs
        if cache is not None:
            assert cache.stats["hits"] >= 6
        # with a cache every batch but the last reads or writes it; the last holds the
        # streams' full-attention final calls, which read none
        uses = [p.endswith("+prefix") for p in paths]
        assert uses == [cache is not None] * (len(paths) - 1) + [False], paths
        assert all(p.startswith("eager" if name == "eager" else "graph") for p in paths[1:])
        if name == "both":
            assert len(runner.prefix_graphs) >= 2  # the later calls replayed prefix graphs
            assert paths[-2] == "graph+prefix", paths
        runner.close()
        del runner, cache
        torch.cuda.empty_cache()
    if dtype == torch.float32:
        assert_close(outputs["eager"], outputs["graphs"])
        assert_close(outputs["both"], outputs["graphs"])
        torch.save(outputs["graphs"], "/tmp/prefix_graphs_fp32.pt")
        return
    ref32 = torch.load("/tmp/prefix_graphs_fp32.pt")  # the fp32 case runs first
    for i, (g, w, r) in enumerate(zip(outputs["both"], outputs["graphs"], ref32, strict=True)):
        cached, plain = float((g - r).pow(2).mean().sqrt()), float((w - r).pow(2).mean().sqrt())
        assert cached <= 1.1 * plain, f"output {i}: bf16 cached {cached:.3g} vs {plain:.3g} rms"


def test_graph_max_frames_flag():
    from flow_service.config import FlowConfig, build_parser

    parser = build_parser()
    assert FlowConfig.from_args(parser.parse_args([])).graph_max_frames == 12288
    cfg = FlowConfig.from_args(parser.parse_args(["--graph-max-frames", "0"]))
    assert cfg.graph_max_frames == 0
    with pytest.raises(ValueError, match="--graph-max-frames: -1, want >= 0"):
        FlowConfig.from_args(parser.parse_args(["--graph-max-frames", "-1"]))
    assert "--graph-max-frames" in parser.format_help()


def test_indexed_kv_ops_per_layer(model, monkeypatch):
    """What a prefix graph runs per layer and step to move keys/values (each op a kernel on a
    GPU, and the per-step kernel count is what bounds a small graphed solve): the queries'
    keys and values stored by block (two scatters), then one gather of [prefix | queries].
    The pool rows come in precomputed: no index arithmetic per layer."""
    import flow_service.model.prefix_cache as pc

    ops, Count = ops_inside(monkeypatch, pc.IndexedKV)
    streams = [stream_calls(make_voice(70 + i, 35), f"n{i}", 230, seed=150 + i) for i in range(2)]
    cache = new_cache(model, share_voice_blocks=False)
    step = pc.PrefixStep(model.decoder.estimator, cache)
    model.generate([s[0] for s in streams], prefix_cache=cache, prefix_step=step)
    with Count():
        model.generate([s[1] for s in streams], prefix_cache=cache, prefix_step=step)
    assert cache.stats["hits"] == 2
    per_step = {"index_copy_": 2, "index_select": 1}
    want = {name: n * cache.num_steps * cache.depth for name, n in per_step.items()}
    assert dict(ops) == want, dict(ops)


def test_indexed_kv_takes_strided_keys_and_bounds_its_scratch(model):
    """Keys/values that are column slices of one projection (a fused q/k/v GEMM's output)
    move as contiguous ones do; a solve storing nothing of more query blocks than the scratch
    holds is refused, and the runner runs such a batch eagerly instead."""
    from flow_service.model.prefix_cache import IndexedKV
    from flow_service.runner import FlowRunner

    cache = new_cache(model)
    blk, d, b = cache.block, cache.dim, 2
    read = torch.tensor([[0, cache.zero_block], [1, 2]])
    store = torch.tensor([[3, -1], [-1, -1]])
    qkv = torch.randn(2 * b, 2 * blk, 3 * d)
    got = []
    for k, v in (
        (qkv[..., d : 2 * d], qkv[..., 2 * d :]),
        (qkv[..., d : 2 * d].clone(), qkv[..., 2 * d :].clone()),
    ):
        pool = cache.pool()
        pool[:, :, :, :3] = 1.0
        gather, _, stored, _ = IndexedKV.pool_rows(cache, read, store)
        got.append(IndexedKV(pool, gather, stored).layer(1)(k, v))
    for a, c in zip(got[0], got[1]):
        assert torch.equal(a, c)
    assert torch.equal(got[0][0][:, 2 * blk :], qkv[..., d : 2 * d])  # queries read back
    assert torch.equal(got[0][1][:b, :blk], torch.ones(b, blk, d))  # row 0's cached block 0

    too_many = torch.full((cache.scratch_query_blocks + 1, 1), -1)
    with pytest.raises(ValueError, match="past the scratch"):
        IndexedKV.pool_rows(cache, torch.zeros_like(too_many), too_many)

    runner = FlowRunner(model, cache, cuda_graphs=False)
    runner.graphs = runner.prefix_graphs = object()  # graph bookkeeping only: nothing replays
    streams = [stream_calls(make_voice(80, 35), "s0", 230, seed=160)]
    model.generate([streams[0][0]], prefix_cache=cache)
    plan = cache.plan([streams[0][1]])
    assert plan.active and runner.graphed([streams[0][1]], plan)
    cache.scratch_query_blocks = 0
    assert not runner.graphed([streams[0][1]], plan)
    cache.release(plan)


def test_warm_up_captures_the_prefix_graph_shapes_of_the_upstream_schedule(model):
    """What a graph replays is keyed by its inputs' shapes. The warm-up's shapes
    (`FlowRunner.prefix_graph_shapes`, through `PrefixStep.example_args`) are those a stream's
    calls give under upstream's schedule and as block calls: a first chunk over its voice's
    shared prompt blocks, the later chunks, the 25-token blocks, with prefixes up to 800
    frames. Shapes met first inside a batch cost a capture there (~0.1 s on a GPU each, paid
    by a burst of new streams). Each call's shape is also the one `prefix_graph_key` names,
    the key by which bench/simulate.py counts captures."""
    from flow_service.config import FlowConfig
    from flow_service.model.prefix_cache import PrefixStep
    from flow_service.runner import GRAPH_PREFIX_MULTIPLE, FlowRunner, prefix_graph_key
    from gateway.schedule import BlockPlanner

    cache = new_cache(model, 256)
    step = PrefixStep(model.decoder.estimator, cache)
    met: set = set()

    def shape_of(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype) for a in args)

    def recording(*args):
        met.add(shape_of(args))
        return step(*args)

    def solve(call):
        plan = cache.plan([call])
        prefix = plan.rows[0].prefix
        cache.release(plan)
        before = set(met)
        model.generate(
            [call], prefix_cache=cache, prefix_step=recording, prefix_multiple=GRAPH_PREFIX_MULTIPLE
        )
        if prefix:  # the call read the cache, through the prefix step
            key = prefix_graph_key(1, prefix, call.num_seq_frames - prefix, cache.block)
            assert met - before <= {shape_of(step.example_args(*key))}

    for n_p in (75, 35):  # prompt pads 0 and 15
        voice = make_voice(50, n_p)
        solve(stream_calls(voice, f"first-{n_p}", 300, seed=0)[0])  # the voice's first stream
        met.clear()  # stores its prompt blocks: the first chunk of a voice never seen differs
        for call in stream_calls(voice, f"chunks-{n_p}", 400, seed=1)[:-2]:  # streaming calls
            solve(call)
        skipping = stream_calls(voice, f"skip-{n_p}", 400, seed=3)
        for call in (skipping[0], skipping[2]):  # its second chunk's blocks are not cached:
            solve(call)  # the third computes 6 blocks, padded to 8 (`query_bucket`)
        tokens = stream_calls(voice, "t", 400, seed=2)[-3].tokens
        blocks = BlockPlanner(n_p)
        for arrived in range(1, 300):  # tokens one at a time: a call per block
            while (c := blocks.next_call(arrived)) is not None:
                solve(FlowRequest(voice, tokens[: c.num_tokens], c.token_offset, False, True, "b"))
    runner = FlowRunner(model, prefix_cache=cache, graph_max_frames=FlowConfig.graph_max_frames)
    shapes = runner.prefix_graph_shapes()
    captured = {shape_of(step.example_args(*s)) for s in shapes if s[0] == 1}
    assert len(met) >= 6 and met <= captured


def test_warm_up_holds_the_key_of_every_graphed_prefix_batch_it_covers():
    """Any batch `FlowRunner.graphed` sends to prefix graphs, with prefixes and query runs
    within the warm-up's range, replays a graph the warm-up captured: its key's longest query
    run and longest prefix may be different rows', and its rows fewer than its bucket's."""
    import random

    from flow_service.config import FlowConfig
    from flow_service.model.prefix_cache import query_bucket, scratch_query_blocks
    from flow_service.runner import (
        WARMUP_MAX_FRAMES,
        WARMUP_MAX_PREFIX,
        graph_fits,
        graph_rows,
        prefix_graph_key,
        prefix_graph_shapes,
    )

    block, bound, max_rows = 50, FlowConfig.graph_max_frames, FlowConfig.graph_max_batch
    scratch = scratch_query_blocks(10, 22)
    shapes = set(prefix_graph_shapes(max_rows, bound, block, scratch))
    rng = random.Random(0)
    graphed = 0
    for i in range(20000):
        n = rng.randint(1, max_rows)
        prefixes = [block * rng.randint(0, WARMUP_MAX_PREFIX // block) for _ in range(n)]
        queries = [block * rng.randint(1, WARMUP_MAX_FRAMES // block) for _ in range(n)]
        if i % 2 and n > 1:  # the longest prefix and the longest queries in different rows
            prefixes[1:], queries[0] = [0] * (n - 1), block
            queries[2:] = [block] * (n - 2)
        longest = max(p + q - p // 2 for p, q in zip(prefixes, queries, strict=True))
        q_blocks = graph_rows(n) * query_bucket(max(queries) // block)
        if graph_fits(n, longest, max_rows, bound) and q_blocks <= scratch:
            graphed += 1
            assert prefix_graph_key(n, max(prefixes), max(queries), block) in shapes
    assert graphed > 500
