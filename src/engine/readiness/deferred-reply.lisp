;;;; A reply a handler deferred (DEFER-REPLY, src/deferred-replies.lisp):
;;;; the handler has returned, its worker is free, and the connection waits
;;;; in the readiness set, watched only for its client resetting it, until a
;;;; thread completes the reply, its timeout passes (the sweep answers
;;;; TIMEOUT-STATUS), or the client goes (a reset, or a failed write: a
;;;; client that shut down its side of the connection reads its reply).  Exactly one of the three settles
;;;; it: each sets OUTCOME by compare-and-swap from NIL.  A completed reply
;;;; is sent by a worker, on the road of every reply: the completer only
;;;; arms the connection for output, which a socket with room reports at
;;;; once.
;;;;
;;;; Who arms it.  The completer takes the connection if it is parked
;;;; (:PARKED -> :ACTIVE) and parks it for output.  When it cannot, another
;;;; thread holds it: the worker parking it after the handler, which looks
;;;; at OUTCOME again once it is parked (PARK-DEFERRED-REPLY, face.lisp),
;;;; or the sweep at the deadline, which finds OUTCOME set and parks it for
;;;; output instead of answering (END-PARKED-CONNECTION).  Only a holder
;;;; detaches the record from its connection.
;;;;
;;;; An HTTP/2 stream's deferred reply has no connection of its own: its
;;;; stream stays open, a timer answers its timeout, the stream's close
;;;; settles it :GONE, and a worker task sends it (http2-reply.lisp,
;;;; src/deferred-replies.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (completion (:constructor make-completion (status headers body)))
  "How a deferred reply was completed."
  (status 200 :read-only t)
  ;; An alist of header names (keywords) and values, set on the reply.
  (headers '() :read-only t)
  ;; A string or octets.
  (body "" :read-only t))

(defstruct (deferred-reply (:constructor %make-deferred-reply))
  "A reply deferred by its handler, its connection waiting for it."
  ;; The connection, or NIL for an HTTP/2 stream's reply: then its
  ;; HTTP2-REPLY-STREAM, and the timer that answers it at its timeout.
  (connection nil :read-only t)
  (http2-reply nil :read-only t)
  (timer nil)
  (set nil :read-only t)
  ;; The acceptor, request, reply and session of the handler, bound again
  ;; when the reply is sent.
  (acceptor nil :read-only t)
  (request nil :read-only t)
  (reply nil :read-only t)
  (session nil :read-only t)
  ;; Internal real time at which it is answered TIMEOUT-STATUS.
  (deadline 0 :type fixnum :read-only t)
  (timeout-status 503 :read-only t)
  ;; Called, in a worker, when the client hangs up before the reply.
  (on-client-gone nil :read-only t)
  ;; NIL while pending; then a COMPLETION, or :TIMED-OUT, :GONE (the client
  ;; left, or the connection was closed first) or :ABANDONED (the handler
  ;; failed after deferring).
  (outcome nil)
  ;; True once a report of the client's socket found octets unread, or its
  ;; end: it is then watched for nothing more (what it sent is the next
  ;; request's; a half-closed client reads its reply all the same).
  (input-seen-p nil)
  ;; MONOTONIC-MICROSECONDS when the handler deferred it.
  (deferred-at 0 :type fixnum :read-only t))

(defmethod print-object ((deferred deferred-reply) stream)
  (print-unreadable-object (deferred stream :type t :identity t)
    (let ((outcome (deferred-reply-outcome deferred)))
      (format stream "~(~A~)" (if (completion-p outcome) :completed (or outcome :pending))))))

(defun make-deferred-reply (set connection acceptor request reply session timeout timeout-status on-client-gone)
  "Make the reply to REQUEST on CONNECTION, held by the caller in SET, a
DEFERRED-REPLY answered TIMEOUT-STATUS after TIMEOUT seconds; returns it."
  (atomic-increment (readiness-set-deferred-count set))
  (setf (connection-deferred connection)
        (%make-deferred-reply :connection connection :set set :acceptor acceptor
                              :request request :reply reply :session session
                              :deadline (+ (get-internal-real-time) (seconds->internal-units timeout))
                              :timeout-status timeout-status :on-client-gone on-client-gone
                              :deferred-at (monotonic-microseconds))))

(defun settle-deferred-reply-outcome (deferred outcome)
  "Make OUTCOME DEFERRED's, unless it has one.  True when it was made."
  (and (compare-and-swap (deferred-reply-outcome deferred) nil outcome) t))

(defun detach-deferred-reply (set connection)
  "Take CONNECTION's deferred reply from it, held by the caller: settled
:GONE unless it was settled before.  The reply."
  (let ((deferred (shiftf (connection-deferred connection) nil)))
    (settle-deferred-reply-outcome deferred :gone)
    (atomic-decrement (readiness-set-deferred-count set))
    deferred))

(defun park-for-completed-reply (set connection)
  "Park CONNECTION, held by the caller, its deferred reply completed, until
its socket has room: at once, unless its client has stopped reading.  False
when it could not be armed (the caller closes it)."
  (setf (connection-awaiting connection) :output
        (connection-timeout-status connection) nil)
  (park-connection set connection (+ (get-internal-real-time) (readiness-set-write-timeout set))))

(defun client-hung-up-p (connection)
  "What a report of CONNECTION's socket, whose reply waits, says of its
client: T when it reset the connection, or it failed; :INPUT when it sent
octets (a next request); :HALF-CLOSED when it shut down its side after its
request, which RFC 9112 9.6 lets a client do and still read the reply; NIL
when nothing is to be read (the report was stale).  Only a reset or a
failed write means the client has gone."
  (let ((octet (make-array 1 :element-type '(unsigned-byte 8))))
    (let ((count (receive-available (connection-fd connection) octet 0 1 :peek t)))
      (case count
        (:error t)
        ;; After its end, a reset may come (the answer of a client gone
        ;; to what was sent since), which the peek does not report.
        (0 (if (tcp-connection-closed-p (connection-fd connection)) t :half-closed))
        (:would-block nil)
        (t :input)))))
