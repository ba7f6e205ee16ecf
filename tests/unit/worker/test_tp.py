"""Tensor parallelism: sharded models compute the unsharded logits, and TP-2 decodes exactly like TP-1.

The in-process tests run each rank in a thread with a summing barrier in place of
``torch.distributed``; the others start real ranks (child processes, gloo), a few seconds each.
"""

import copy
import dataclasses
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.worker.engine.engine import DLMEngine
from services.worker.engine.request import EngineError, RequestState
from services.worker.model.dlm import DLMConfig
from services.worker.model.parallel import ShardingError, check_divisible, shard_model
from services.worker.parallel.build import make_engine
from services.worker.parallel.tp_engine import TensorParallelEngine, TensorParallelError
from shared.messages.base import CacheMode, StepKind
from shared.tasks import Split, TaskGenerator

from .conftest import tiny_model

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "dls-tiny"
SPAWN_TIMEOUT_S = 180  # tests that start rank processes fail instead of hanging
spawns_ranks = pytest.mark.timeout(SPAWN_TIMEOUT_S)


# --- in-process: ranks as threads -----------------------------------------------------------------


class ThreadAllReduce:
    """``dist.all_reduce`` for ``degree`` threads: every thread gets the sum, added in rank order."""

    def __init__(self, degree: int) -> None:
        self._barrier = threading.Barrier(degree, timeout=30)
        self._parts: list[torch.Tensor | None] = [None] * degree

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._barrier.wait()
            total = self._parts[0].clone()
            for part in self._parts[1:]:
                total += part
            self._barrier.wait()  # nobody overwrites a part before everyone has read it
            tensor.copy_(total)

        return all_reduce


def thread_shards(model, degree: int):
    reduce = ThreadAllReduce(degree)
    return [shard_model(copy.deepcopy(model), rank, degree, reduce.for_rank(rank)) for rank in range(degree)]


def on_threads(functions):
    with ThreadPoolExecutor(len(functions)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in functions]]


GQA_CASES = [(4, 2), (2, 2), (4, 4), (1, 1)]  # (n_kv_heads, degree) with n_heads = 4


