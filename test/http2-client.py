"""HTTP/2 clients the tests drive, speaking raw frames (hyperframe, hpack from
Debian's python3-h2) where a well-behaved client library would refuse to:

  rapid-reset PORT COUNT PATH   COUNT HEADERS each followed by RST_STREAM
  continuation PORT COUNT       one HEADERS, then COUNT CONTINUATION frames
  settings-flood PORT COUNT     COUNT SETTINGS frames, reading nothing
  refill PORT COUNT PATH        COUNT HEADERS, their RST_STREAMs a moment
                                later, then COUNT HEADERS more
  timed PORT PATH...            one stream for each PATH, sent at once: the
                                milliseconds until each one's reply began
  not-reading PORT COUNT PATH SECONDS
                                COUNT streams of PATH with the largest
                                windows, then nothing read for SECONDS
  idle PORT COUNT SECONDS       COUNT connections that send the preface and
                                their SETTINGS, then nothing, for SECONDS

Each prints one line of JSON: what it sent before the server closed the
connection, and the error code of the GOAWAY it received, if any.  Every
socket has a timeout: a run stops by itself.
"""

import json
import socket
import sys
import threading
import time

from hpack import Encoder
from hyperframe.frame import (ContinuationFrame, Frame, GoAwayFrame, HeadersFrame,
                              RstStreamFrame, SettingsFrame, WindowUpdateFrame)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PREFACE + SettingsFrame(0).serialize())
    return sock


def frames_of(sock):
    """The frames the server sends on SOCK, parsed, as they arrive, until it
    closes the connection or the socket times out."""
    buffer = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return
            buffer += data
            while len(buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
                if len(buffer) < 9 + length:
                    break
                frame.parse_body(memoryview(buffer[9:9 + length]))
                buffer = buffer[9 + length:]
                yield frame
    except OSError:
        return


class Reader(threading.Thread):
    """Reads the server's frames until it closes, keeping its GOAWAY's code."""

    def __init__(self, sock):
        super().__init__(daemon=True)
        self.sock = sock
        self.goaway = None
        self.closed = threading.Event()

    def run(self):
        for frame in frames_of(self.sock):
            if isinstance(frame, GoAwayFrame):
                self.goaway = frame.error_code
        self.closed.set()


def request_block(encoder, path, extra=()):
    return encoder.encode([(":method", "GET"), (":scheme", "http"), (":path", path),
                           (":authority", "127.0.0.1")] + list(extra))


def send_until_closed(sock, reader, batches):
    """Send each batch of octets until the server closes; the batches sent."""
    sent = 0
    for batch in batches:
        if reader.closed.is_set():
            break
        try:
            sock.sendall(batch)
        except OSError:
            break
        sent += 1
    return sent


def rapid_reset(port, count, path):
    sock = connect(port)
    reader = Reader(sock)
    reader.start()
    encoder = Encoder()

    def batches():
        for first in range(0, count, 100):
            octets = b""
            for i in range(first, min(count, first + 100)):
                stream = 2 * i + 1
                octets += HeadersFrame(stream, request_block(encoder, path),
                                       flags=["END_HEADERS", "END_STREAM"]).serialize()
                octets += RstStreamFrame(stream, error_code=8).serialize()
            yield octets

    sent = send_until_closed(sock, reader, batches())
    reader.closed.wait(10)
    sock.close()
    return {"pairs_sent": min(count, sent * 100), "goaway": reader.goaway, "closed": reader.closed.is_set()}


def refill(port, count, path):
    sock = connect(port)
    encoder = Encoder()
    octets = b"".join(HeadersFrame(2 * i + 1, request_block(encoder, path),
                                   flags=["END_HEADERS", "END_STREAM"]).serialize() for i in range(count))
    sock.sendall(octets)
    time.sleep(0.1)
    sock.sendall(b"".join(RstStreamFrame(2 * i + 1, error_code=8).serialize() for i in range(count)))
    sock.sendall(b"".join(HeadersFrame(2 * (count + i) + 1, request_block(encoder, path),
                                       flags=["END_HEADERS", "END_STREAM"]).serialize()
                          for i in range(count)))
    refused, answered = 0, 0
    sock.settimeout(5)
    for frame in frames_of(sock):
        if frame.stream_id > 2 * count:
            if isinstance(frame, RstStreamFrame) and frame.error_code == 7:
                refused += 1
            elif isinstance(frame, HeadersFrame):
                answered += 1
        if refused + answered >= count:
            break
    sock.close()
    return {"refused": refused, "answered": answered}


def timed(port, paths):
    sock = connect(port)
    encoder = Encoder()
    start = time.monotonic()
    sock.sendall(b"".join(HeadersFrame(2 * i + 1, request_block(encoder, path),
                                       flags=["END_HEADERS", "END_STREAM"]).serialize()
                          for i, path in enumerate(paths)))
    began = {}
    sock.settimeout(10)
    for frame in frames_of(sock):
        if isinstance(frame, HeadersFrame) and frame.stream_id not in began:
            began[frame.stream_id] = round((time.monotonic() - start) * 1000)
        if len(began) >= len(paths):
            break
    sock.close()
    return {"milliseconds": [began.get(2 * i + 1) for i in range(len(paths))]}


def not_reading(port, count, path, seconds):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    encoder = Encoder()
    sock.sendall(PREFACE + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}).serialize()
                 + WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535).serialize()
                 + b"".join(HeadersFrame(2 * i + 1, request_block(encoder, path),
                                         flags=["END_HEADERS", "END_STREAM"]).serialize() for i in range(count)))
    time.sleep(seconds)
    sock.close()
    return {"slept": seconds}


