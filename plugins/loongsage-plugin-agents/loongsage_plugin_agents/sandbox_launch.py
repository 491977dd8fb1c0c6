"""The first program of every ``local`` sandbox command, inside the isolation (run ``python -I -S``).

Usage: ``python -I -S sandbox_launch.py CONFIG_JSON PROGRAM [ARGS...]``. It imports nothing from
LoongSage (it runs as the sandbox's user, before anything of the command), then:

1. brings the loopback interface up when the command has its own network namespace without it
   (``unshare -n``; bubblewrap does this itself);
2. when ``bridge`` is set, listens on ``127.0.0.1:<port>`` inside the namespace and relays each
   connection to a Unix socket the host serves, which leads to the router and nowhere else: a
   black-box agent reaches its endpoint at the same URL, and nothing else on the network;
3. sets the resource limits (``RLIMIT_*``; ``nproc`` counts on top of what its user already runs);
4. runs the program (``exec``, or as a child when the bridge must stay up) and exits with its status.
"""

import fcntl
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def serve_bridge(port: int, path: str) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(path)
            except OSError:
                conn.close()
                upstream.close()
                continue
            threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def own_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def main() -> int:
    config = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    if config.get("loopback_up"):
        loopback_up()
    bridge = config.get("bridge")
    if bridge:
        serve_bridge(int(bridge["port"]), str(bridge["socket"]))
    for name, value in config.get("rlimits", {}).items():
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    if config.get("nproc") is not None:
        limit = own_processes() + int(config["nproc"])
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    try:
        if not bridge:
            os.execvp(argv[0], argv)
        code = subprocess.call(argv)
    except OSError as exc:
        hidden = " and it must not be under /tmp, which is the sandbox's own" if argv[0].startswith("/tmp/") else ""
        print(f"sandbox: cannot run {argv[0]}: {exc.strerror} (the sandbox's user, uid {os.getuid()}, must be able "
              f"to execute it and reach its directory{hidden})", file=sys.stderr)
        return 126 if isinstance(exc, PermissionError) else 127
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