@pytest.mark.parametrize(("n_kv_heads", "degree"), GQA_CASES)
def test_thread_shards_compute_the_unsharded_logits(n_kv_heads, degree):
    model = tiny_model(seed=1, n_kv_heads=n_kv_heads, qkv_bias=True, logits_shift=1)
    ids = torch.tensor([[0, 0, 5, 6, 7, 1, 1, 9], [3, 4, 5, 6, 7, 8, 1, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]).bool()
    shards = thread_shards(model, degree)
    assert shards[0].model.transformer.blocks[0].k_proj.weight.shape[0] == n_kv_heads // degree * 8
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        outs = on_threads([lambda s=s: s(ids, attention_mask=mask).logits for s in shards])
    for out in outs:
        torch.testing.assert_close(out[mask], expected[mask], atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", [CacheMode.NONE, CacheMode.PREFIX, CacheMode.DUAL])
def test_thread_shard_engines_decode_like_one_engine_with_gqa(mode):
    model = tiny_model(seed=2, n_kv_heads=2, qkv_bias=True)
    full = DLMEngine(model, stop_at_eos=False)
    ranks = [DLMEngine(shard, stop_at_eos=False) for shard in thread_shards(model, 2)]
    specs = [([5, 6, 7, 8], 16, 8, 0.9), (list(range(3, 20)), 12, 4, 0.5), ([9, 4], 8, 8, 0.7)]
    states = [full.new_request(f"r{i}", p, g, b, mode) for i, (p, g, b, _) in enumerate(specs)]
    rank_states = [copy.deepcopy(states) for _ in ranks]
    taus = [t for *_, t in specs]
    while not all(s.finished for s in states):
        live = [i for i, s in enumerate(states) if not s.finished]
        expected = full.step([(states[i], taus[i]) for i in live])
        got = on_threads([lambda e=e, ss=ss, live=live: e.step([(ss[i], taus[i]) for i in live])
                          for e, ss in zip(ranks, rank_states, strict=True)])
        for results in got:
            assert [_commits(r) for r in results] == [_commits(r) for r in expected]
    for ss in rank_states:
        assert [s.canvas for s in ss] == [s.canvas for s in states]


def _commits(result):
    return (result.request_id, result.kind, result.block_index, result.committed_positions,
            result.committed_token_ids, result.finished, result.num_steps, result.num_masked)


def test_check_divisible_names_what_does_not_divide():
    check_divisible(DLMConfig(n_heads=6, n_kv_heads=6, mlp_hidden_size=512), 2)
    with pytest.raises(ShardingError, match=r"n_kv_heads=3") as info:
        check_divisible(DLMConfig(n_heads=6, n_kv_heads=3, mlp_hidden_size=512), 2)
    assert "n_heads=" not in str(info.value)
    with pytest.raises(ShardingError, match=r"not divisible: n_heads=6, n_kv_heads=6$"):
        check_divisible(DLMConfig(n_heads=6, mlp_hidden_size=512), 4)
    with pytest.raises(ShardingError, match="mlp_hidden_size=513"):
        check_divisible(DLMConfig(n_heads=6, mlp_hidden_size=513), 2)


def test_degree_not_dividing_the_heads_fails_before_starting_ranks():
    with pytest.raises(ShardingError, match="n_heads=6"):
        TensorParallelEngine(MODEL_DIR, 4)
    with pytest.raises(ShardingError, match="n_heads=6"):
        make_engine(MODEL_DIR, tp=4)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_make_engine_with_tp_1_is_a_plain_engine():
    engine = make_engine(MODEL_DIR, tp=1)
    assert type(engine) is DLMEngine
    assert engine.generate("347+589=", threshold=0.9).text == "936"
    with pytest.raises(ShardingError, match="at least 1"):
        make_engine(MODEL_DIR, tp=0)


# --- real ranks: child processes over gloo --------------------------------------------------------


def _problems():
    return TaskGenerator(seed=7).problems(6, 8, split=Split.HELD_OUT)


def _copy(state: RequestState) -> RequestState:
    """A fresh state object, as a worker gets from the state store."""
    return dataclasses.replace(state, prompt_ids=list(state.prompt_ids), canvas=list(state.canvas))


def _lockstep(reference, engine, pairs):
    """Step both engines until done; ``pairs``: (reference state, engine state, threshold). Returns step count."""
    num_steps = 0
    while True:
        live = [p for p in pairs if not p[0].finished]
        if not live:
            return num_steps
        expected = reference.step([(a, tau) for a, _, tau in live])
        got = engine.step([(b, tau) for _, b, tau in live])
        assert [_commits(r) for r in got] == [_commits(r) for r in expected], f"step {num_steps}"
        for g, e in zip(got, expected, strict=True):
            assert dataclasses.astuple(g.confidence) == pytest.approx(dataclasses.astuple(e.confidence), abs=1e-4)
        num_steps += 1


@pytest.fixture(scope="module")
def tp1():
    return DLMEngine.from_pretrained(MODEL_DIR)


@spawns_ranks
class TestTwoRanksMatchOne:
    @pytest.fixture(scope="class")
    @classmethod
    def tp2(cls):
        engine = TensorParallelEngine(MODEL_DIR, 2, verify=True)  # verify: all ranks commit the same
        yield engine
        engine.close()

    def test_batched_generation_commits_the_same_tokens_at_the_same_steps(self, tp1, tp2):
        pairs = []
        for tau in (0.9, 0.6):
            for mode in (CacheMode.NONE, CacheMode.DUAL):
                for i, problem in enumerate(_problems()):
                    a = tp1.new_request(f"{tau}-{mode}-{i}", tp1.encode(problem.prompt), cache_mode=mode)
                    pairs.append((a, _copy(a), tau))
        _lockstep(tp1, tp2, pairs)
        assert all(b.finished and b.canvas == a.canvas and b.num_steps == a.num_steps for a, b, _ in pairs)
        steps = {tau: sum(a.num_steps for a, _, t in pairs if t == tau) for tau in (0.9, 0.6)}
        assert steps[0.6] < steps[0.9]  # the thresholds really changed how many tokens a step commits
        assert not any(tp2.has_cache(b.request_id) for _, b, _ in pairs)

    def test_migrated_request_continues_identically(self, tp1, tp2):
        other = DLMEngine.from_pretrained(MODEL_DIR)  # the instance the request visits in between
        prompt = tp1.encode(_problems()[0].prompt)  # an answer of coupled words: about 11 steps at 0.95
        a = tp1.new_request("moving", prompt, cache_mode=CacheMode.DUAL)
        b = _copy(a)
        for _ in range(3):
            (ra,), (rb,) = tp1.step([(a, 0.95)]), tp2.step([(b, 0.95)])
            assert _commits(ra) == _commits(rb)
        assert tp2.has_cache("moving")
        tp1.drop("moving")
        tp2.drop("moving")
        visiting = _copy(b)
        for _ in range(2):
            other.step([(visiting, 0.95)])
        assert not visiting.finished
        a, b = _copy(visiting), _copy(visiting)  # back again, as loaded from the state store
        assert tp2.next_step_kind(b) is StepKind.RECOMPUTE
        _lockstep(tp1, tp2, [(a, b, 0.95)])
        assert b.finished and b.canvas == a.canvas and b.num_steps == a.num_steps

    def test_sharded_logits_match_the_unsharded_model(self, tp1, tp2):
        rows = [tp1.encode(p.prompt)[-40:] for p in _problems()[:2]]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]).bool()
        with torch.no_grad():
            expected = tp1.model(ids, attention_mask=mask).logits
        got = tp2.forward_logits(ids, mask)
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=0)

    def test_a_bad_request_is_refused_and_the_engine_stays_usable(self, tp1, tp2):
        state = tp2.new_request("bad", tp2.encode("347+589="))
        with pytest.raises(EngineError, match="threshold"):
            tp2.step([(state, 1.5)])
        tp2.run_to_completion([(state, 0.9)])
        assert tp2.decode(state.canvas) == "936"
        assert tp2.generate("347+589=", threshold=0.9).text == "936"
        same = ("mask_id", "eos_id", "name", "default_gen_length", "default_block_length", "stop_at_eos")
        assert [getattr(tp2, a) for a in same] == [getattr(tp1, a) for a in same]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@spawns_ranks
