"""``max_tokens == 0`` through the runtime on the real engine (real clock, worker threads): the
request prefills its prompt, delivers no chunk and ends with its result, prompt logprobs
included, to a streaming and a non-streaming caller alike, beside requests that decode."""

from __future__ import annotations

import trio

import tinyloop
from tests.actors.test_runtime_engine import make_engine
from tinyloop.requests import GenerationRequest, GenerationResult, RequestState, SamplingParams

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT = tuple(range(40, 61))


def prompt_only(**kw: object) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=PROMPT, max_tokens=0, prompt_logprobs=2, sampling=GREEDY,
                             **kw)  # type: ignore[arg-type]


def expect_prompt_only(result: GenerationResult | None, want: GenerationResult) -> None:
    assert result is not None
    assert (result.tokens, result.text, result.completion_tokens) == ([], "", 0)
    assert (result.finish_reason, result.stop_reason) == ("length", "length")
    assert result.prompt_logprobs == want.prompt_logprobs and len(result.prompt_logprobs or []) == len(PROMPT)
    assert result.time_to_first_token_ms is None


async def test_max_tokens_zero_reaches_a_streaming_and_a_waiting_caller() -> None:
    want = make_engine().generate(prompt_only())
    other = GenerationRequest(prompt_tokens=(1, 2, 3), max_tokens=12, sampling=GREEDY)
    expected = make_engine().generate(other).tokens
    engine = make_engine()
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=4)) as rt:
            got: dict[str, object] = {}

            async def streamed() -> None:
                req = prompt_only()
                async with rt.submit_stream(req) as stream:
                    got["chunks"] = [chunk async for chunk in stream]
                got["streamed"] = stream.result
                got["state"] = rt.request_state(req.request_id)

            async def waited() -> None:
                got["waited"] = await rt.submit(prompt_only())

            async def decoding() -> None:
                got["other"] = (await rt.submit(other)).tokens

            async with trio.open_nursery() as nursery:
                for task in (decoding, streamed, waited):
                    nursery.start_soon(task)
            assert rt.statistics().in_flight == 0
            text = rt.metrics_text()
    assert got["chunks"] == []
    expect_prompt_only(got["streamed"], want)  # type: ignore[arg-type]
    expect_prompt_only(got["waited"], want)  # type: ignore[arg-type]
    assert got["state"] is RequestState.DONE
    assert got["other"] == expected
    assert "tinyloop_requests_completed_total 3.0" in text
    assert engine.kv_statistics().blocks_used == 0
