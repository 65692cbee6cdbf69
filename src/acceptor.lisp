;;;; The acceptor family: Hunchentoot's four acceptors with a
;;;; RECYCLING-TASKMASTER by default, their initargs and their checks.
;;;; Starting, stopping and abandoning them is pool/lifecycle.lisp.

(in-package #:hunchentoot-recycling-taskmaster)

(defgeneric acceptor-header-timeout (acceptor)
  (:documentation "Seconds a request head may take to arrive before ACCEPTOR
answers 408."))

(defgeneric acceptor-keep-alive-timeout (acceptor)
  (:documentation "Seconds ACCEPTOR keeps an idle kept-alive connection open."))

(defgeneric acceptor-queue-timeout (acceptor)
  (:documentation "Seconds a complete request may wait for a free worker of
ACCEPTOR before it is answered 503 with Retry-After."))

(defgeneric acceptor-reuse-port-p (acceptor)
  (:documentation "True when ACCEPTOR listens with SO_REUSEPORT, sharing its
port with other sockets that do."))

(defgeneric acceptor-listen-fd (acceptor)
  (:documentation "The inherited listening descriptor ACCEPTOR serves, or
NIL when it makes its own listening socket."))

(defgeneric acceptor-defer-accept-p (acceptor)
  (:documentation "True when ACCEPTOR's listening socket hands over a
connection only once its client has sent something."))

(defgeneric acceptor-body-buffer-bytes (acceptor)
  (:documentation "The octets of a request body ACCEPTOR keeps in memory
while the body arrives; the rest goes to a temporary file."))

(defgeneric acceptor-max-body-bytes (acceptor)
  (:documentation "The largest request body ACCEPTOR takes, or NIL for no
limit; a larger one gets 413."))

(defgeneric acceptor-max-header-bytes (acceptor)
  (:documentation "The largest header block ACCEPTOR answers; a larger one
gets 431."))

(defgeneric acceptor-max-websocket-message-bytes (acceptor)
  (:documentation "The largest websocket message ACCEPTOR takes, in octets;
a client sending a larger one is closed with 1009."))

(defgeneric acceptor-max-websocket-queue-bytes (acceptor)
  (:documentation "The octets sent to one websocket client that ACCEPTOR
keeps while its socket takes none; a client past them is closed with 1008."))

(defgeneric acceptor-websocket-ping-interval (acceptor)
  (:documentation "Seconds of silence from a websocket client after which
ACCEPTOR pings it."))

(defgeneric acceptor-websocket-timeout (acceptor)
  (:documentation "Seconds a websocket client may send nothing, pongs
included, before ACCEPTOR closes it with 1001."))

(defgeneric acceptor-websocket-message-timeout (acceptor)
  (:documentation "Seconds a websocket message may take from its first
octet to its last before ACCEPTOR closes its client with 1008."))

(defgeneric acceptor-memory-budget (acceptor)
  (:documentation "The octets ACCEPTOR's engine may hold on behalf of
clients, or NIL when it shares the process's budget, a quarter of the
dynamic space."))

(defgeneric acceptor-http2-max-running-streams (acceptor)
  (:documentation "The most streams of one HTTP/2 connection of ACCEPTOR's
whose handlers run at once."))

(defgeneric acceptor-session-store (acceptor)
  (:documentation "The SESSION-STORE keeping ACCEPTOR's sessions, or NIL when
they are Hunchentoot's own, in the process."))

(defgeneric acceptor-sessions (acceptor)
  (:documentation "Where ACCEPTOR's sessions live, which each of
Hunchentoot's session generic functions asks (acceptor-sessions.lisp): its
SESSION-STORE, or an IN-PROCESS-SESSIONS."))

(defgeneric acceptor-session-store-timeout (acceptor)
  (:documentation "Seconds a request may wait for ACCEPTOR's session store
before it is answered 503."))

(defclass static-document-root (hunchentoot:acceptor)
  ((dispatch-chain
    :initform nil :accessor acceptor-dispatch-chain
    :documentation "The ACCEPTOR-DISPATCH-REQUEST methods that run after
this class's, a DISPATCH-ANSWER kept while the generic function's methods
stay the same (dispatch-answers.lisp)."))
  (:documentation "Serves the acceptor's HUNCHENTOOT:ACCEPTOR-DOCUMENT-ROOT
by SERVE-STATIC-FILE (document-root.lisp) where Hunchentoot's last
ACCEPTOR-DISPATCH-REQUEST method would serve it by HANDLE-STATIC-FILE,
wherever this class falls in the precedence list.  Placed after
HUNCHENTOOT:EASY-ACCEPTOR in the parallel acceptors' lists only so that a
request an easy handler answers does not pass through its method."))

(defclass parallel-acceptor (static-document-root)
  ((header-timeout
    :initarg :header-timeout :reader acceptor-header-timeout
    :documentation "Seconds a request head (request line and headers) may
take to arrive, counted from the connection's accept or from the head's
first byte; then the client gets 408 and the connection is closed.")
   (keep-alive-timeout
    :initarg :keep-alive-timeout :reader acceptor-keep-alive-timeout
    :documentation "Seconds a kept-alive connection may wait for its next
request before it is closed.")
   (queue-timeout
    :initarg :queue-timeout :reader acceptor-queue-timeout
    :documentation "Seconds a request whose head has arrived may wait for a
free worker, when every worker the pool may have is busy; then the client
gets 503 with Retry-After (these seconds, rounded up) and the connection
is closed.  The header timeout ends when the head is complete.")
   (reuse-port
    :initarg :reuse-port :reader acceptor-reuse-port-p
    :documentation "When true, listen with SO_REUSEPORT: several processes
(or acceptors) bound so to one address and port each take a share of its
connections, spread by the kernel, and a new process can start listening
before the old one stops.")
   (listen-fd
    :initarg :listen-fd :reader acceptor-listen-fd
    :documentation "A descriptor that already listens, inherited from a
supervisor (systemd's socket activation passes the first as 3), served
instead of a socket of the acceptor's own; :ADDRESS and :PORT are then
ignored, and the port is read from the socket.  STOP and ABANDON-ACCEPTOR
never close it: it stays the supervisor's, listening, for the next START
or the next process.  It is left non-blocking.")
   (defer-accept
    :initarg :defer-accept :reader acceptor-defer-accept-p
    :documentation "When true (the default), the listening socket, its own
or inherited, is set TCP_DEFER_ACCEPT, as Apache httpd sets it on Linux and
nginx's listen ... deferred: the kernel hands a connection over only once
its client has sent something, so that the accept finds the request head
(or TLS ClientHello) already there instead of parking the connection until
it comes (bench/profiles/2026-11-25-deferred-accept.txt).  A
client that connects and sends nothing costs no worker and no slot until
the kernel's deferral for HEADER-TIMEOUT seconds ends (rounded up to a
SYN-ACK retransmission: 15 s for 10); it is then handed over, and gets the
header timeout from there.  NIL for clients that wait for the server to
speak first, which HTTP clients never do.")
   (body-buffer-bytes
    :initarg :body-buffer-bytes :reader acceptor-body-buffer-bytes
    :documentation "The octets of a Content-Length request body kept in
memory while the engine reads it, before it is dispatched; a larger body
goes on in a file in HUNCHENTOOT:*TMP-DIRECTORY*, removed after the
request.")
   (max-body-bytes
    :initarg :max-body-bytes :reader acceptor-max-body-bytes
    :documentation "The largest request body taken, in octets, or NIL for
no limit.  A Content-Length over it is answered 413 before any of the body
is read (before 100 Continue, too); a chunked body is answered 413 once its
chunks add up to more, unless the handler has begun its reply.  The
connection is closed after the 413.")
   (max-header-bytes
    :initarg :max-header-bytes :reader acceptor-max-header-bytes
    :documentation "The largest header block (the lines after the request
line) answered; a larger one gets 431.  A request line over 8 KiB gets 414,
more than 100 header lines 431.")
   (max-websocket-message-bytes
    :initarg :max-websocket-message-bytes :reader acceptor-max-websocket-message-bytes
    :documentation "The largest websocket message taken, in octets, its
fragments together; a client sending a larger one is closed with 1009
(Message Too Big) as soon as a frame head announces it.")
   (max-websocket-queue-bytes
    :initarg :max-websocket-queue-bytes :reader acceptor-max-websocket-queue-bytes
    :documentation "The octets sent to one websocket client that wait for
its socket to take them; a send past them closes the client with 1008
(Policy Violation) instead of waiting, so that a client that does not read
never holds up a broadcast to the others.  A client that takes none of what
waits for HUNCHENTOOT:ACCEPTOR-WRITE-TIMEOUT is closed the same way.")
   (websocket-ping-interval
    :initarg :websocket-ping-interval :reader acceptor-websocket-ping-interval
    :documentation "Seconds a websocket client may be silent before the
server pings it, so that a client gone without a word is found, and
proxies keep an idle websocket open.")
   (websocket-timeout
    :initarg :websocket-timeout :reader acceptor-websocket-timeout
    :documentation "Seconds a websocket client may send nothing, not even
the pong to a ping, before it is closed with 1001 (Going Away).  A client
that answers pings stays open however long it is idle.")
   (websocket-message-timeout
    :initarg :websocket-message-timeout :reader acceptor-websocket-message-timeout
    :documentation "Seconds a websocket message may take to arrive whole,
from its first octet to its last, its frames together; a client still
sending one then is closed with 1008, however it trickles.")
   (memory-budget
    :initarg :memory-budget :reader acceptor-memory-budget
    :documentation "The octets the engine may hold on behalf of clients:
what waits for a client that reads slowly (the engine's copies of the
rest of a reply, websocket frames), websocket messages and request heads
that have partly arrived, request bodies kept in memory.  NIL (the
default): the budget every acceptor of the process shares, a quarter of
SB-EXT:DYNAMIC-SPACE-SIZE.  A buffer that would pass it is not made: the
websocket that needed it is closed 1013 (Try Again Later), a request body
goes to its file; while the copies and heads counted as they came pass
it, new requests get 503.  Until use falls below three quarters of it,
the parked connections holding the most are closed (websockets with
1008).  Logged once an episode, counted in TASKMASTER-STATISTICS.")
   (compression
    :initarg :compression :reader acceptor-compression
    :documentation "The content codings replies may get, the server's
preference first: NIL (the default) for none, else a list of :ZSTD, :BR
and :GZIP, each maybe with its level, (:GZIP 6) (defaults: gzip 1,
Brotli 4, Zstandard 3).  Kept as (CODING . LEVEL) pairs.  Coded: 200, 403
and 404 replies of COMPRESSION-TYPES, of COMPRESSION-MIN-BYTES or more,
without a Content-Encoding, for a client that accepts one
(serving/reply-coding.lisp).")
   (compression-types
    :initarg :compression-types :reader acceptor-compression-types
    :documentation "The media types coded: exact, or \"text/*\" for every subtype.")
   (compression-min-bytes
    :initarg :compression-min-bytes :reader acceptor-compression-min-bytes
    :documentation "The shortest body coded; shorter ones are sent as they are.")
   (http2
    :initarg :http2 :reader acceptor-http2-p
    :documentation "True to speak HTTP/2 too (RFC 9113): h2 when a TLS
client's ALPN offers it, h2c on a plain port to a client whose first octets
are HTTP/2's preface (prior knowledge).  NIL by default, as nginx's
http2 is off: a drop-in changes nothing for browsers until asked.")
   (http2-max-concurrent-streams
    :initarg :http2-max-concurrent-streams :reader acceptor-http2-max-concurrent-streams
    :documentation "The streams of one HTTP/2 connection whose handlers may
run or wait at once, as its SETTINGS announce; one more is refused
(REFUSED_STREAM), even when the client reset some of them meanwhile.")
   (http2-max-running-streams
    :initarg :http2-max-running-streams
    :documentation "The most streams of one HTTP/2 connection whose
handlers run at once; its further streams wait their turn without a
worker, so that one client cannot take the pool.  NIL (the default): a
quarter of the pool's MAX-THREAD-COUNT, at least 1 (25 for the default
pool), or 16 when the pool has no maximum.")
   (access-log-format
    :initarg :access-log-format :reader acceptor-access-log-format
    :documentation "How the engine writes each entry of the access log:
:HUNCHENTOOT (the default), Hunchentoot's line, the same octets (a
client's control characters as \\xHH); :JSON, one JSON object a line
(access-log/access-log-json.lisp).  Entries go to
HUNCHENTOOT:ACCEPTOR-ACCESS-LOG-DESTINATION, kept and written together
within 0.1 s; an application's own HUNCHENTOOT:ACCEPTOR-LOG-ACCESS method
writes them instead, as on Hunchentoot's acceptor, and this is then not
read.")
   (own-listen-socket
    :initform nil :accessor acceptor-own-listen-socket
    :documentation "The listening socket this acceptor's START-LISTENING
method opened for the current run, or NIL: a socket that reached it
otherwise (:LISTEN-FD, an application's own START-LISTENING method) is
never shut down, for another process may listen on it too.")
   (session-store
    :initarg :session-store :reader acceptor-session-store
    :documentation "Where the sessions of Hunchentoot's session API are kept:
NIL for Hunchentoot's own in-process sessions, or a SESSION-STORE (such as
MAKE-POSTGRESQL-SESSION-STORE's) shared by every process and machine that
uses it and kept across restarts.  Either way session ids are 128 random
bits from the kernel, and a cookie with a wrong session string leaves the
session it names untouched.")
   (session-store-timeout
    :initarg :session-store-timeout :reader acceptor-session-store-timeout
    :documentation "Seconds each call to the session store may take (a
connection from its pool included); a request whose session the store did
not give in time is answered 503 when its handler uses the session.")
   (sessions
    :reader acceptor-sessions
    :documentation "Where the acceptor's sessions live: its SESSION-STORE,
or, without one, an IN-PROCESS-SESSIONS (sessions/session-index.lisp)."))
  (:default-initargs
   :taskmaster (make-instance 'recycling-taskmaster)
   :header-timeout 10
   :keep-alive-timeout 5
   :queue-timeout 10
   :reuse-port nil
   :listen-fd nil
   :defer-accept t
   :body-buffer-bytes 65536
   :access-log-format :hunchentoot
   :max-body-bytes (* 64 1024 1024)
   :max-header-bytes 16384
   :max-websocket-message-bytes (* 1024 1024)
   :max-websocket-queue-bytes (* 1024 1024)
   :websocket-ping-interval 30
   :websocket-timeout 75
   :websocket-message-timeout 60
   :memory-budget nil
   :compression nil
   :compression-types '("text/*" "application/json" "application/javascript" "application/xml"
                        "application/xhtml+xml" "application/rss+xml" "application/atom+xml"
                        "application/manifest+json" "application/ld+json" "image/svg+xml")
   :compression-min-bytes 256
   :http2 nil
   :http2-max-concurrent-streams 100
   :http2-max-running-streams nil
   :session-store nil
   :session-store-timeout 2
   ;; Deferred accepting keeps a connection in the kernel's queue of
   ;; half-open ones, which this bounds too, until its first bytes: with 511,
   ;; 1,000 clients connecting at once overflowed it (SYN cookies, then 1 s
   ;; retransmits).  The kernel takes at most net.core.somaxconn (4096
   ;; since Linux 5.4).
   :listen-backlog 4096)
  (:documentation "HUNCHENTOOT:ACCEPTOR served by a RECYCLING-TASKMASTER:
pooled worker threads share the listening socket and the connections that
wait for requests.  Give :TASKMASTER (MAKE-INSTANCE 'RECYCLING-TASKMASTER
...) to size the pool.  HUNCHENTOOT:ACCEPTOR-READ-TIMEOUT still bounds each
read of a request body and a TLS handshake, HUNCHENTOOT:ACCEPTOR-WRITE-TIMEOUT
each write of a reply; HEADER-TIMEOUT and KEEP-ALIVE-TIMEOUT bound the waits
between requests, QUEUE-TIMEOUT the wait of a request for a free worker.  Each time a worker takes a connection up, it serves the
requests that have arrived inside HUNCHENTOOT:PROCESS-CONNECTION, so that
:AROUND methods of mixins run around them."))

(defclass parallel-easy-acceptor (parallel-acceptor indexed-easy-handlers hunchentoot:easy-acceptor
                                  static-document-root)
  ()
  (:documentation "HUNCHENTOOT:EASY-ACCEPTOR served by a RECYCLING-TASKMASTER:
DEFINE-EASY-HANDLER handlers and static files work as with EASY-ACCEPTOR."))

(defgeneric acceptor-ssl-certificates (acceptor)
  (:documentation "The :SSL-CERTIFICATES of a PARALLEL-SSL-ACCEPTOR: its
certificates for host names other than its own, as it was given them."))

(defclass parallel-ssl-acceptor (parallel-acceptor hunchentoot:ssl-acceptor static-document-root)
  ((ssl-certificates :initarg :ssl-certificates :initform '() :reader acceptor-ssl-certificates
                     :documentation "The certificates of other host names than the
acceptor's own, chosen by the name a client's ClientHello gives (SNI): a
list of plists (server-certificates.lisp, CERTIFICATE-ENTRY-CERTIFICATE).")
   (certificate-path :documentation "The :SSL-CERTIFICATE-FILE as given, its
links not resolved, where renewals are looked for.")
   (privatekey-path :documentation "The :SSL-PRIVATEKEY-FILE as given."))
  (:documentation "HUNCHENTOOT:SSL-ACCEPTOR served by a RECYCLING-TASKMASTER.
Takes the same :SSL-CERTIFICATE-FILE, :SSL-PRIVATEKEY-FILE and
:SSL-PRIVATEKEY-PASSWORD initargs, the certificate served to clients that
name no host or one :SSL-CERTIFICATES does not, and :SSL-CERTIFICATES,
more certificates by host name:
  '((:names (\"example.com\" \"*.example.com\") :certificate-file \"fullchain.pem\"
     :privatekey-file \"privkey.pem\" :privatekey-password nil) ...)
Every file is loaded at START, and again when it is replaced (within a
second of a handshake, or at once by RELOAD-CERTIFICATES)."))

(defclass parallel-easy-ssl-acceptor (parallel-easy-acceptor parallel-ssl-acceptor
                                      hunchentoot:easy-ssl-acceptor static-document-root)
  ()
  (:documentation "HUNCHENTOOT:EASY-SSL-ACCEPTOR served by a RECYCLING-TASKMASTER."))
