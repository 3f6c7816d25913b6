"""The first process inside an attempt's sandbox: opens the sandbox's only ways out, then runs
the job's command and ends with it.

Usage (built by `bwrap.sandbox_argv`): `python -I -S init.py [--forward PORT=SOCKET ...] --
ARGV...`. Each `--forward` listens on 127.0.0.1:PORT inside the sandbox's own network namespace
and carries every connection to the Unix socket SOCKET, a door the controller opened to one
TCP target (the gateway, or an allowed egress; `egress.py`). Nothing else reaches the outside:
the namespace has no other interface.

The command runs as this process's child; its exit status is this process's (killed by a
signal N: 128 + N). When it ends, so does the sandbox: bubblewrap's pid 1 exits with us and
the kernel kills whatever else still runs in the pid namespace. Standard library only; no
site packages (`-S`), nothing of the environment that Python reads (`-I`).
"""

import os
import signal
import socket
import subprocess
import sys
import threading

_CHUNK = 65536


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, door: str) -> None:
    while True:
        conn, _ = listener.accept()
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            out.connect(door)
        except OSError as exc:
            print(f"harnessrl sandbox: the door {door} is closed ({exc})", file=sys.stderr,
                  flush=True)
            conn.close()
            out.close()
            continue
        threading.Thread(target=_pipe, args=(conn, out), daemon=True).start()
        threading.Thread(target=_pipe, args=(out, conn), daemon=True).start()


def main() -> int:
    args = sys.argv[1:]
    forwards = []
    while args and args[0] == "--forward":
        port_text, _, door = args[1].partition("=")
        forwards.append((int(port_text), door))
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    for port, door in forwards:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        threading.Thread(target=_serve, args=(listener, door), daemon=True).start()
    # A handler, not SIG_IGN (exec resets handlers): the job's SIGTERM reaches the command,
    # which decides; this process stays to report how it ended.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        child = subprocess.Popen(args)
    except OSError as exc:
        print(f"harnessrl: cannot execute {args[0]!r} in the sandbox: {exc}", file=sys.stderr,
              flush=True)
        return 127
    code = child.wait()
    sys.stdout.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    sys.exit(main())