def test_idle_ranks_outlive_the_timeout_and_close_leaves_no_process_and_no_group():
    engine = TensorParallelEngine(MODEL_DIR, 2, timeout_s=2.0)
    state = engine.new_request("r", engine.encode("12+30="))
    engine.step([(state, 0.9)])
    time.sleep(4.0)  # idle for longer than the process group's timeout: the ranks wait at their doorbells
    engine.step([(engine.new_request("r2", engine.encode("12+30=")), 0.9)])
    pids = [p.pid for p in engine.processes]
    engine.close()
    assert all(_gone(pid) for pid in pids)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="closed"):
        engine.step([(state, 0.9)])
    engine.close()  # idempotent


@spawns_ranks
def test_a_dead_rank_makes_the_next_call_fail_clearly():
    with TensorParallelEngine(MODEL_DIR, 2) as engine:
        state = engine.new_request("r", engine.encode("12+30="))
        engine.step([(state, 0.9)])
        (child,) = engine.processes
        child.kill()
        child.join(10)
        state = engine.new_request("r2", engine.encode("12+30="))
        with pytest.raises(TensorParallelError, match=r"rank 1 exited with code -9"):
            engine.step([(state, 0.9)])
        with pytest.raises(TensorParallelError, match="unusable"):
            engine.step([(state, 0.9)])
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@spawns_ranks
def test_two_gpus_decode_like_one():
    gpu1 = make_engine(MODEL_DIR, tp=1, device="cuda")
    with make_engine(MODEL_DIR, tp=2, device="cuda", verify=True) as tp2:
        pairs = []
        for i, problem in enumerate(_problems()):
            a = gpu1.new_request(f"r{i}", gpu1.encode(problem.prompt), cache_mode=CacheMode.DUAL)
            pairs.append((a, _copy(a), 0.9))
        _lockstep(gpu1, tp2, pairs)

