"""Issue 14, kind 8: every start-up failure of `python -m kvflow.serve` is one line on stderr
naming the flag or value and a fix, exit status 1, no traceback; the server stops when the
reader of its stdout goes away. Each test runs the real CLI as a subprocess; most fail before
any child starts or any model loads."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvflow.bench.ports import free_port

from tests.serve_server import pid_alive

SMALL = ["--max-model-len", "256", "--num-blocks", "64", "--max-num-batched-tokens", "64"]  # no profile run


def serve(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvflow.serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def one_line(out: subprocess.CompletedProcess) -> str:
    """The failure's only stderr line (after checking status 1 and no traceback)."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def busy_port():
    """A port some other socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_unknown_model_lists_the_built_in_ones():
    assert one_line(serve("--model", "llama-7b")) == (
        "kvflow.serve: error: --model 'llama-7b' is neither a built-in model (kvflow-tiny, "
        "kvflow-llama-32l) nor a directory; pass one of those names or the path of a local "
        "Hugging Face Llama/Qwen2 checkpoint")


def test_a_directory_that_is_not_a_checkpoint_says_what_it_lacks(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert one_line(serve("--model", str(tmp_path), "--role", "router")) == (
        f"kvflow.serve: error: --model '{tmp_path}' is a directory but not a checkpoint: it has "
        f"no *.safetensors, tokenizer.json; pass a Hugging Face Llama/Qwen2 checkpoint directory "
        f"or a built-in model (kvflow-tiny, kvflow-llama-32l)")


def test_a_checkpoint_with_a_bad_config_names_the_field(tmp_path):
    for name in ("tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert one_line(serve("--model", str(tmp_path))) == (
        f"kvflow.serve: error: --model '{tmp_path}': config.json model_type='gpt2' is not "
        f"supported; use one of ('llama', 'qwen2')")


def test_device_cuda_without_cuda_fails_before_any_child_starts():
    out = serve("--device", "cuda", "--port", str(free_port()), env={"CUDA_VISIBLE_DEVICES": ""})
    why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
           else "torch sees no CUDA GPU (CUDA_VISIBLE_DEVICES='')")
    assert one_line(out) == (f"kvflow.serve: error: --device cuda: {why}; use --device cpu, or "
                             f"a CUDA build of torch on a machine with an NVIDIA GPU")
    assert "router listening" not in out.stdout  # nothing was started


@pytest.mark.parametrize("argv, line", [
    (["--kv-connector", "rdma"], "argument --kv-connector: invalid choice: 'rdma' (choose from "
                                 "'auto', 'ipc-pull', 'ipc-push', 'tcp', 'nixl'); python -m "
                                 "kvflow.serve --help lists the flags"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization 0.5 needs --device cuda; "
                                          "on cpu the budget is --memory-budget-mb"),
    (["--backend", "nonsense"], "--backend nonsense is unknown; use auto or one of copy_engine, native, numba, "
                                "numba_cuda, torch, triton, xpu"),
    (["--role", "decode", "--router-url", "tcp://host"],
     "--router-url must look like tcp://HOST:PORT, got 'tcp://host'"),
])
def test_bad_flags_are_one_line(argv, line):
    assert one_line(serve(*argv)) == "kvflow.serve: error: " + line


def test_busy_http_port_is_named(busy_port):
    assert one_line(serve("--port", str(busy_port))) == (
        f"kvflow.serve: error: --port {busy_port} is in use (127.0.0.1:{busy_port}: Address "
        f"already in use); stop what holds it or pick another --port")


def test_busy_control_port_is_named(busy_port):
    assert one_line(serve("--role", "router", "--port", str(free_port()), "--control-port",
                          str(busy_port))) == (
        f"kvflow.serve: error: --control-port {busy_port} is in use (127.0.0.1:{busy_port}: "
        f"Address already in use); stop what holds it or pick another --control-port")


@pytest.mark.parametrize("role", ["router", "decode"])
def test_host_that_is_not_this_machine_is_named(role):
    """The router's HTTP socket and D's data socket (a free port the OS picks) bind --host."""
    port = free_port()
    joins = ["--router-url", "tcp://127.0.0.1:9"] if role == "decode" else []
    out = serve("--role", role, "--host", "192.0.2.1", "--port", str(port), *joins)
    where = f"192.0.2.1:{port}" if role == "router" else "192.0.2.1"
    assert one_line(out) == (
        f"kvflow.serve: error: --host 192.0.2.1 is not an address of this machine ({where}: "
        f"Cannot assign requested address); use 127.0.0.1, 0.0.0.0 or one of this host's addresses")


def test_instance_waits_for_the_router_then_gives_up_in_one_line():
    url = f"tcp://127.0.0.1:{free_port()}"  # nobody listens
    out = serve("--role", "decode", "--router-url", url, "--register-timeout-s", "4.5", *SMALL)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    *notes, last = out.stderr.splitlines()
    assert last == (f"kvflow.serve: error: no answer from the router at {url} within "
                    f"--register-timeout-s 4.5; start the router first (python -m kvflow.serve "
                    f"--role router), fix --router-url, or wait longer with a larger "
                    f"--register-timeout-s")
    # said at the default log level (warning) after 1 s, then every 3 s
    note = (rf"\S+ \S+ kvflow.serve WARNING d-\d+-[0-9a-f]{{6}}: waiting for the router at "
            rf"{re.escape(url)} \((\d+) s; giving up after --register-timeout-s 4.5\)")
    assert [re.fullmatch(note, n).group(1) for n in notes] == ["1", "4"], notes


def test_registration_refused_by_the_router_is_printed_by_the_instance():
    port, control = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--role", "router", "--mode",
                               "colocated", "--port", str(port), "--control-port", str(control)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "router listening" in router.stdout.readline()
        out = serve("--role", "prefill", "--router-url", f"tcp://127.0.0.1:{control}", *SMALL)
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(20)
    assert one_line(out) == (
        f"kvflow.serve: error: the router at tcp://127.0.0.1:{control} refused this prefill "
        f"instance: --role prefill does not fit a router in --mode colocated; start the instance "
        f"with --role colocated, or the router with --mode disagg")


def test_child_failing_at_start_is_one_line_naming_it_and_the_flag_to_raise():
    """A too small --memory-budget-mb (CPU) fails in the children's profile run; the server
    prints one line (the first child's), stops the other child and exits 1."""
    out = serve("--port", str(free_port()), "--memory-budget-mb", "1", "--max-model-len", "256",
                "--max-num-batched-tokens", "256")
    line = one_line(out)
    m = re.fullmatch(r"kvflow.serve: error: the (prefill|decode) instance \(pid (\d+)\) exited "
                     r"with code 1 before registering: (.*)", line)
    assert m, line
    assert m.group(3) == (
        "--memory-budget-mb 1 is too small for kvflow-tiny: weights 9.0 MiB + peak activations "
        "3.3 MiB at --max-num-batched-tokens 256 + one KV block 32.0 KiB = 12.4 MiB; raise "
        "--memory-budget-mb to at least 13")
    pids = [int(p) for p in re.findall(r"pid (\d+)", out.stdout)]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids), out.stdout


