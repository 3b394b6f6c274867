"""`juno-py local`'s chat on a terminal: readline line editing, and the input history kept across chats in
$JUNO_PY_HOME/chat_history. Driven through a pseudo-terminal, as a user's shell would run it."""

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from juno_py.testing.tiny_models import write_tiny_gguf

pytest.importorskip("readline")


def chat(model, home, keys: list[bytes], timeout=120.0) -> tuple[int, bytes]:
    """Run the chat on a pseudo-terminal, typing each of `keys` once the prompt shows; (exit status, output)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "JUNO_PY_HOME": str(home), "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    args = ["local", "--model-path", str(model), "--max-tokens", "2", "--temperature", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "juno_py", *args], stdin=follower, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    out, pending, deadline = b"", list(keys), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if pending and out.rstrip().endswith(b">"):
                    os.write(leader, pending.pop(0))
            if proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return proc.returncode, out


def test_chat_keeps_history_and_edits_lines(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", seed=3)
    home = tmp_path / "home"
    code, out = chat(model, home, [b"hello there\r", b"/exit\r"])
    assert code == 0, out.decode(errors="replace")
    history = (home / "chat_history").read_text().splitlines()
    assert history[-2:] == ["hello there", "/exit"]
    # a new chat recalls the last line with the up arrow (ESC [ A): it is /exit again, so the chat ends; without
    # line editing the line would be the escape code itself, answered as a message, and the chat would go on
    code, out = chat(model, home, [b"\x1b[A\r"], timeout=60)
    assert code == 0, out.decode(errors="replace")
    assert (home / "chat_history").read_text().splitlines()[-1] == "/exit"
