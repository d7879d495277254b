"""`qspec serve --replicas N` on Ray Serve, on a tiny random model and a local Ray instance on loopback: one
endpoint, both replicas used, answers equal to offline greedy, no 5xx, a clean stop; one-line start-up
errors; the KubeRay manifest in examples/ checked against what it names. Starting Ray takes a minute on a
busy machine: the load test is the only one that starts it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from qspec.compile import CompileOptions, compile_package
from qspec.runtime import Engine, SamplingParams
from qspec.specializations import make_config
from tests.test_serve import CTX, MODEL

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray" / "rayservice.yaml"


@pytest.fixture(scope="module")
def package(tiny_model, tmp_path_factory):
    config = make_config(num_speculative_tokens="0,4", prefill_seq_len=8, ctx_len=CTX, full_batch_size=4)
    folder = tmp_path_factory.mktemp("serve-ray") / "pkg"
    return compile_package(tiny_model("llama"), CompileOptions(specialization=config), output=folder)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: Ray's own processes are children of the driver)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qspec", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    return lines[0]


def test_replica_startup_errors_are_one_line(package, tmp_path):
    """No Ray installed, a wrong --ray-address, a taken port, bounds that do not hold --replicas: one `Error:`
    line and exit 1, in seconds."""
    fake = tmp_path / "no-ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\", name='ray')\n")
    line = one_error_line(run_cli([str(package), "--replicas", "2"], env={"PYTHONPATH": str(fake.parent)}))
    assert "pip install 'qspec[ray]'" in line
    start = time.monotonic()
    line = one_error_line(run_cli([str(package), "--replicas", "2", "--ray-address", f"127.0.0.1:{free_port()}"]))
    assert "cannot reach the Ray cluster" in line and time.monotonic() - start < 60
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = one_error_line(run_cli([str(package), "--replicas", "2", "--port", str(taken.getsockname()[1])]))
    assert "cannot listen on" in line
    line = one_error_line(run_cli([str(package), "--replicas", "3", "--max-replicas", "2"]))
    assert "--replicas 3" in line and "--max-replicas 2" in line


def test_kuberay_manifest_names_a_working_builder():
    """The RayService example: KubeRay's fields, a Serve config whose import path resolves to qspec's builder,
    and arguments that qspec's options accept."""
    from qspec.serve.replicas import ReplicaOptions, build_app
    from qspec.serve.server import ServeOptions

    manifest = yaml.safe_load(EXAMPLE.read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    spec = manifest["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"][0]["image"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    [app] = serve_config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert (module, name) == ("qspec.serve.replicas", "build_app") and callable(build_app)
    args = dict(app["args"])
    scaling = ReplicaOptions(**{k: args.pop(k) for k in list(args) if k in ReplicaOptions.model_fields})
    assert scaling.autoscaling and ServeOptions(**args).model_name == "smollm2"


def test_one_replica_imports_no_ray():
    """`qspec serve` without --replicas (the CLI, the server, the app, the engine) loads no Ray module."""
    code = (
        "import sys, qspec_cli.serve, qspec.serve.server, qspec.serve.app, qspec.serve.replicas, qspec.runtime.engine; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_metrics_of_replicas_add_up():
    """Two replicas' expositions summed: every counter, gauge and histogram bucket is the sum of both."""
    from prometheus_client.parser import text_string_to_metric_families

    from qspec.serve.metrics import ServeMetrics
    from qspec.serve.ray_metrics import sum_expositions
    from qspec.serve.ray_router import rank_for

    def samples(text: str) -> dict:
        families = text_string_to_metric_families(text)
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}

    a, b = ServeMetrics(MODEL, [0, 4]), ServeMetrics(MODEL, [0, 4])
    a.prefix_cache(10, 4)
    b.prefix_cache(5, 1)
    a.queue(running=1, waiting=2)
    a.finished("length", 0.3)
    b.finished("length", 2.0)
    one, other = samples(a.render().decode()), samples(b.render().decode())
    summed = samples(sum_expositions([a.render().decode(), b.render().decode()]))
    assert summed == {key: value + other[key] for key, value in one.items() if not key[0].endswith("_created")}
    assert summed[("qspec:prefix_cache_hits_total", (("model_name", MODEL),))] == 5
    assert rank_for("chat-1", ["r1", "r2", "r3"]) == rank_for("chat-1", ["r3", "r1", "r2"])  # order-free


def test_two_replicas_serve_a_load_and_stop_clean(package):
    """`--replicas 2`: concurrent clients, leavers and bad requests through one endpoint; every answer equals
    offline greedy, no 5xx, both replicas answer, a conversation's requests (x-session-id) one replica;
    /metrics sums both replicas; SIGINT: exit 0 and no process of it left."""
    pytest.importorskip("ray.serve")
    port = free_port()
    cmd = [sys.executable, "-m", "qspec", "serve", str(package), "--replicas", "2", "--port", str(port),
           "--served-model-name", MODEL, "--method", "pld", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the replicas did not come up"
            time.sleep(1)
        prompts = [f"abcabc {i}" for i in range(16)]
        engine = Engine(package, method="none")
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        refs = [o.text for o in engine.generate(prompts, params)]

        def ask(i: int) -> tuple[int, str, str]:
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 24, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            return response.status_code, response.json()["choices"][0]["text"], response.headers["x-qspec-replica"]

        def leave(i: int) -> None:  # a streaming client that goes away after its first chunk
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 24, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                next(response.iter_lines())

        with ThreadPoolExecutor(8) as pool:
            answers = pool.map(ask, range(len(prompts)))
            leavers = [pool.submit(leave, i) for i in range(3)]
            bad = [
                httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=60),
                httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "a", "n": 99}, timeout=60),
            ]
            answers = list(answers)
            for future in leavers:
                future.result()
        assert [status for status, _, _ in answers] == [200] * len(prompts)
        assert [text for _, text, _ in answers] == refs
        assert [r.status_code for r in bad] == [404, 400] and all("error" in r.json() for r in bad)
        assert len({replica for _, _, replica in answers}) == 2, "one replica took every request"
        for conversation in ("chat-a", "chat-b"):
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "ignore_eos": True}
            headers = {"x-session-id": conversation}
            replicas = {
                httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60).headers["x-qspec-replica"]
                for _ in range(4)
            }
            assert len(replicas) == 1, f"{conversation} went to {replicas}"
        deadline = time.monotonic() + 15  # each replica posts its counters every 2 s
        while True:
            scrape = httpx.get(f"{url}/metrics", timeout=60).text
            families = text_string_to_metric_families(scrape)
            finished = sum(s.value for f in families for s in f.samples if s.name == "qspec:request_success_total")
            if finished == len(prompts) + 3 + 8 or time.monotonic() > deadline:  # answers, leavers, conversations
                break
            time.sleep(0.5)
        assert finished == len(prompts) + 3 + 8, scrape
        below = descendants(proc.pid)
        assert below, "no Ray process under the server"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, proc.stdout.read().decode()
        time.sleep(2)
        assert not [pid for pid in below if alive(pid)], "processes left after SIGINT"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
