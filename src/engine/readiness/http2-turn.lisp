;;;; The turn of a connection speaking HTTP/2 (http2-connection.lisp): what
;;;; the client sent is given to its session, and each stream whose request
;;;; became whole is handed to a worker task (worker-tasks.lisp), so that
;;;; its streams' handlers run in parallel, up to the concurrent stream
;;;; limit, and a slow one delays no other.  The task calls back into
;;;; serving/ (http2-streams.lisp) for the reply, submits it and sends it.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-reads-per-turn+ 16
  "The most reads a worker makes of one HTTP/2 connection before it parks
it again, so that a client sending without pause does not keep a worker
from the others.")

(defparameter *http2-preface* (map 'octets #'char-code (format nil "PRI * HTTP/2.0~C~C~C~CSM~C~C~C~C"
                                                             #\Return #\Linefeed #\Return #\Linefeed
                                                             #\Return #\Linefeed #\Return #\Linefeed))
  "What an HTTP/2 client sends first (RFC 9113 3.4).")

(defun connection-http2-state (connection buffer end)
  "Whether CONNECTION, held by the caller, its octets starting BUFFER up to
END, is to speak HTTP/2, its acceptor speaking it: :HTTP2 when its TLS
handshake chose h2, or when it has answered nothing yet and its octets
begin with the whole preface (h2c with prior knowledge); :PARTIAL when
they are the start of the preface; else NIL."
  (let ((preface *http2-preface*))
    (cond ((equal (connection-application-protocol connection) "h2") :http2)
          ((or (zerop end) (/= (aref buffer 0) (aref preface 0)) (connection-answered-p connection)
               (not (plain-connection-p connection))
               (mismatch buffer preface :end1 (min end (length preface)) :end2 (min end (length preface))))
           nil)
          ((>= end (length preface)) :http2)
          (t :partial))))

(defun http2-client-reads-slower-than-it-sends-p (connection)
  "True when half CONNECTION's queue limit waits for its client: the turn
reads no more of what it sends until it has taken that."
  (> (http2-connection-unsent-octets connection) (floor (http2-connection-max-queue-bytes connection) 2)))

(defun http2-turn (set holder acceptor buffer end answer)
  "The turn of HOLDER, a connection held by the caller that speaks HTTP/2,
from now on if it did not yet (MAKE-HTTP2-CONNECTION, with ACCEPTOR's
limits): give what its client sent, the END octets starting BUFFER and
what its socket has, to its session, and start each stream whose request
became whole (START-HTTP2-STREAM, with ANSWER), until it would wait.
:HTTP2 (to be parked), or :CLOSE when the client has gone."
  (let ((connection (or (connection-http2 holder)
                        (make-http2-connection set holder acceptor (connection-addresses holder))))
        (tasks '()))
    (unwind-protect
         (loop repeat +http2-reads-per-turn+
               do (when (plusp end)
                    (setf (http2-connection-last-active connection) (get-internal-real-time))
                    (multiple-value-bind (streams failure)
                        (receive-http2-octets (http2-connection-session connection) buffer 0 end)
                      (dolist (stream streams)
                        (let ((task (start-http2-stream set connection stream answer)))
                          (when task (push task tasks))))
                      (when failure
                        (return :http2))))
                  (when (http2-client-reads-slower-than-it-sends-p connection)
                    (return :http2))
                  (let ((count (receive-bytes holder buffer 0 (length buffer))))
                    (case count
                      (:would-block (return :http2))
                      ((:error 0) (return :close))
                      (t (setf end count))))
               finally (return :http2))
      ;; Run by this worker once the connection is parked, unless another
      ;; is woken for them first (worker-tasks.lisp).
      (queue-worker-tasks set (nreverse tasks)))))

(defun refuse-http2-stream-for-memory (set session stream)
  "Answer STREAM 503, as a request refused while the memory budget is
spent; reset it (REFUSED_STREAM) when even that has no room."
  (count-reply (readiness-set-counters set) 503)
  (when (eq :no-memory
            (multiple-value-call #'submit-http2-reply session stream
              (http1-reply-parts (head-error-reply 503 (readiness-set-server-name set)
                                                   (readiness-set-retry-after-seconds set)
                                                   "This server is short of memory for the moment."))))
    (refuse-http2-stream session stream)))

(defun reserve-http2-handler (connection)
  "Count one more of CONNECTION's handlers as running: false, nothing
counted, when MAX-STREAMS run or wait already."
  (loop for running = (http2-connection-running connection)
        do (cond ((>= running (http2-connection-max-streams connection)) (return nil))
                 ((compare-and-swap (http2-connection-running connection) running (1+ running)) (return t)))))

(defun start-http2-stream (set connection stream answer)
  "The task that answers STREAM of CONNECTION, whose request is whole, in
a worker: it calls ANSWER with the worker's SERVING, the request's
octets (an HTTP/1.1 head and its body), where the request line and the head end, the acceptor and
the connection's addresses, counts and sends the reply it returns (status,
an alist of lower-case header names and values, body octets or NIL).  NIL
for a stream refused (413, 431, 503), answered at once, without a worker,
for one past MAX-STREAMS handlers, reset with REFUSED_STREAM, and for one
the client reset already."
  (let ((refusal (http2-stream-refusal stream))
        (session (http2-connection-session connection))
        (acceptor (http2-connection-acceptor connection)))
    (cond ((eq (http2-stream-state stream) :closed)
           ;; Reset by the client in the octets that made it whole.
           nil)
          (refusal
           (when (eq :no-memory
                     (multiple-value-call #'submit-http2-reply session stream
                       (http1-reply-parts (head-error-reply refusal (readiness-set-server-name set)
                                                            (readiness-set-retry-after-seconds set)))))
             (refuse-http2-stream session stream))
           nil)
          ((reserve-http2-handler connection)
           (atomic-increment (http2-connection-queued connection))
           (lambda (serving)
             (atomic-decrement (http2-connection-queued connection))
             (unwind-protect
                  (let ((start (monotonic-microseconds)))
                    (multiple-value-bind (status headers body)
                        (multiple-value-bind (octets request-line-end head-end) (http2-stream-request-octets stream)
                          (funcall answer serving octets request-line-end head-end
                                   acceptor (http2-connection-addresses connection)))
                      (count-answered-request (readiness-set-counters set)
                                              (mod (http2-stream-id stream) +request-count-stripes+)
                                              status (- (monotonic-microseconds) start))
                      (when (eq :no-memory (submit-http2-reply session stream status headers body))
                        ;; Its body would pass the memory budget.
                        (refuse-http2-stream-for-memory set session stream))))
               (finish-http2-handler connection))))
          (t (atomic-increment (connection-counters-http2-streams-refused (readiness-set-counters set)))
             (refuse-http2-stream session stream)
             nil))))

(defun flush-http2-connection (connection)
  "Send what CONNECTION's session has made: by the caller when the
connection is parked (SERVE-OUTBOX-OUTPUT), else by its holder."
  (setf (http2-connection-flush-pending-p connection) nil)
  (offer-http2-output connection)
  ;; Parked with no deadline while handlers ran: parked again, its
  ;; deadline is the idle one once none runs.
  (serve-outbox-output connection))

(defun finish-http2-handler (connection)
  "One of CONNECTION's handlers has ended, its reply submitted: counted, and
sent (FLUSH-HTTP2-CONNECTION) now, or, while more of its streams wait to
be begun -- most likely by this worker, next -- with theirs when the last
of them ends, and in any case within +TASK-NUDGE-MILLISECONDS+: a batch of
streams' replies leaves in one send, not one each (a send a stream was a
fifth of an HTTP/2 request's time, bench/profiles/2026-11-28-http2.txt)."
  (atomic-decrement (http2-connection-running connection))
  (setf (http2-connection-last-active connection) (get-internal-real-time))
  (cond ((zerop (http2-connection-queued connection)) (flush-http2-connection connection))
        ((compare-and-swap (http2-connection-flush-pending-p connection) nil t)
         (call-soon (http2-connection-set connection) (lambda () (flush-http2-connection connection))))))
