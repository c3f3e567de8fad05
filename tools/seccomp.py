"""The sandbox's seccomp filter: no UNIX-domain socket can be opened, so no host socket
(docker.sock, an editor's IPC socket, an SSH or GPG agent) can be reached.

bubblewrap loads it with `--seccomp FD`, where FD holds a classic BPF program (an
array of `struct sock_filter`) built here with `struct`, without libseccomp.

Why these rules:

- A pathname socket on the host is reached with `connect()` (or `sendto()`) on an
  AF_UNIX socket. A filter cannot read the address behind connect's pointer
  argument, nor the family of the socket behind its fd, so the rule is placed where
  the family *is* an argument: `socket(AF_UNIX, …)` fails with EPERM. Abstract
  sockets are per network namespace, which the sandbox already unshares.
- `socketpair()` never touches the file system and is how subprocess pipes,
  asyncio and multiprocessing's fork and spawn methods talk, so it stays allowed for
  SOCK_STREAM and SOCK_SEQPACKET. A SOCK_DGRAM pair could be re-pointed at a host
  datagram socket (`connect`/`sendto` with an address), so that type is refused.
- io_uring can create and connect sockets without passing through these syscalls,
  so `io_uring_setup/enter/register` fail with ENOSYS (libraries fall back to
  plain syscalls).
- 32-bit x86 processes reach sockets through `socketcall()`, whose arguments sit
  behind a pointer: refused whole. x32 numbers are folded onto x86-64's. A process
  of any architecture not listed below is killed.

Cost: the filter is a few dozen instructions per syscall, nothing measurable.

What it breaks: programs that create AF_UNIX sockets inside the sandbox (a test
suite serving on a socket file, Python's `forkserver` start method, syslog).
"""

from __future__ import annotations

import errno
import functools
import platform
import socket
import struct
from dataclasses import dataclass

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

# struct seccomp_data offsets (little-endian: an argument's low word comes first;
# the kernel reads int arguments from the low 32 bits only)
_NR, _ARCH = 0, 4


def _arg(i: int) -> int:
    return 16 + 8 * i


_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000


def _errno(e: int) -> int:
    return 0x00050000 | e


_X32_BIT = 0x40000000
_SOCK_TYPE_MASK = 0xF


@dataclass(frozen=True)
class _Arch:
    """One syscall ABI a process on this machine may use."""

    audit: int  # AUDIT_ARCH_* as seccomp_data.arch reports it
    socket: int
    socketpair: int
    socketcall: int | None = None  # the multiplexer, where the ABI has one
    nr_mask: int | None = None  # folded into the syscall number first


_IO_URING = (425, 426, 427)  # setup, enter, register: the same on every ABI here
_ARCHES = (
    _Arch(0xC000003E, socket=41, socketpair=53, nr_mask=~_X32_BIT & 0xFFFFFFFF),  # x86-64, x32
    _Arch(0x40000003, socket=359, socketpair=360, socketcall=102),  # i386
    _Arch(0xC00000B7, socket=198, socketpair=199),  # aarch64
    _Arch(0x40000028, socket=281, socketpair=288),  # arm (EABI, no socketcall)
    _Arch(0xC00000F3, socket=198, socketpair=199),  # riscv64
)
_NATIVE = {"x86_64", "aarch64", "arm64", "riscv64"}


class _Asm:
    """A tiny assembler: jumps name labels, resolved to the relative offsets BPF wants."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | None, str | None, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def op(self, code: int, k: int) -> None:
        self.code.append((code, None, None, k))

    def jeq(self, k: int, true: str, false: str | None = None) -> None:
        self.code.append((_JEQ_K, true, false, k))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self.code):

            def rel(target: str | None, pc: int = pc) -> int:
                if target is None:
                    return 0  # fall through
                offset = self.labels[target] - pc - 1
                assert 0 <= offset < 256, "seccomp jump out of range"
                return offset

            out += struct.pack("<HBBI", code, rel(jt), rel(jf), k & 0xFFFFFFFF)
        return bytes(out)


@functools.cache
def unix_socket_filter() -> bytes | None:
    """The compiled filter for this machine, or None on an architecture it does not know."""
    if platform.machine() not in _NATIVE:
        return None
    a = _Asm()
    a.op(_LD_W_ABS, _ARCH)
    for arch in _ARCHES:
        a.jeq(arch.audit, f"arch{arch.audit}")
    a.op(_RET_K, _KILL_PROCESS)
    for arch in _ARCHES:
        a.label(f"arch{arch.audit}")
        a.op(_LD_W_ABS, _NR)
        if arch.nr_mask is not None:
            a.op(_ALU_AND_K, arch.nr_mask)
        a.jeq(arch.socket, "socket")
        a.jeq(arch.socketpair, "socketpair")
        for nr in _IO_URING:
            a.jeq(nr, "enosys")
        if arch.socketcall is not None:
            a.jeq(arch.socketcall, "eperm")
        a.op(_RET_K, _ALLOW)
    a.label("socket")
    a.op(_LD_W_ABS, _arg(0))
    a.jeq(socket.AF_UNIX, "eperm")
    a.op(_RET_K, _ALLOW)
    a.label("socketpair")
    a.op(_LD_W_ABS, _arg(1))
    a.op(_ALU_AND_K, _SOCK_TYPE_MASK)
    a.jeq(socket.SOCK_STREAM, "allow")
    a.jeq(socket.SOCK_SEQPACKET, "allow")
    a.label("eperm")
    a.op(_RET_K, _errno(errno.EPERM))
    a.label("enosys")
    a.op(_RET_K, _errno(errno.ENOSYS))
    a.label("allow")
    a.op(_RET_K, _ALLOW)
    return a.assemble()
