;;;; A client connection as the readiness engine keeps it: its descriptor
;;;; and streams, where it stands (parked, held, closed; waiting for input
;;;; or for room to write), what it has pending in either direction, and its
;;;; deadline.
;;;;
;;;; Ownership.  A connection is :ACTIVE while exactly one thread holds it,
;;;; :NOTIFIED while held and reported ready meanwhile, :PARKED while it
;;;; waits in the readiness set, and :CLOSED at the end.  Only the holder of
;;;; an :ACTIVE or :NOTIFIED connection touches it (its PENDING, OUTGOING,
;;;; ARRIVING-BODY and HANDSHAKE included).  Parking sets :PARKED before
;;;; arming the descriptor, and every taker -- the worker woken for it, the
;;;; sweeper closing it at its deadline, HUNCHENTOOT:STOP -- must win a
;;;; compare-and-swap from :PARKED to :ACTIVE first, so that two threads
;;;; never serve one connection; a worker woken for a connection it finds
;;;; :ACTIVE marks it :NOTIFIED instead, for its holder to arm it again
;;;; (readiness-set.lisp).  A websocket's
;;;; connection may also be taken so by a thread sending to it
;;;; (websocket-connection.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +listen-token+ 0)

(defconstant +wakeup-token+ 1)

(defconstant +timer-token+ 2)

(defconstant +task-token+ 3)

(defconstant +first-connection-token+ 4)

(defstruct (connection (:constructor make-connection (fd token fd-stream)))
  "A client connection served by the readiness set."
  ;; :ACTIVE, :PARKED or :CLOSED; see Ownership above.
  (state :active)
  (fd -1 :type fixnum :read-only t)
  (token 0 :type word :read-only t)
  ;; The binary stream on FD.
  (fd-stream nil :read-only t)
  ;; The stream requests are read from and replies written to: FD-STREAM,
  ;; or the TLS stream over it.
  (stream nil)
  ;; The octets that arrived and are not yet answered (part of a head, or
  ;; pipelined requests), or NIL.
  (pending nil)
  ;; What a parked connection waits for: :INPUT (a request's octets, head
  ;; or body) or :OUTPUT (room in the socket buffer for the rest of its
  ;; reply).
  (awaiting :input)
  ;; The OUTGOING rest of a reply the socket did not take whole, or NIL.
  (outgoing nil)
  ;; The REPLY-BATCH its last reply waits in to be sent with the others of
  ;; a worker's batch, or NIL (reply-batch.lisp).
  (batch nil)
  ;; The ARRIVING-BODY of a request whose body the engine is reading, or NIL.
  (arriving-body nil)
  ;; The TLS stream whose handshake the engine is taking, before the
  ;; connection has a STREAM; NIL otherwise (tls-handshake.lisp).
  (handshake nil)
  ;; While it waits for output: the octets its client had not acknowledged
  ;; when it was last parked or looked at, or NIL.
  (unacknowledged nil)
  ;; The WEBSOCKET the connection has become after a 101, or NIL.
  (websocket nil)
  ;; The DEFERRED-REPLY its request waits for, or NIL.
  (deferred nil)
  ;; The EVENT-STREAM its reply has become, or NIL.
  (event-stream nil)
  ;; The HTTP2-CONNECTION it speaks once it opened with HTTP/2's preface
  ;; or chose h2 in its TLS handshake, or NIL.
  (http2 nil)
  ;; The protocol ALPN chose in its TLS handshake, a string, or NIL.
  (application-protocol nil)
  ;; How the descriptor is watched since its first park: :EDGE (plain) or
  ;; :ONE-SHOT (TLS); NIL before it is added to the epoll set.
  (trigger nil)
  ;; What it is watched for since it was last armed: :INPUT or :OUTPUT.
  (armed-for nil)
  ;; True when octets may wait on the socket that no new edge will report:
  ;; the connection was reported ready and has not been read to a short
  ;; read since, or a stream read its body.  Parking arms it again then.
  (unread-p t)
  ;; True once a request of this connection has been answered: before, a
  ;; soft STOP waits for it (ENGINE-DRAIN).
  (answered-p nil)
  ;; Internal real time at which a parked connection is ended.
  (deadline 0 :type fixnum)
  ;; What the client is answered at DEADLINE: 408 when it is the header
  ;; timeout, 503 when it is the queue timeout of a complete request, NIL
  ;; when it is the keep-alive timeout (closed without a word).
  (timeout-status nil)
  ;; The peer's and our address and port, as Hunchentoot's request holds
  ;; them: read once per connection, not once per request.
  (addresses '() :type list)
  ;; The CONNECTION-SOCKET, a usocket, that HUNCHENTOOT:PROCESS-CONNECTION
  ;; is called with for this connection.
  (usocket nil)
  ;; Internal real time the head being read began to arrive (or the
  ;; connection was accepted); NIL between requests of a kept-alive one.
  (head-started nil :type (or null fixnum)))

(defvar *connection-octets* (structure-octets (make-connection -1 0 nil))
  "The octets a CONNECTION takes, which PREFETCH-REPORTED-CONNECTION asks for.")

(defmethod print-object ((connection connection) stream)
  (print-unreadable-object (connection stream :type t :identity t)
    (format stream "fd ~D ~S" (connection-fd connection) (connection-state connection))))

(defun plain-connection-p (connection)
  "True when CONNECTION speaks plain HTTP, not TLS."
  (eq (connection-stream connection) (connection-fd-stream connection)))

(defun note-unacknowledged-octets (connection)
  "Remember how many octets CONNECTION's client has not acknowledged yet."
  (setf (connection-unacknowledged connection) (unacknowledged-octets (connection-fd connection))))

(defun client-took-octets-p (connection)
  "True when CONNECTION's client has acknowledged octets since
NOTE-UNACKNOWLEDGED-OCTETS was last called on it, which this is again.  A
client reading slowly through a full socket buffer is so told from one
reading nothing: the socket is not reported writable until a third of the
buffer is free, which at 1 KiB a second takes far longer than the write
timeout."
  (let ((before (connection-unacknowledged connection))
        (now (note-unacknowledged-octets connection)))
    (and before now (< now before))))

(defun linger-before-close (connection)
  "Send FIN after what was written to CONNECTION, then drop what its client
sent meanwhile, in a few reads that do not wait: closing a socket with
unread input resets the connection, and a reset may reach the client
before it has read our last octets."
  (let ((fd (connection-fd connection))
        (scratch (make-array 4096 :element-type '(unsigned-byte 8))))
    (shut-down-fd-output fd)
    (loop repeat 16
          for count = (receive-available fd scratch 0 4096)
          while (and (integerp count) (plusp count)))))
