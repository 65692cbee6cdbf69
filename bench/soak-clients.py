"""The event-stream and websocket clients of bench/run memory's soak, for
SECONDS against the demo on PORT:

  soak-clients.py PORT SECONDS STREAMS SOCKETS

STREAMS event streams of the channel "soak", each read as fast as it comes,
and SOCKETS websockets of /ws/echo, each sending a 10,000-octet message and
reading its echo, again and again; meanwhile a message of 5,000 octets is
published to "soak" every 100 ms.  Prints one line of JSON: the events read
(each stream's count summed), the publishes the server took, the echoes
read, and the clients the server closed early.  Every socket has a timeout.
"""

import base64
import json
import os
import selectors
import socket
import sys
import time
import urllib.request


def open_stream(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /events?channel=soak HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.setblocking(False)
    return sock


def open_websocket(port):
    """A socket of /ws/echo whose handshake is sent; its reply is read as it
    comes, with the echoes, so that no handshake holds up the others."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(("GET /ws/echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % key).encode())
    sock.setblocking(False)
    return sock


def text_frame(payload):
    """A masked text frame of PAYLOAD (octets of at most 65,535)."""
    mask = os.urandom(4)
    masked = bytes(octet ^ mask[i % 4] for i, octet in enumerate(payload))
    return bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big") + mask + masked


def main(port, seconds, streams, sockets):
    end = time.monotonic() + seconds
    selector = selectors.DefaultSelector()
    counts = {"events": 0, "published": 0, "echoes": 0, "closed_early": 0}
    message = b"m" * 10000
    frame = text_frame(message)
    counts["not_opened"] = 0
    for _ in range(streams):
        if time.monotonic() >= end:
            break
        try:
            selector.register(open_stream(port), selectors.EVENT_READ, {"kind": "stream", "last": b""})
        except OSError:
            counts["not_opened"] += 1
    for _ in range(sockets):
        if time.monotonic() >= end:
            break
        try:
            selector.register(open_websocket(port), selectors.EVENT_READ,
                              {"kind": "websocket", "head": b"", "read": None})
        except OSError:
            counts["not_opened"] += 1
    next_publish = time.monotonic()
    while time.monotonic() < end:
        if time.monotonic() >= next_publish:
            next_publish += 0.1
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/publish?channel=soak&msg=%s"
                                            % (port, "p" * 5000), timeout=5) as reply:
                    reply.read()
                counts["published"] += 1
            except OSError:
                pass
        for key, _ in selector.select(timeout=0.05):
            try:
                data = key.fileobj.recv(1 << 20)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                counts["closed_early"] += 1
                selector.unregister(key.fileobj)
                key.fileobj.close()
                continue
            state = key.data
            if state["kind"] == "stream":
                text = state["last"] + data
                counts["events"] += text.count(b"\n\n")
                state["last"] = text[-1:]
            else:
                if state["read"] is None:
                    # The handshake's reply, then the first message is sent.
                    state["head"] += data
                    if b"\r\n\r\n" not in state["head"]:
                        continue
                    data = state["head"].split(b"\r\n\r\n", 1)[1]
                    state["read"] = 0
                    key.fileobj.setblocking(True)
                    key.fileobj.sendall(frame)
                    key.fileobj.setblocking(False)
                state["read"] += len(data)
                # Each echo is its frame's 4-octet head and the message.
                while state["read"] >= len(message) + 4:
                    state["read"] -= len(message) + 4
                    counts["echoes"] += 1
                    key.fileobj.setblocking(True)
                    key.fileobj.sendall(frame)
                    key.fileobj.setblocking(False)
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
