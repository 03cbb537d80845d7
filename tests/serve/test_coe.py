"""Composition of Experts (`baton serve --coe`): three tiny experts of two sizes behind one gRPC
server on loopback, a router trained here on two kinds of text (tinyshakespeare lines vs code-like
lines generated below), both protos (Baton's client and the stock tritonclient).

Checked: a request naming an expert gets that checkpoint's offline greedy output; the router sends
held-out prompts to the right expert (>= 90% of them) and below the threshold the fallback serves;
unknown names get NOT_FOUND; unloading and reloading (and adding) an expert while another streams
leaves that stream intact; a bad CoE file fails before any port is bound."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.cli import main as baton
from baton.common.config import ConfigError
from baton.common.router import load_router
from baton.common.tokenizer import train_bpe
from baton.serve.client import BatonClient
from baton.serve.coe.config import load_coe_config
from baton.serve.coe.server import CoEServer, coe_server_config
from baton.serve.engine import EngineConfig
from baton.serve.server import ServerConfig
from baton.train.router import RouterTrainConfig, train_router

from .conftest import BASE, make_hf_checkpoint
from .server_fixtures import offline

tc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dev dependency")
SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
MAX_TOKENS = 12
ACCURACY = 0.9  # held-out prompts the router must send to the right expert


def code_lines(rng: random.Random, n: int) -> list[str]:
    def one() -> str:
        a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(0, 9)
        return rng.choice(
            [
                f"x{a} = {b} * {a} + {c}",
                f"def f{a}(x): return x + {b}",
                f"for i in range({a}): print(i * {b})",
                f"{a} {b} {a * b} {a + b} {c}",
                f"if x{c} > {a}: y = [{b}, {c}, {a}]",
            ]
        )

    return [one() for _ in range(n)]


@pytest.fixture(scope="module")
def coe(tmp_path_factory):
    """Three experts (poet and coder: 2 layers; generalist: 3 layers), a trained router, COE.yaml."""
    tmp = tmp_path_factory.mktemp("coe")
    rng = random.Random(0)
    lines = [s.strip() for s in SHAKESPEARE.read_text().splitlines() if len(s.strip()) > 20]
    tok = train_bpe(["\n".join(lines[:3000] + code_lines(rng, 500))], vocab_size=BASE["vocab_size"])
    experts = {}
    for name, seed, layers in (("poet", 0, 2), ("coder", 1, 2), ("generalist", 2, 3)):
        _, ckpt = make_hf_checkpoint(tmp / name, "llama", seed=seed, num_hidden_layers=layers)
        model = load_checkpoint(ckpt).model
        model.config.eos_token_id = None
        experts[name] = save_model(tmp / f"{name}-ckpt", model, tokenizer=tok)
    shuffled = rng.sample(lines, 400)
    labelled = [(t, "poet") for t in shuffled[:150]] + [(t, "coder") for t in code_lines(rng, 150)]
    held_out = [(t, "poet") for t in shuffled[150:190]] + [(t, "coder") for t in code_lines(rng, 40)]
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "expert": e}) + "\n" for t, e in labelled))
    head = train_router(RouterTrainConfig(base=str(experts["poet"]), data=str(data), out=str(tmp / "router")))
    spec = {
        "name": "coe",
        "kv_cache_mb": 3,
        "fallback": "generalist",
        "router": {"path": str(tmp / "router"), "threshold": 0.6},
        "experts": [
            {"name": "poet", "checkpoint": str(experts["poet"]), "kv_cache_mb": 1},
            {"name": "coder", "checkpoint": str(experts["coder"])},
            {"name": "generalist", "checkpoint": str(experts["generalist"])},
        ],
    }
    path = tmp / "coe.yaml"
    path.write_text(yaml.safe_dump(spec))
    return dict(tmp=tmp, experts=experts, yaml=path, spec=spec, held_out=held_out, head=head)


class CoEThread:
    """A CoEServer on its own event loop thread (blocking clients in the test)."""

    def __init__(self, path: Path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        base = ServerConfig(model="", port=0, metrics_port=0, engine=EngineConfig(block_size=8), drain_timeout_s=30)
        config, spec = coe_server_config(str(path), base)
        self.server = CoEServer(config, spec)
        self.run(self.server.start())
        self.run(self.server.load(), timeout=120)
        self.rt = self.server.rt
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.drain_and_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(coe):
    s = CoEThread(coe["yaml"])
    yield s
    s.stop()


def triton_inputs(prompt: str):
    ins = [tc.InferInput("text_input", [1], "BYTES"), tc.InferInput("sampling_parameters", [1], "BYTES")]
    ins[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    params = {"temperature": "0", "max_tokens": str(MAX_TOKENS)}
    ins[1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return ins


PROMPTS = ["To be, or not to be", "def f(x): return x +"]


def test_named_experts_give_their_checkpoints_greedy_output(coe, server):
    client = tc.InferenceServerClient(server.target)
    try:
        with BatonClient(server.target, timeout=60) as c:
            outputs = {}
            for name, ckpt in coe["experts"].items():
                ref = offline(ckpt, PROMPTS, MAX_TOKENS)
                for prompt, (ids, text, _) in zip(PROMPTS, ref):
                    reply = c.complete(prompt, model=name, max_tokens=MAX_TOKENS, temperature=0.0)
                    assert (reply.model, list(reply.completions[0].token_ids)) == (name, ids), (name, prompt)
                    out = client.infer(name, triton_inputs(prompt))
                    assert out.get_response().model_name == name
                    assert out.as_numpy("text_output")[0].decode() == prompt + text
                outputs[name] = [r[0] for r in ref]
            assert len({json.dumps(v) for v in outputs.values()}) == 3, "the experts must differ for this to test"
            assert c.model_info().name == "generalist"  # the CoE's name outside generation: the fallback
    finally:
        client.close()


def test_router_sends_held_out_prompts_to_their_expert(coe, server):
    held_out = coe["held_out"]
    router = load_router(coe["tmp"] / "router")
    picks = router.route([t for t, _ in held_out])
    offline_acc = sum(p == e for (p, _), (_, e) in zip(picks, held_out)) / len(held_out)
    assert offline_acc >= ACCURACY, offline_acc
    knn = RouterTrainConfig(
        base=str(coe["experts"]["poet"]),
        data=str(coe["tmp"] / "prompts.jsonl"),
        kind="knn",
        out=str(coe["tmp"] / "knn"),
    )
    train_router(knn)
    picks = load_router(knn.out).route([t for t, _ in held_out])
    assert sum(p == e for (p, _), (_, e) in zip(picks, held_out)) / len(held_out) >= ACCURACY
    before = server.rt.route_decisions
    served = []
    with BatonClient(server.target, timeout=60) as c:
        for text, expert in held_out[::4]:
            served.append((c.complete(text, model="coe", max_tokens=2, temperature=0.0).model, expert))
        served.append((c.complete(held_out[0][0], max_tokens=2, temperature=0.0).model, held_out[0][1]))  # no name
        info = c.server_info().coe
    right = sum(got == want for got, want in served) / len(served)
    assert right >= ACCURACY, served
    assert info.route_decisions - before == len(served) and info.router_kind == "classifier"
    by_name = {e.name: e for e in info.experts}
    assert by_name["poet"].routed_requests + by_name["coder"].routed_requests >= right * len(served) - 1
    assert by_name["generalist"].fallback and by_name["poet"].kv_cache_bytes == 2**20
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    routed = {
        s.labels["expert"]: s.value for s in families["baton_coe_requests"].samples if s.labels.get("how") == "routed"
    }
    assert routed["poet"] >= 1 and routed["coder"] >= 1
    assert families["baton_coe_route_confidence"].samples and "baton_coe_expert_active_calls" in families


def test_below_the_threshold_the_fallback_serves(coe, server):
    prompt = coe["held_out"][0][0]
    confidence = load_router(coe["tmp"] / "router").route([prompt])[0][1]
    spec = server.rt.cfg.router
    old, spec.threshold = spec.threshold, confidence + 1e-3  # just above this prompt's confidence
    try:
        with BatonClient(server.target, timeout=60) as c:
            before = {e.name: e.fallback_requests for e in c.server_info().coe.experts}["generalist"]
            reply = c.complete(prompt, model="coe", max_tokens=MAX_TOKENS, temperature=0.0)
            after = {e.name: e.fallback_requests for e in c.server_info().coe.experts}["generalist"]
    finally:
        spec.threshold = old
    ref = offline(coe["experts"]["generalist"], [prompt], MAX_TOKENS)[0][0]
    assert (reply.model, list(reply.completions[0].token_ids), after - before) == ("generalist", ref, 1)


def test_unknown_names_and_unroutable_prompts(server):
    client = tc.InferenceServerClient(server.target)
    try:
        with BatonClient(server.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hello", model="nobody", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "poet" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.complete([1, 2, 3], model="coe", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the router reads text
        with pytest.raises(tc.InferenceServerException) as e:
            client.infer("nobody", triton_inputs("hello"))
        assert e.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(tc.InferenceServerException):
            client.load_model("nobody")
    finally:
        client.close()


def test_unload_and_load_experts_while_another_streams(coe, server):
    ref = offline(coe["experts"]["coder"], ["def f(x):"], 160, ignore_eos=True)[0][0]
    got, errors = [], []
    started, resume = threading.Event(), threading.Event()

    def stream() -> None:
        # After its first chunk the stream stops reading until the experts have come and gone, so its RPC is
        # open through all of it however fast the machine generates (a timing race made this flaky in CI).
        try:
            with BatonClient(server.target, timeout=120) as c:
                for msg in c.generate("def f(x):", model="coder", max_tokens=160, temperature=0.0, ignore_eos=True):
                    got.extend(msg.completions[0].token_ids)
                    started.set()
                    resume.wait(120)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            started.set()

    engines = {n: server.rt.experts[n].rt.async_engine for n in ("coder", "generalist")}
    worker = threading.Thread(target=stream)
    worker.start()
    client = tc.InferenceServerClient(server.target)
    try:
        assert started.wait(60)
        client.unload_model("poet")
        index = {m["name"]: m["state"] for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index == {"poet": "UNAVAILABLE", "coder": "READY", "generalist": "READY"}
        assert not client.is_model_ready("poet") and client.is_model_ready("coder")
        with BatonClient(server.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hello", model="poet", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        extra = {"checkpoint": str(coe["experts"]["poet"]), "kv_cache_mb": 0.25}
        client.load_model("poet2", config=json.dumps(extra))  # a new expert, in part of poet's freed share
        with pytest.raises(tc.InferenceServerException) as e:  # over what is free: refused, nothing stops
            client.load_model("poet3", config=json.dumps({**extra, "kv_cache_mb": 1}))
        assert "RESOURCE_EXHAUSTED" in e.value.status()
        want = offline(coe["experts"]["poet"], PROMPTS[:1], MAX_TOKENS)[0][0]
        with BatonClient(server.target, timeout=60) as c:
            reply = c.complete(PROMPTS[0], model="poet2", max_tokens=MAX_TOKENS, temperature=0.0)
            assert list(reply.completions[0].token_ids) == want
            client.unload_model("poet2")
            assert worker.is_alive(), "the stream must still run while experts come and go"
            client.load_model("poet")
            reply = c.complete(PROMPTS[0], model="poet", max_tokens=MAX_TOKENS, temperature=0.0)
            assert list(reply.completions[0].token_ids) == want
    finally:
        resume.set()
        worker.join(120)
        client.close()
    assert not errors and got == ref, errors
    assert all(server.rt.experts[n].rt.async_engine is e for n, e in engines.items()), "the others never restart"


def _bad(tmp: Path, spec: dict, **change) -> Path:
    path = tmp / f"bad-{len(list(tmp.glob('bad-*')))}.yaml"
    path.write_text(yaml.safe_dump({**spec, **change}))
    return path


def test_bad_coe_files_fail_before_a_port_binds(coe, capsys):
    spec, tmp = coe["spec"], coe["tmp"]
    poet = spec["experts"][0]
    cases = {
        "is not a checkpoint directory": dict(experts=[{**poet, "checkpoint": str(tmp / "missing")}]),
        "is used twice": dict(experts=[poet, poet]),
        "over the KV budget": dict(experts=[{**poet, "kv_cache_mb": 4}]),
        "has no router": dict(router={"path": str(tmp)}),
        "fallback 'nobody' is not an expert": dict(fallback="nobody"),
        "is not an expert here": dict(experts=[poet, spec["experts"][2]]),  # the router also picks coder
    }
    for message, change in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_coe_config(_bad(tmp, spec, **change), None)
    path = _bad(tmp, spec, experts=[poet, poet])
    assert baton(["serve", "--coe", str(path), "--port", "0", "--metrics-port", "-1"]) != 0
    assert "is used twice" in capsys.readouterr().err
    good = ["serve", "--coe", str(coe["yaml"]), "--port", "0", "--metrics-port", "-1"]
    for flags, message in (
        (["--num-kv-blocks", "8"], "kv_cache_mb in the CoE file"),
        (["--http-port", "0"], "--http-port"),
    ):
        assert baton([*good, *flags]) != 0
        assert message in capsys.readouterr().err


def test_the_shipped_coe_file_loads(coe, tmp_path):
    """configs/coe.yaml with its runs/ checkpoints and router replaced by stand-ins: names, fallback,
    threshold and the stated/split KV shares come out as the file says."""
    import shutil

    shipped = Path(__file__).resolve().parents[2] / "configs" / "coe.yaml"
    router = tmp_path / "router"
    shutil.copytree(coe["tmp"] / "router", router)
    rc = json.loads((router / "router_config.json").read_text())
    rc["experts"] = ["docs", "poet"]  # the shipped router's labels
    (router / "router_config.json").write_text(json.dumps(rc))
    stand_ins = {
        "runs/demo/handoff": coe["experts"]["generalist"],
        "runs/tinyshakespeare/handoff": coe["experts"]["poet"],
        "runs/demo-draft/handoff": coe["experts"]["coder"],
        "runs/router": router,
    }
    text = shipped.read_text()
    for old, new in stand_ins.items():
        text = text.replace(old, str(new))
    (tmp_path / "coe.yaml").write_text(text)
    cfg = load_coe_config(tmp_path / "coe.yaml", None)
    assert (cfg.name, cfg.fallback, [e.name for e in cfg.experts]) == ("coe", "docs", ["docs", "poet", "small"])
    assert cfg.router.threshold == 0.7 and cfg.experts[2].kv_cache_bytes == 32 * 2**20
    assert sum(e.kv_cache_bytes for e in cfg.experts) <= cfg.kv_cache_bytes == 256 * 2**20
