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
  big-headers PORT COUNT OCTETS COUNT GET requests each with a header of
                                OCTETS octets, written at once
  uploads PORT COUNT OCTETS     COUNT POST streams of OCTETS octets each to
                                /test/digest, as fast as flow control lets
                                them go: how many replies name their body's
                                SHA-1
  downloads PORT COUNT KB TRIES [WINDOW]
                                COUNT streams of /test/bytes?kb=KB at once
                                with windows of WINDOW (the largest), read as
                                fast as they come, TRIES times, a connection
                                each
  hpack-bomb PORT COUNT         a 4,000-octet header put in the dynamic
                                table, then COUNT requests naming it 1,000
                                times each
  empty-frames PORT COUNT       COUNT empty DATA frames on an open stream
  priority-flood PORT COUNT     COUNT PRIORITY frames
  statuses PORT PATH...         one stream for each PATH, sent at once: the
                                status each got, or "refused" for a
                                REFUSED_STREAM, and the GOAWAY's code
  events PORT CONNECTIONS STREAMS PATH COUNT SECONDS
                                STREAMS event streams of PATH on each of
                                CONNECTIONS connections, read until each
                                has the events m0 .. m(COUNT-1) in order, or
                                for SECONDS: how many streams did

Each prints one line of JSON: what it sent before the server closed the
connection, and the error code of the GOAWAY it received, if any.  Every
socket has a timeout: a run stops by itself.
"""

import hashlib
import json
import select
import socket
import sys
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.settings
from hpack import Encoder
from hyperframe.frame import (ContinuationFrame, DataFrame, Frame, GoAwayFrame, HeadersFrame,
                              PriorityFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame)

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


def big_headers(port, count, octets):
    sock = connect(port)
    encoder = Encoder()
    value = "v" * octets
    sock.sendall(b"".join(HeadersFrame(2 * i + 1, request_block(encoder, "/test/yo", [("x-big", value)]),
                                       flags=["END_HEADERS", "END_STREAM"]).serialize()
                          for i in range(count)))
    answered, goaway = 0, None
    sock.settimeout(20)
    for frame in frames_of(sock):
        if isinstance(frame, HeadersFrame):
            answered += 1
        elif isinstance(frame, GoAwayFrame):
            goaway = frame.error_code
            break
        if answered >= count:
            break
    sock.close()
    return {"answered": answered, "goaway": goaway}


class Client:
    """A well-behaved client connection (python3-h2): flow control, windows
    of SIZE, the server's frames read until every stream asked has ended."""

    def __init__(self, port, window=65535):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                         header_encoding="latin-1"))
        self.conn.initiate_connection()
        if window > 65535:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            self.conn.increment_flow_control_window(window - 65535)
        self.flush()
        self.bodies, self.status, self.headers, self.ended, self.reset = {}, {}, {}, set(), set()
        self.goaway, self.closed = None, False

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, path, method="GET", end=True):
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", method), (":scheme", "http"), (":path", path),
                                        (":authority", "127.0.0.1")], end_stream=end)
        self.bodies[stream] = []
        return stream

    def receive(self):
        """Read what the server sent, and answer it; raises socket.timeout."""
        try:
            data = self.sock.recv(1 << 20)
        except socket.timeout:
            raise
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                self.status[event.stream_id] = dict(event.headers).get(":status")
                self.headers[event.stream_id] = event.headers
            elif isinstance(event, h2.events.DataReceived):
                self.bodies[event.stream_id].append(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.reset.add(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = event.error_code
        self.flush()

    def done(self):
        return self.closed or self.goaway is not None or len(self.ended) + len(self.reset) >= len(self.bodies)

    def body(self, stream):
        return b"".join(self.bodies[stream])


def upload_octets(index, octets):
    seed = hashlib.sha1(str(index).encode()).digest()
    return (seed * (octets // len(seed) + 1))[:octets]


def uploads(port, count, octets):
    client = Client(port)
    payloads = {}
    for i in range(count):
        stream = client.request("/test/digest", "POST", end=False)
        payloads[stream] = (upload_octets(i, octets), 0)
    client.flush()
    client.sock.setblocking(False)
    while not client.done():
        for stream, (payload, sent) in list(payloads.items()):
            if sent < len(payload) and stream not in client.reset:
                room = min(client.conn.local_flow_control_window(stream), client.conn.max_outbound_frame_size)
                if room > 0:
                    chunk = payload[sent:sent + room]
                    client.conn.send_data(stream, chunk, end_stream=sent + len(chunk) == len(payload))
                    payloads[stream] = (payload, sent + len(chunk))
        try:
            client.flush()
        except BlockingIOError:
            pass
        try:
            client.sock.settimeout(0.05)
            client.receive()
        except socket.timeout:
            pass
    right = sum(1 for stream, (payload, _) in payloads.items()
                if client.body(stream).decode() == hashlib.sha1(payload).hexdigest())
    client.sock.close()
    return {"right": right, "reset": len(client.reset), "goaway": client.goaway,
            "closed_without_goaway": client.closed and client.goaway is None}


def expected_bytes(kb):
    return bytes(i % 251 for i in range(kb * 1024))


def downloads(port, count, kb, tries, window=2**31 - 1):
    expected = hashlib.sha1(expected_bytes(kb)).hexdigest()
    complete, short, reset, goaways, silent = 0, 0, 0, 0, 0
    for _ in range(tries):
        client = Client(port, window=window)
        streams = [client.request("/test/bytes?kb=%d" % kb) for _ in range(count)]
        client.flush()
        while not client.done():
            client.receive()
        for stream in streams:
            if stream in client.ended and hashlib.sha1(client.body(stream)).hexdigest() == expected:
                complete += 1
            elif stream in client.reset:
                reset += 1
            else:
                short += 1
        goaways += client.goaway is not None
        silent += client.closed and client.goaway is None
        client.sock.close()
    return {"complete": complete, "short": short, "reset": reset, "goaways": goaways,
            "closed_without_goaway": silent}


def flood(port, frames, batch):
    """Send FRAMES, an iterator of octets, in batches of BATCH, until the
    server closes: the frames sent, the GOAWAY's code, the seconds taken."""
    sock = connect(port)
    reader = Reader(sock)
    reader.start()
    start = time.monotonic()

    def batches():
        chunk = []
        for frame in frames:
            chunk.append(frame)
            if len(chunk) >= batch:
                yield b"".join(chunk)
                chunk = []
        if chunk:
            yield b"".join(chunk)

    sent = send_until_closed(sock, reader, batches())
    reader.closed.wait(10)
    sock.close()
    return {"frames_sent": sent * batch, "goaway": reader.goaway, "closed": reader.closed.is_set(),
            "seconds": round(time.monotonic() - start, 3)}


def hpack_bomb(port, count):
    encoder = Encoder()
    big = ("x-bomb", "b" * 4000)

    def frames():
        # The first request puts the header in the dynamic table; each
        # later one names it by its index, an octet each, 1,000 times.
        yield HeadersFrame(1, request_block(encoder, "/test/yo", [big]),
                           flags=["END_HEADERS", "END_STREAM"]).serialize()
        for i in range(1, count):
            block = request_block(encoder, "/test/yo", [big] * 1000)
            yield HeadersFrame(2 * i + 1, block, flags=["END_HEADERS", "END_STREAM"]).serialize()

    return flood(port, frames(), 10)


def empty_frames(port, count):
    encoder = Encoder()

    def frames():
        yield HeadersFrame(1, encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/test/body"),
                                              (":authority", "127.0.0.1")]),
                           flags=["END_HEADERS"]).serialize()
        empty = DataFrame(1, b"").serialize()
        for _ in range(count):
            yield empty

    return flood(port, frames(), 10000)


def priority_flood(port, count):
    frame = PriorityFrame(3, depends_on=1, stream_weight=16).serialize()
    return flood(port, (frame for _ in range(count)), 10000)


def statuses(port, paths):
    client = Client(port)
    streams = [client.request(path) for path in paths]
    client.flush()
    while not client.done():
        client.receive()
    client.sock.close()
    return {"statuses": [client.status.get(stream) or ("refused" if stream in client.reset else None)
                         for stream in streams],
            "retry_after": [dict(client.headers.get(stream, [])).get("retry-after") for stream in streams],
            "goaway": client.goaway}


def events(port, connections, streams, path, count, seconds):
    clients = [Client(port) for _ in range(connections)]
    for client in clients:
        for _ in range(streams):
            client.request(path)
        client.flush()
    expected = ["data: m%d" % index for index in range(count)]

    def complete(client, stream):
        lines = client.body(stream).decode("utf-8").split("\n")
        return [line for line in lines if line.startswith("data: m")] == expected

    deadline = time.time() + seconds
    while time.time() < deadline:
        if all(complete(client, stream) for client in clients for stream in client.bodies):
            break
        ready, _, _ = select.select([client.sock for client in clients if not client.closed], [], [], 0.5)
        for client in clients:
            if client.sock in ready:
                client.receive()
    return {"streams": sum(len(client.bodies) for client in clients),
            "complete": sum(1 for client in clients for stream in client.bodies if complete(client, stream)),
            "reset": sum(len(client.reset) for client in clients)}


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
    elif command == "big-headers":
        result = big_headers(port, int(arguments[2]), int(arguments[3]))
    elif command == "uploads":
        result = uploads(port, int(arguments[2]), int(arguments[3]))
    elif command == "downloads":
        result = downloads(port, int(arguments[2]), int(arguments[3]), int(arguments[4]),
                           *[int(window) for window in arguments[5:6]])
    elif command == "hpack-bomb":
        result = hpack_bomb(port, int(arguments[2]))
    elif command == "empty-frames":
        result = empty_frames(port, int(arguments[2]))
    elif command == "priority-flood":
        result = priority_flood(port, int(arguments[2]))
    elif command == "statuses":
        result = statuses(port, arguments[2:])
    elif command == "events":
        result = events(port, int(arguments[2]), int(arguments[3]), arguments[4], int(arguments[5]),
                        float(arguments[6]))
    else:
        raise SystemExit("unknown command " + command)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
