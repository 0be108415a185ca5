"""The CLI as a user types it: text on stdout, one sentence and a non-zero exit on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from isolab.testing.cli import isolab as run_isolab
from isolab.testing.cli import one_sentence
from isolab.testing.tiny_model import TinySpec, write_tiny_llama


def isolab(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return run_isolab(*args, timeout=timeout)


def test_help_lists_commands():
    out = isolab("--help")
    assert out.returncode == 0
    for cmd in ("generate", "selftest", "race"):
        assert cmd in out.stdout


def test_generate_streams_text(tiny_path):
    out = isolab("generate", "the cat", "--model", str(tiny_path), "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "8 tokens" in out.stderr


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
    (["generate", "", "--model", "TINY"], "prompt is empty"),
    (["generate", "hi", "--model", "TINY", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["generate", "hi", "--model", "TINY", "--max-tokens", "100000"], "context"),
    (["generate", "hi", "--model", "MAMBA"], "architecture 'mamba' is not supported"),
    (["generate", "hi", "--model", ""], "the model is an empty name"),  # (it named the current folder)
    (["generate", "hi", "--model", "TINY", "--trace", "/dev/full"], "cannot write the trace '/dev/full'"),
    (["bench", "--model", "TINY", "--num-requests", "1", "--json", "/nonexistent-isolab/x.json"], "--json"),  # before the run
])
def test_bad_input_gets_one_sentence(tmp_path, tiny_path, args, needle):
    mamba = write_tiny_llama(tmp_path / "mamba.gguf", TinySpec(arch="mamba"))
    args = [str(tiny_path) if a == "TINY" else str(mamba) if a == "MAMBA" else a for a in args]
    out = isolab(*args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_an_unknown_argument_is_refused_with_its_commands_usage():
    """`isolab generate Hi --bogus` printed the top level's usage (`isolab [-h] COMMAND ...`)."""
    for args, usage in ((["generate", "Hi", "--bogus"], "usage: isolab generate"),
                        (["race", "explore", "passcode:buggy", "--frob"], "usage: isolab race explore"),
                        (["--frob"], "usage: isolab [-h] COMMAND"),
                        (["--frob", "generate", "hi"], "usage: isolab [-h] COMMAND")):  # (before the command)
        out = isolab(*args)
        assert out.returncode == 2 and out.stderr.startswith(usage), out.stderr
        assert "unrecognized arguments: --frob" in out.stderr or "unrecognized arguments: --bogus" in out.stderr