def test_server_stops_when_the_reader_of_its_stdout_goes_away():
    """`python -m kvflow.serve | head -1`: once head exits, the router and both children exit
    within a few seconds, without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--port", str(free_port()),
                             *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        pids = [int(p) for p in re.findall(r"pid (\d+)", first)]
        assert len(pids) == 2, first
        proc.stdout.close()  # the reader goes away, as head does after its lines
        t0 = time.monotonic()
        proc.wait(10)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 5 and proc.returncode == 1, (took, proc.returncode, err)
    assert not any(pid_alive(p) for p in pids)
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "kvflow.serve: stopping: the reader of stdout has gone (a closed pipe)"


def test_checkpoint_whose_tensors_do_not_match_is_one_line(tmp_path):
    """A checkpoint error found while loading the weights (in the instance) names --model."""
    from safetensors.torch import save_file
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}')
    (tmp_path / "tokenizer.json").write_text("{}")
    save_file({"foo": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    out = serve("--role", "prefill", "--router-url", "tcp://127.0.0.1:9", "--model", str(tmp_path))
    assert re.fullmatch(rf"kvflow.serve: error: --model '{tmp_path}': checkpoint '{tmp_path}' does "
                        rf"not match a 1-layer model: missing \['lm_head.weight', .*\], "
                        rf"unexpected \['foo'\]", one_line(out)), out.stderr


def test_instance_with_another_tokenizer_than_the_router_is_refused(tmp_path):
    """The router encodes prompts and decodes tokens with its own --model's tokenizer: an
    instance serving a checkpoint with another vocabulary would answer 200 with garbage text
    (found by a new-user test), so its registration is refused, naming both."""
    from kvflow.model.tokenizer import HFTokenizer

    from tests.hf_models import build
    build(tmp_path, "llama-theta1e5")
    digest = HFTokenizer(str(tmp_path)).digest
    port, control = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--role", "router",
                               "--port", str(port), "--control-port", str(control)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "router listening" in router.stdout.readline()
        out = serve("--role", "prefill", "--router-url", f"tcp://127.0.0.1:{control}",
                    "--model", str(tmp_path), "--max-model-len", "128", "--num-blocks", "16",
                    "--max-num-batched-tokens", "64")
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(20)
    assert digest.startswith("tokenizer.json:") and len(digest) == len("tokenizer.json:") + 16
    assert one_line(out) == (
        f"kvflow.serve: error: the router at tcp://127.0.0.1:{control} refused this prefill "
        f"instance: its --model {tmp_path} has another tokenizer ({digest}) than the router's "
        f"--model kvflow-tiny (kvflow-byte-258): prompts and tokens would be read with the wrong "
        f"vocabulary; start the router with --model {tmp_path}")


@pytest.mark.parametrize("after_s", [0.2, 0.3, 1.0, 1.3])
def test_ctrl_c_while_starting_is_one_line_and_leaves_nothing(after_s):
    """SIGINT to the process group while the server still imports torch or starts its
    children (a terminal's Ctrl-C): one line, no traceback, no child left. The children run
    in their own session, so the Ctrl-C reaches only the server, which stops them; a Ctrl-C
    inside torch's import (which can break numpy's next import) is still the interrupt."""
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--port", str(free_port()),
                             *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(after_s)
    # kvflow's handlers come first thing in kvflow.serve.__main__ (it catches SIGTERM from
    # there: the marker); before that, on a loaded host, the Ctrl-C would land in Python's own
    # start-up (its KeyboardInterrupt traceback), not in kvflow's
    wait_catches(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert "before registering" not in err, err  # the user's Ctrl-C is not a child's failure
    assert proc.returncode in (0, 130), (proc.returncode, err)
    if proc.returncode == 130:
        assert "kvflow.serve: stopped (interrupted while starting)" in err.splitlines()
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)


def wait_catches(pid: int, sig: int, timeout_s: float = 60.0) -> None:
    """Wait until process ``pid`` has a handler for ``sig`` (``SigCgt`` of /proc/pid/status):
    before that, the signal kills it the default way, which is Python's start-up, not kvflow's
    (on a loaded host importing torch alone takes seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.005)
    raise TimeoutError(f"pid {pid} installed no handler for signal {sig} in {timeout_s} s")


@pytest.mark.parametrize("after_s", [0.0, 0.3])
def test_sigterm_while_starting_exits_143_in_one_line(after_s):
    """SIGTERM before the router listens (``after_s`` after kvflow's handler is in place, while
    the flags are checked and the instances start) is a failed start, like Ctrl-C's 130:
    status 143 and one line, not 0. A SIGTERM that lands inside an import that swallows every
    exception still stops the start (it once left the server running, the signal lost)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.serve", "--port", str(free_port()),
                             *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_catches(proc.pid, signal.SIGTERM)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "router listening" not in out, out
    assert (proc.returncode, err) == (143, "kvflow.serve: stopped (interrupted while starting)\n")
