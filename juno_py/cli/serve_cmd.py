"""`juno-py serve`: an OpenAI-compatible HTTP server for the base model and named adapters (see docs/serve.md)."""

from __future__ import annotations

import socket

import click

from juno_py.cli.common import one_line_errors, say, warnings_to_stderr
from juno_py.cli.options import base_model_options


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), so the address is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise click.UsageError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


@click.command("serve")
@base_model_options
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    help="An adapter to serve: NAME=PATH, or PATH (named after the file, without .bin); repeat for more. "
    "A request's model field picks base, a NAME, or LoRAs combined with scales: a+b:0.5.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on (0: any free)."
)
@click.option(
    "--max-queue",
    default=256,
    show_default=True,
    type=click.IntRange(1),
    help="Requests that may wait for the model; beyond them a request gets 503.",
)
@one_line_errors
def serve(adapters, host, port, max_queue, **model_kw) -> None:
    """Serve the model and adapters over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    try:
        import uvicorn

        from juno_py.server import Engine, build_app
    except ImportError as e:
        raise click.ClickException(
            f"juno-py serve needs {e.name or 'starlette and uvicorn'}: pip install 'juno-py[serve]'"
        ) from None
    from juno_py.playback import Adapters, open_model, parse_named

    named = parse_named(adapters)
    force = model_kw.pop("force")
    model = open_model(**model_kw, announce=False)  # said on the address line, once every adapter is open
    with warnings_to_stderr():
        served = Adapters(model, named, force=force)
    engine = Engine(model, served, max_queue=max_queue)
    sock = bind(host, port)
    where = f"[{host}]" if ":" in host else host
    say(
        f"juno-py serve: http://{where}:{sock.getsockname()[1]}/v1 (models: {', '.join(served.names())}); "
        f"{model.resolution}"
    )
    config = uvicorn.Config(build_app(engine), log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then hands the signal on: that is the normal end
        pass
    say(f"juno-py serve: stopped after {engine.served} replies")
