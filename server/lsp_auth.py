"""Who may talk to `opencomposer serve --tcp`, and how a client on this machine finds
a running server and its token.

A TCP port is open to every local process, and a connection chooses the workspace,
the model and the approval policy (`approve: "all"`). So every TCP server makes a
random token (`secrets.token_urlsafe(32)`) and `lsp_transport.authenticate` accepts a
connection only if its first message is `initialize` with
`initializationOptions.token` equal to it (compared with `hmac.compare_digest`);
anything else gets one -32003 error and the connection is closed. stdio needs none:
only the process that started the server holds its pipes.

The server records itself in `$OPENCOMPOSER_HOME/servers/<port>.json` —
`{host, port, token, pid, model}`, mode 0600 in a 0700 folder — before it prints
`listening`, and removes the file when it stops. `token_for(port)` is how a client
gets the token: `OPENCOMPOSER_TOKEN` if set (a server under another home or on
another machine), else that file. `running_servers()` lists the live ones.

The server listens on loopback addresses only unless told `--allow-remote`: the
token and everything after it cross the network unencrypted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "OPENCOMPOSER_TOKEN"


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    host: str
    port: int
    token: str
    pid: int
    model: str | None = None


def home() -> Path:
    """`OPENCOMPOSER_HOME`, as the trace store reads it (the TUI may not import agent)."""
    return Path(os.environ.get("OPENCOMPOSER_HOME") or Path.home() / ".local/share/opencomposer")


def servers_dir() -> Path:
    return home() / "servers"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_server_file(info: ServerInfo) -> Path:
    """Record a listening server, readable by this user only; returns the file."""
    folder = servers_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / f"{info.port}.json"
    tmp = folder / f".{info.port}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(vars(info), f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_server_file(path: Path, token: str) -> None:
    """Remove the record, unless another server has written its own there since."""
    info = _read(path)
    if info is not None and info.token == token:
        path.unlink(missing_ok=True)


def token_for(port: int) -> str | None:
    """The token of the server on `port` of this machine: `OPENCOMPOSER_TOKEN`, or the
    record of a live server under `OPENCOMPOSER_HOME`."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    info = _read(servers_dir() / f"{port}.json")
    return info.token if info is not None and _alive(info.pid) else None


def running_servers() -> list[ServerInfo]:
    """The live servers recorded under `OPENCOMPOSER_HOME`, newest first."""
    folder = servers_dir()
    if not folder.is_dir():
        return []
    files = sorted(folder.glob("*.json"), key=_mtime, reverse=True)
    infos = (_read(p) for p in files)
    return [i for i in infos if i is not None and _alive(i.pid)]


def check_bind(host: str, *, allow_remote: bool) -> str | None:
    """Refuse (ValueError) a host that is not loopback unless `allow_remote`; with it,
    the warning to print."""
    loopback = is_loopback(host)
    if loopback is None or loopback:
        return None  # an unknown name: binding it fails with its own message
    if not allow_remote:
        raise ValueError(
            f"refusing to listen on {host or 'all interfaces'}: it is reachable from other "
            "machines and the token crosses the network unencrypted; use 127.0.0.1 (and an "
            "SSH tunnel), or pass --allow-remote"
        )
    return (
        f"listening on {host or 'all interfaces'}, reachable from other machines: the token "
        "and every message cross the network unencrypted"
    )


def is_loopback(host: str) -> bool | None:
    """True when every address `host` names is a loopback address; None when it names
    none ("" and 0.0.0.0 mean every interface)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return None
    return all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


def _read(path: Path) -> ServerInfo | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ServerInfo(
            host=str(data["host"]),
            port=int(data["port"]),
            token=str(data["token"]),
            pid=int(data["pid"]),
            model=data.get("model"),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
