"""The README's main job on the embedded default: train -> hand off -> serve -> query.

Runs `baton train` on the demo recipe (through the CLI's command table: the serving side never
imports the trainer), starts `baton serve` on the handoff checkpoint as a separate process on a
free loopback port, queries it over gRPC with Baton's client, checks the answers against the
offline engine, and shuts the server down gracefully. It lives in serve/ because its last steps
are serving ones.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from baton.common.cli import main as baton
from baton.serve.client import BatonClient
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
PROMPTS = ["Return the number of", "This module provides", "If the file"]
MAX_TOKENS = 40


class ServerProcess:
    """`baton serve` in a subprocess; its port is read from its log line "listening on HOST:PORT"."""

    def __init__(self, model_dir: Path, timeout_s: float = 120.0):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.common.cli",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                "0",
                "--metrics-port",
                "-1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while self.port is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("baton serve did not start:\n" + "".join(self.lines[-20:]))
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on [\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: drain, then exit 0
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def wait_until_serving(client, server: ServerProcess, timeout_s: float = 600.0) -> None:
    """Until health says SERVING. The server listens before it loads the model, and on a machine's
    first start it also builds the C++ CPU kernels (~1 min idle, minutes more on a busy 2-core machine),
    so the limit is generous; a server that exits meanwhile is reported at once, with its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.health() == "SERVING":
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if server.proc.poll() is not None:
            raise RuntimeError("baton serve exited while loading:\n" + "".join(server.lines[-20:]))
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"baton serve did not report SERVING within {timeout_s:.0f} s:\n" + "".join(server.lines[-20:])
            )
        time.sleep(0.1)


def last_metrics(out_dir: Path) -> dict:
    """The run's last train loss, val loss and tokens/s, from its metrics.jsonl."""
    last: dict = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        last.update({k: v for k, v in json.loads(line).items() if v is not None})
    return last


def run_demo(out_dir: Path, steps: int | None = None, corpus: str | None = None) -> list[str]:
    overrides = [f"out_dir={out_dir}", "checkpoint.resume=never"]  # the demo always trains from scratch
    if steps is not None:
        overrides.append(f"max_steps={steps}")
    if corpus is not None:
        overrides.append(f"data.path={corpus}")
    length = f"{steps} steps" if steps is not None else "the recipe's steps"
    print(
        f"[1/4] training the demo model (configs/{DEMO_CONFIG.name}) for {length} "
        f"on {corpus or 'the embedded Python-docstring corpus'}"
    )
    code = baton(["train", "--config", str(DEMO_CONFIG), *overrides])
    if code != 0:
        raise SystemExit(code)  # baton train said why
    m = last_metrics(out_dir)
    print(
        f"      train loss {m['loss']:.3f}, val loss {m.get('val_loss', float('nan')):.3f}, "
        f"{m['tokens_per_s']:,.0f} tokens/s"
    )
    handoff = out_dir / "handoff"
    print(f"[2/4] handed off to {handoff}")
    server = ServerProcess(handoff)
    print(f"[3/4] serving it with `baton serve` on 127.0.0.1:{server.port}")
    outputs = []
    try:
        with BatonClient(f"127.0.0.1:{server.port}", timeout=120) as client:
            wait_until_serving(client, server)
            print(f"[4/4] querying it over gRPC (greedy, {MAX_TOKENS} tokens):")
            for prompt in PROMPTS:
                reply = client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
                outputs.append(prompt + reply.completions[0].text)
                print(f"  > {outputs[-1]!r}")
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"baton serve exited with {code}:\n" + "".join(server.lines[-20:]))
    offline = LLM(handoff).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    if [p + o.outputs[0].text for p, o in zip(PROMPTS, offline)] != outputs:
        raise RuntimeError("the server's answers differ from the offline engine's")
    print("      the server's answers equal the offline engine's; server shut down cleanly")
    return outputs
