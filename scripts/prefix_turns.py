"""A 4-turn chat behind a long system prompt against `qspec serve`, with prefix reuse and without
(`--no-prefix-cache`): each turn's streamed time to first token, the answers compared, the hit rate.

    python scripts/prefix_turns.py packages/smollm2-k0_4-fbs4 [--rounds 3] [--method pld]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

SYSTEM = (
    "You are the support assistant of a small bookshop. The shop opens at nine and closes at six on weekdays, "
    "at four on Saturdays, and stays closed on Sundays and public holidays. Orders above forty euros ship for "
    "free inside the country; smaller orders pay four euros fifty. Returns are accepted within thirty days "
    "with the receipt, books must be unread and undamaged; gift cards cannot be returned. The shop sells new "
    "and second-hand books, maps, postcards and a few board games. Second-hand books are graded as fine, good "
    "or fair, and the grade is written on the first page in pencil. Customers may reserve a book for a week. "
    "The café in the back serves tea, coffee and cakes until an hour before closing. Events: a reading club "
    "every first Tuesday of the month at seven, children's story time on Saturday mornings at ten, and "
    "signings announced in the newsletter. Answer briefly and politely, in the customer's language, and never "
    "invent a policy that is not written here. "
) * 2
TURNS = [
    "When do you open on Saturday?",
    "And can I return a gift card?",
    "How much is shipping for a thirty euro order?",
    "What happens on the first Tuesday of the month?",
]


def start(package: str, port: int, method: str, reuse: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qspec", "serve", package, "--port", str(port), "--method", method,
           "--served-model-name", "m", "--log-level", "warning"]  # fmt: skip
    cmd.append("--prefix-cache" if reuse else "--no-prefix-cache")
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def turn(url: str, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """(answer, seconds to the first streamed token)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - start
                text.append(delta)
    return "".join(text), first


def conversation(url: str, system: str, max_tokens: int) -> tuple[list[str], list[float]]:
    messages, answers, ttfts = [{"role": "system", "content": system}], [], []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        answer, ttft = turn(url, messages, max_tokens)
        answers.append(answer)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})
    return answers, ttfts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="pld")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    results = {}
    for reuse in (True, False):
        proc = start(args.package, args.port, args.method, reuse)
        url = f"http://127.0.0.1:{args.port}"
        try:
            # each round its own system prompt: turn 1 finds nothing of an earlier conversation
            runs = [conversation(url, f"[{i}] {SYSTEM}", args.max_tokens) for i in range(args.rounds)]
            metrics = httpx.get(f"{url}/metrics").text
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        hits = [line for line in metrics.splitlines() if line.startswith("qspec:prefix_cache_")]
        results[reuse] = runs
        print(f"prefix cache {'on' if reuse else 'off'}:", *hits, sep="\n  ")
        for t in range(len(TURNS)):
            ttfts = [run[1][t] * 1000 for run in runs]
            each = ", ".join(f"{x:.0f}" for x in ttfts)
            print(f"  turn {t + 1}: TTFT median {statistics.median(ttfts):7.1f} ms  ({each})")
    same = [a[0] == b[0] for a, b in zip(results[True], results[False])]
    print("answers equal:", all(same), same)


if __name__ == "__main__":
    main()
