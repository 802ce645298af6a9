"""Chat templates rendered in a child process under hard limits: a template is user data, and a single C call
(`([a]*1000)|sum(start=[])`) can outrun any check the sandbox makes between bytecodes.

One worker process per posfreq process, started on first use and again after a limit stopped it. It sets its
limits with `resource` before it reads a request: address space (MEMORY_BYTES beyond what it started with) and,
before each render, CPU time (CPU_SECONDS more than it has used). Requests and replies are length-prefixed JSON on
its stdin and stdout; the parent also bounds the wall-clock time and the reply's size.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import struct
import subprocess
import sys
import threading
from pathlib import Path

MEMORY_BYTES = 1 << 30
"""Address space a worker may add to what it starts with (RLIMIT_AS)."""
CPU_SECONDS = 4
"""CPU seconds one render may use (RLIMIT_CPU, raised by this much before each render)."""
WALL_SECONDS = 30
"""Wall-clock seconds the parent waits for one render (a worker asleep uses no CPU)."""
MAX_REPLY_BYTES = 64 << 20
"""The largest reply the parent reads (a render is at most TEMPLATE_CHARS characters)."""
FIX = "Fix: use a model whose chat template renders one user turn, or --chat-template false"

_HEADER = struct.Struct("!Q")
_LOCK = threading.Lock()
_WORKER: subprocess.Popen | None = None


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    source: str = "the chat template",
    **variables: str,
) -> str:
    """Render a Hugging Face chat template (user data) with the generation prompt in a child process under hard
    limits (this module: address space, CPU time and output, set with `resource` before it renders
    anything), beside the sandbox's own checks (`sandbox.render_here`). A limit reached, a template that fails or one that
    overflows is one ValueError naming `source` (its file) and the limit."""
    return render_in_worker(template, messages, add_generation_prompt, variables, source)


def render_in_worker(
    template: str, messages: list[dict], add_generation_prompt: bool, variables: dict, source: str
) -> str:
    """The rendered text, or ValueError naming `source` and what stopped it (a limit, or the sandbox's refusal)."""
    request = json.dumps(
        {
            "template": template,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "variables": variables,
        }
    ).encode()
    with _LOCK:  # one request at a time per worker
        worker = _worker()
        try:
            _send(worker.stdin, request)
            reply = _receive(worker.stdout, WALL_SECONDS)
        except (BrokenPipeError, EOFError, TimeoutError, ValueError) as err:
            _stop()
            raise ValueError(
                f"{source}: rendering was stopped by {_stopped_by(worker, err)}; refusing it. {FIX}"
            ) from None
    answer = json.loads(reply)
    if "error" in answer:
        raise ValueError(f"{source}: {answer['error']}. {FIX}")
    return answer["text"]


def _worker() -> subprocess.Popen:
    """The running worker, started when there is none (or the last one was stopped)."""
    global _WORKER
    if _WORKER is None or _WORKER.poll() is not None:
        _WORKER = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from posfreq.train.data.chat_template.render import serve; serve({MEMORY_BYTES})",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        atexit.register(_stop)  # the worker ends with this process, its pipes closed
    return _WORKER


def _stop() -> None:
    """Kill the worker (a limit reached or a wait ended): the next request starts a fresh one."""
    global _WORKER
    if _WORKER is not None:
        _WORKER.kill()
        _WORKER.wait()
        for stream in (_WORKER.stdin, _WORKER.stdout):
            stream.close()
        _WORKER = None


def _stopped_by(worker: subprocess.Popen, err: Exception) -> str:
    """What ended a render, in words, for the error line."""
    if isinstance(err, TimeoutError):
        return f"its wall-clock limit ({WALL_SECONDS} s)"
    code = worker.poll()
    if code == -24:  # SIGXCPU
        return f"its CPU time limit ({CPU_SECONDS} s)"
    return f"a hard limit ({MEMORY_BYTES >> 20} MiB of memory, {CPU_SECONDS} s of CPU; the worker ended with {code})"


def _send(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _receive(stream, timeout: float | None) -> bytes:
    """One length-prefixed message from `stream`: EOFError at its end, TimeoutError past `timeout` seconds,
    ValueError for a length beyond MAX_REPLY_BYTES."""
    size = _HEADER.unpack(_read_exactly(stream, _HEADER.size, timeout))[0]
    if size > MAX_REPLY_BYTES:
        raise ValueError(f"a reply of {size:,} bytes")
    return _read_exactly(stream, size, timeout)


def _read_exactly(stream, size: int, timeout: float | None) -> bytes:
    fd, chunks, left = stream.fileno(), [], size
    while left:
        if timeout is not None and not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(memory_bytes: int = MEMORY_BYTES) -> None:
    """The worker: set the memory limit (`memory_bytes` beyond its start), then render each request under a fresh
    CPU limit until stdin ends."""
    import resource

    from posfreq.train.data.chat_template.sandbox import render_here

    start = _address_space()
    if start is not None:
        resource.setrlimit(resource.RLIMIT_AS, (start + memory_bytes, start + memory_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            request = json.loads(_receive(stdin, None))
        except EOFError:
            return
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime) + CPU_SECONDS
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
        try:
            text = render_here(
                request["template"],
                request["messages"],
                request["add_generation_prompt"],
                **request["variables"],
            )
            reply = {"text": text}
        except MemoryError:
            reply = {
                "error": f"rendering needed more than its {memory_bytes >> 20} MiB memory limit"
            }
        except ValueError as err:
            reply = {"error": str(err)}
        _send(stdout, json.dumps(reply).encode())


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (Linux's /proc/self/status VmSize), or None where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