def test_unknown_fault_is_refused(tiny_path):
    out = isolab("generate", "hi", "--model", str(tiny_path), "--inject-fault", "nope")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_option_prefixes_are_not_guessed():
    """`bench --output 8` once parsed as --output-len 8; a prefix is now refused, not guessed."""
    from isolab.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "--output-len", "8"]).output_len
    for args in (["bench", "--output", "8"], ["race", "stress", "--var", "all"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(args)
        assert exc.value.code == 2


def test_bench_repeats_report_every_run_and_the_median(tmp_path, tiny_path):
    """`bench --repeats 3`: three fresh engines (no prefix hits carried over), the figures of the
    run with the median tok/s, and the engine's peak RSS from the first run."""
    out_json = tmp_path / "bench.json"
    out = isolab("bench", "--model", str(tiny_path), "--num-requests", "3", "--concurrency", "3",
                 "--prompt-len", "6", "--output-len", "4", "--repeats", "3", "--json", str(out_json))
    assert out.returncode == 0, out.stderr
    import json

    result = json.loads(out_json.read_text())
    runs = [r["engine"] for r in result["runs"]]
    assert len(runs) == 3 and all(r["output_tokens"] == 12 for r in runs)
    assert all(r["prefix_cache_hit_rate"] == 0.0 for r in runs)  # each repeat starts on an empty cache
    rates = sorted(r["output_tokens_per_s"] for r in runs)
    assert result["engine"]["output_tokens_per_s"] == rates[1]
    assert result["engine"]["peak_rss_mib"] == runs[0]["peak_rss_mib"] is not None
    assert runs[1]["peak_rss_mib"] is None and "median of 3" in out.stdout


def test_bench_repeats_must_be_positive():
    out = isolab("bench", "--repeats", "0")
    assert out.returncode == 2 and "need at least 1" in out.stderr


@pytest.mark.parametrize("args,needle", [
    (["bench", "--concurrency", "0"], "--concurrency: '0': need at least 1"),  # it once waited forever
    (["bench", "--num-requests", "-1"], "need at least 1"),
    (["bench", "--shared-prefix-len", "-1"], "need 0 or more"),
    (["bench", "--shared-fraction", "1.5"], "a share between 0 and 1"),
    (["generate", "hi", "--max-model-len", "0"], "max_model_len must be at least 1"),
    (["race", "bench", "--repeat", "0"], "--repeat must be at least 1"),  # it once ended in a traceback
    (["serve", "--no-auth", "--drain-timeout", "-1"], "--drain-timeout must be 0 or more"),
    (["doctor", "--tie-margin", "nan"], "--tie-margin must be 0 or more"),
    (["bench", "--url", "ftp://127.0.0.1:9"], "is not an http:// or https:// URL"),  # it was 'cannot reach'
    (["generate", "hi", "--block-size", "3"], "block_size must be even"),  # it gave wrong bf16 outputs
    (["generate", "hi", "--kv-cache-memory", "1e30G"], "the KV pool cannot be mapped"),  # an OverflowError
    (["doctor", "--base-url", "127.0.0.1:8000"], "is not an http:// or https:// URL"),
    # an endpoint for the server's address: '.../v1/completions/v1/models gave no model (HTTP 404)' (session 42)
    (["probe", "--base-url", "http://127.0.0.1:9/v1/completions"], "names the endpoint /completions: give the "
                                                                   "server's address, http://127.0.0.1:9/v1"),
    (["doctor", "--base-url", "http://127.0.0.1:9/v1/chat/completions"], "names the endpoint /chat/completions"),
    # found by a black-box QA pass (session 35): each was a traceback, a hang or a silent misreading
    (["serve", "--no-auth", "--port", "70000"], "--port must be between 0 and 65535"),  # uvicorn took it as 4464
    (["serve", "--no-auth", "--host", "999.1.1.1"], "does not resolve"),
    (["serve", "--no-auth", "--replicas", "1", "--replica-gpus", "1"], "GPUs this machine does not have"),  # hung
    (["serve", "--no-auth", "--replica-threads", "0"], "need --replicas N"),
    (["serve", "--no-auth", "--routing", "random"], "need --replicas N"),  # was taken and ignored
    (["generate", "hi", "--device", "foo"], "device 'foo' is not one this engine runs on"),
    (["generate", "hi", "--device", "meta"], "device 'meta' is not one this engine runs on"),
    (["generate", "hi", "--kv-cache-memory", "infk"], "is not a size"),
    (["generate", "hi", "--kv-cache-memory", "999999999999999"], "the KV pool cannot be mapped"),
    (["generate", "hi", "--trace", "/nonexistent/t.jsonl"], "does not exist"),
    (["generate", "hi", "--trace", f"{sys.executable}/t.jsonl"], "is a file, not a folder"),  # ('does not exist')
    (["generate", "hi", "--kv-cache-dtype", "int8", "--block-size", "8"], "block_size must be a multiple of 16"),
    (["generate", "hi", "--kv-cache-dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_out_of_range_options_get_one_sentence(args, needle):
    """Refused before any model loads, in one sentence, with exit code 2 (never a hang or a traceback)."""
    out = isolab(*args, timeout=60)
    assert out.returncode == 2, out.stderr[-500:]
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_bench_url_refuses_engine_only_options():
    out = isolab("bench", "--url", "http://127.0.0.1:9", "--repeats", "2")
    assert out.returncode == 2 and "--repeats and --compare" in out.stderr and "Traceback" not in out.stderr
    # an engine flag would be silently ignored (no engine runs here): it belongs on the server's command
    for flag in (["--kv-cache-dtype", "int8"], ["--block-size", "32"], ["--audit"]):
        out = isolab("bench", "--url", "http://127.0.0.1:9", *flag)
        one_sentence(out, f"{flag[0]} sets up an engine, and with --url none runs here")
    for body in ("[1]", '"x"'):  # JSON, but not an object of fields (a traceback before)
        one_sentence(isolab("bench", "--url", "http://127.0.0.1:9", "--extra-body", body),
                     "--extra-body must be a JSON object")


def test_bench_without_url_refuses_the_options_that_shape_server_requests():
    """Without --url they were silently ignored while the engine bench ran (an invalid --extra-body too)."""
    for flag in (["--extra-body", "{bad"], ["--api-key", "k"], ["--served-model", "m"], ["--no-ignore-eos"]):
        one_sentence(isolab("bench", "--num-requests", "1", *flag), f"{flag[0]} shapes the requests sent to a server")


def test_a_port_in_use_is_one_sentence_before_the_model_loads():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        out = isolab("serve", "--no-auth", "--port", str(sock.getsockname()[1]), timeout=60)
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_the_bind_check_judges_ipv6_as_uvicorn_binds():
    """serve's check binds as asyncio's create_server does (uvicorn's way): an IPv6 socket is v6-only,
    so a port held on 127.0.0.1 is free on :: and ::1 (no false refusal), and one held on ::1 is
    refused."""
    import socket

    from isolab.commands.serve import _check_listen
    from isolab.errors import InvalidRequestError

    with socket.socket() as v4:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        _check_listen("::", v4.getsockname()[1])
        _check_listen("::1", v4.getsockname()[1])
    with socket.socket(socket.AF_INET6) as v6:
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.bind(("::1", 0))
        v6.listen()
        with pytest.raises(InvalidRequestError, match=r"cannot listen on ::1:"):
            _check_listen("::1", v6.getsockname()[1])


def test_a_cuda_device_this_machine_lacks_is_one_sentence():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = isolab("generate", "hi", "--device", "cuda", timeout=60)
    assert out.returncode == 2 and "no CUDA device" in out.stderr and "Traceback" not in out.stderr


def test_a_kernel_isa_level_that_is_not_one_is_refused(tiny_path):
    import os

    out = subprocess.run([sys.executable, "-m", "isolab.cli", "generate", "hi", "--model", str(tiny_path)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "ISOLAB_KERNEL_ISA": "foo"})
    assert out.returncode == 2 and "ISOLAB_KERNEL_ISA='foo' is not a level" in out.stderr


def test_an_unwritable_cache_still_gets_the_native_kernels(tmp_path, tiny_path):
    """XDG_CACHE_HOME where no folder can be made (a file there; a read-only home does the same): the
    kernels are built for the process alone, not turned off."""
    import os

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING); from isolab import kernels; "
            "print(kernels.native_ready(), kernels.build_key())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "XDG_CACHE_HOME": str(blocker), "ISOLAB_WEIGHT_CACHE": "off"})
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split()[0] == "True" and "for this process only" in out.stderr


def test_a_build_error_counts_as_the_caches_only_on_or_above_its_folder(monkeypatch, tmp_path):
    """The private build starts where the cache folder, one inside it or one above it (a read-only
    home: mkdir fails on ~/.cache first) cannot be written, not for other errors (a compiler's)."""
    import errno

    from isolab import kernels

    root = tmp_path / "home" / ".cache" / "isolab" / "kernels"
    monkeypatch.setattr(kernels, "cache_root", lambda: root)
    for at, ours in ((root, True), (root / "isolab-kernels-x.so", True), (tmp_path / "home" / ".cache", True),
                     (tmp_path / "elsewhere" / "g++", False), (None, False)):
        exc = OSError(errno.EACCES, "Permission denied", None if at is None else str(at))
        assert kernels.cache_unwritable(exc) is ours, at


def test_bench_url_against_a_web_page_says_so_in_one_line(tmp_path):
    """A server that answers /v1/models with an HTML page (not an OpenAI-compatible one): one line
    naming it, not the page."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        out = isolab("bench", "--url", f"http://127.0.0.1:{web.server_address[1]}", "--num-requests", "1",
                     "--concurrency", "1", "--output-len", "2")
    finally:
        web.shutdown()
    one_sentence(out, "answered HTTP 404: an HTML page")
    assert "<html" not in out.stderr.lower()


def test_an_output_that_cannot_be_written_is_one_sentence(tiny_path):
    """stdout closed (`>&-`) was an AttributeError deep in print, and a full device (/dev/full) a traceback
    at exit; a closed pipe stays quiet (141)."""
    argv = [sys.executable, "-m", "isolab.cli", "generate", "1, 2, 3,", "--model", str(tiny_path), "--max-tokens", "8"]
    closed = subprocess.run(["sh", "-c", '"$@" >&-', "sh", *argv], stderr=subprocess.PIPE, text=True, timeout=180)
    assert closed.returncode == 2 and "standard output is closed" in closed.stderr and "Traceback" not in closed.stderr
    with open("/dev/full", "w") as full:
        out = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=180)
    assert out.returncode == 2 and "cannot write the output" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_prompt_that_is_not_utf8_says_so(tiny_path):
    """A command-line argument with a byte that is not UTF-8 reaches Python as U+DCxx (surrogateescape):
    it said 'a lone UTF-16 surrogate', which a shell user never typed."""
    out = subprocess.run([sys.executable, "-m", "isolab.cli", "generate", b"a\xffb", "--model", str(tiny_path),
                          "--max-tokens", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "not valid UTF-8 (byte 0xff)" in out.stderr, out.stderr
