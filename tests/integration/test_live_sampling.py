"""Sampling, logprobs and stop strings through the real scheduler and workers (real NATS and Redis):
a seeded sampled request gets the engine's own draws on any instance and after a migration, its
answer carries what each token was committed with, and a stop string ends it (streams included)."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.worker.decoding.sampling import SamplingParams
from services.worker.engine.engine import CacheMode
from shared.messages.events import RequestFinished, RequestProgress
from shared.tasks import Family, Split, TaskGenerator
from tests.integration.live import H100_PROFILE, LiveCluster, engine, fresh_engine

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 1.3, "top_p": 0.95, "top_k": 8}


def prompts(count: int, seed: int = 17) -> list[list[int]]:
    return [engine().encode(p.prompt) for p in TaskGenerator(seed=seed).problems(count, max_shots=2,
                                                                                  split=Split.HELD_OUT)]


def offline(prompt_ids: list[int], thresholds: list[float], seed: int | None, request_id: str = "offline",
            **sampling) -> list[int]:
    """The engine alone, stepping at these thresholds with this sampling (gen 16, blocks of 8, no cache)."""
    e = fresh_engine()
    params = SamplingParams(sampling.get("temperature", 0.0), sampling.get("top_p", 1.0), sampling.get("top_k", 0),
                            seed)
    state = e.new_request(request_id, prompt_ids, 16, 8, CacheMode.NONE, sampling=params)
    for tau in thresholds:
        if state.finished:  # greedy draws may stop at an earlier EOS block than the sampled run did
            break
        e.step([(state, tau)])
    assert state.finished
    return e.answer(state).token_ids


def test_seeded_samples_are_the_engines_draws_on_any_instance(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=2)
        try:
            batch = prompts(8)
            seeded = await asyncio.gather(*[cluster.submit(p, seed=100 + i, **SAMPLING) for i, p in enumerate(batch)])
            again = await asyncio.gather(*[cluster.submit(p, seed=100 + i, **SAMPLING) for i, p in enumerate(batch)])
            unseeded = await cluster.submit(batch[0], **SAMPLING)
            for i, (prompt, first, second) in enumerate(zip(batch, seeded, again, strict=True)):
                assert isinstance(first.final, RequestFinished) and isinstance(second.final, RequestFinished)
                expected = offline(prompt, first.final.usage.thresholds, 100 + i, **SAMPLING)
                assert first.final.token_ids == expected == second.final.token_ids
            greedy = [offline(p, s.final.usage.thresholds, None) for p, s in zip(batch, seeded, strict=True)]
            assert any(s.final.token_ids != g for s, g in zip(seeded, greedy, strict=True))  # it did sample
            # no seed: the request id keys the noise
            assert unseeded.final.token_ids == offline(batch[0], unseeded.final.usage.thresholds, None,
                                                       request_id=unseeded.request_id, **SAMPLING)
            assert len({iid for o in seeded for iid in o.final.usage.instance_ids}) == 2
        finally:
            await cluster.close()

    asyncio.run(main())


def test_a_migrated_sampled_request_keeps_its_draws(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1, pace_profile=H100_PROFILE)
        first = next(iter(cluster.workers.values()))
        moved = asyncio.Event()

        async def on_event(event):
            if isinstance(event, RequestProgress) and not moved.is_set():
                moved.set()
                await cluster.add_worker(pace_profile=H100_PROFILE)
                first.drain()

        try:
            prompt = prompts(1, seed=23)[0]
            outcome = await cluster.submit(prompt, stream=True, on_event=on_event, seed=5, **SAMPLING)
            final = outcome.final
            assert isinstance(final, RequestFinished), final
            assert final.usage.num_migrations >= 1
            assert final.token_ids == offline(prompt, final.usage.thresholds, 5, **SAMPLING)
        finally:
            await cluster.close()

    asyncio.run(main())


def test_logprobs_and_stop_strings_in_answers_and_streams(nats_server, redis_server, unique_prefix):
    async def main():
        cluster = LiveCluster(nats_server.url, redis_server.url, unique_prefix, policy="fixed")
        await cluster.start(num_workers=1)
        try:
            prompt = engine().encode(TaskGenerator(seed=29).problem(1, Split.HELD_OUT, Family.WORDS).prompt)
            plain = (await cluster.submit(prompt, gen_length=32, logprobs=3)).final
            assert isinstance(plain, RequestFinished) and len(plain.text) >= 3, plain
            lp = plain.logprobs
            assert len(lp.probs) == len(lp.top_token_ids) == len(lp.top_probs) == len(plain.token_ids)
            for token, prob, ids, probs in zip(plain.token_ids, lp.probs, lp.top_token_ids, lp.top_probs,
                                               strict=True):
                assert ids[0] == token and math.isclose(prob, probs[0], rel_tol=1e-5) and len(ids) == 3
            none = (await cluster.submit(prompt, gen_length=32)).final
            assert none.logprobs is None and none.token_ids == plain.token_ids

            stop = plain.text[1:3]  # ends the answer after its first character
            for stream in (False, True):
                outcome = await cluster.submit(prompt, gen_length=32, stream=stream, stop=[stop, "@@@"], logprobs=0)
                final = outcome.final
                assert final.text == plain.text[: plain.text.index(stop)] and final.finish_reason == "stop"
                assert final.token_ids == plain.token_ids[: len(final.token_ids)]
                assert engine().decode(final.token_ids) == final.text
                assert len(final.logprobs.probs) == len(final.token_ids) and final.logprobs.top_token_ids == []
                if stream:
                    assert "".join(e.text_delta for e in outcome.progress) == final.text
                    assert [t for e in outcome.progress for t in e.delta_token_ids] == final.token_ids
        finally:
            await cluster.close()

    asyncio.run(main())
