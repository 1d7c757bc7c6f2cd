"""The serving bench's client: one round of n concurrent PCM streams, timed at the client (stdlib + httpx only)."""

# Run as a script (`python serving_client.py URL N MAX_FRAMES SEED`), not as `-m mtp_fsm.bench...`: importing
# the bench package would load torch and matplotlib into every client process. Prints one JSON line.

from __future__ import annotations

import asyncio
import json
import sys
import time

TEXTS = ("Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "Please turn left at the next corner.", "Trains to the airport leave every ten minutes.")


async def one(client, body: dict) -> dict:
    """One streamed PCM request: sent -> first audio bytes -> last byte."""
    sent = time.perf_counter()
    first = None
    size = 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
        rid = response.headers["x-request-id"]
        async for chunk in response.aiter_bytes():
            if chunk and first is None:
                first = time.perf_counter()
            size += len(chunk)
    return {"id": rid, "ttfa_s": None if first is None else first - sent, "total_s": time.perf_counter() - sent,
            "bytes": size}


async def run_round(url: str, n: int, max_frames: int, seed: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        bodies = [{"input": TEXTS[i % len(TEXTS)], "seed": seed + i, "max_new_tokens": max_frames, "stream": True,
                   "response_format": "pcm"} for i in range(n)]
        # n connections open and warm before the clock starts (keep-alive, as a serving client keeps them):
        # TTFA is the server's, not TCP setup's or this process's first-request costs.
        await asyncio.gather(*(client.get("/health") for _ in range(n)))
        began = time.perf_counter()
        rows = await asyncio.gather(*(one(client, b) for b in bodies))
        return rows, time.perf_counter() - began


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: serving_client.py URL N MAX_FRAMES SEED")
    url, n, max_frames, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rows, wall = asyncio.run(run_round(url, n, max_frames, seed))
    print(json.dumps({"rows": rows, "wall_s": wall}))