def continuation(port, count):
    sock = connect(port)
    reader = Reader(sock)
    reader.start()
    encoder = Encoder()
    head = HeadersFrame(1, request_block(encoder, "/"), flags=[]).serialize()

    def batches():
        yield head
        for first in range(0, count, 500):
            yield b"".join(ContinuationFrame(1, encoder.encode([("x-filler", "a" * 16)])).serialize()
                           for _ in range(first, min(count, first + 500)))

    sent = send_until_closed(sock, reader, batches())
    reader.closed.wait(10)
    sock.close()
    return {"continuations_sent": min(count, max(0, sent - 1) * 500), "goaway": reader.goaway,
            "closed": reader.closed.is_set()}


def settings_flood(port, count):
    sock = connect(port)
    frame = SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 100}).serialize()
    sent = 0
    sock.settimeout(5)
    try:
        for first in range(0, count, 1000):
            sock.sendall(frame * min(1000, count - first))
            sent = first + min(1000, count - first)
    except OSError:
        pass
    reader = Reader(sock)
    reader.start()
    reader.closed.wait(10)
    sock.close()
    return {"settings_sent": sent, "goaway": reader.goaway, "closed": reader.closed.is_set()}


def idle(port, count, seconds):
    sockets = [connect(port) for _ in range(count)]
    answered = 0
    for sock in sockets:
        sock.settimeout(10)
        if sock.recv(9):
            answered += 1
    print(json.dumps({"ready": count, "settings_received": answered}), flush=True)
    time.sleep(seconds)
    closed = 0
    for sock in sockets:
        sock.settimeout(0.01)
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    closed += 1
                    break
        except OSError:
            pass
        sock.close()
    return {"closed_by_server": closed}


def main(arguments):
    command, port = arguments[0], int(arguments[1])
    if command == "rapid-reset":
        result = rapid_reset(port, int(arguments[2]), arguments[3])
    elif command == "refill":
        result = refill(port, int(arguments[2]), arguments[3])
    elif command == "continuation":
        result = continuation(port, int(arguments[2]))
    elif command == "settings-flood":
        result = settings_flood(port, int(arguments[2]))
    elif command == "timed":
        result = timed(port, arguments[2:])
    elif command == "not-reading":
        result = not_reading(port, int(arguments[2]), arguments[3], float(arguments[4]))
    elif command == "idle":
        result = idle(port, int(arguments[2]), float(arguments[3]))
    else:
        raise SystemExit("unknown command " + command)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
