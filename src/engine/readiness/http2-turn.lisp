;;;; The turn of a connection speaking HTTP/2 (http2-connection.lisp): what
;;;; the client sent is given to its session, and each stream whose request
;;;; became whole waits its turn (TAKE-STARTABLE-STREAMS) for a worker task
;;;; (worker-tasks.lisp), so that its streams' handlers run in parallel, up
;;;; to the connection's share of the pool, and a slow one delays no other.
;;;; The task calls back into serving/ (http2-streams.lisp) to answer the
;;;; stream's request on its HTTP2-REPLY-STREAM (http2-reply.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +http2-reads-per-turn+ 16
  "The most reads a worker makes of one HTTP/2 connection before it parks
it again, so that a client sending without pause does not keep a worker
from the others.")

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

(defparameter *http2-protocol-error-reply*
  (coerce #(0 0 0 4 0 0 0 0 0                 ; SETTINGS, empty
            0 0 8 7 0 0 0 0 0 0 0 0 0 0 0 0 1) ; GOAWAY, last stream 0, PROTOCOL_ERROR
          'octets)
  "What a connection that began with no HTTP/1 request line, nor HTTP/2's
preface, is sent where HTTP/2 is spoken: the server's preface, then the
end of the connection (RFC 9113 3.4).")

(defun refuse-line-naming-no-http (set connection)
  "Close CONNECTION, held by the caller, whose request line named no HTTP
version: on a plain connection that has been answered nothing, of an
acceptor speaking h2c, it was a client's broken HTTP/2 preface, answered
with *HTTP2-PROTOCOL-ERROR-REPLY*; else it is refused 400 as ever."
  (if (and (plain-connection-p connection) (not (connection-answered-p connection)))
      (progn (count-refused-head (readiness-set-counters set) 400)
             (count-http2-goaway (readiness-set-counters set) :protocol-error)
             (ignore-errors (send-without-waiting (connection-fd connection) *http2-protocol-error-reply*))
             (linger-before-close connection)
             (close-connection set connection)
             (funcall (readiness-set-refusal-logger set) connection 400))
      (refuse-and-close set connection 400)))

(defun http2-client-reads-slower-than-it-sends-p (connection)
  "True when half CONNECTION's queue limit waits for its client: the turn
reads no more of what it sends until it has taken that."
  (> (http2-connection-unsent-octets connection) (floor (http2-connection-max-queue-bytes connection) 2)))

(defun http2-turn (set holder acceptor buffer end answer)
  "The turn of HOLDER, a connection held by the caller that speaks HTTP/2,
from now on if it did not yet (MAKE-HTTP2-CONNECTION, with ACCEPTOR's
limits): give what its client sent, the END octets starting BUFFER and
what its socket has, every octet read, to its session, and admit each
stream whose request became whole (ADMIT-HTTP2-STREAM; its task calls
ANSWER), until the socket would wait or +HTTP2-READS-PER-TURN+ reads were
made (the connection is then armed again as it parks: octets are left on
its socket).  :HTTP2 (to be parked), or :CLOSE when the client has gone."
  (let ((connection (or (connection-http2 holder)
                        (make-http2-connection set holder acceptor (connection-addresses holder)
                                               (lambda (connection) (start-waiting-streams connection answer))))))
    (prog1 (loop for reads from 0
                 do (when (plusp end)
                      (setf (http2-connection-last-active connection) (get-internal-real-time))
                      (multiple-value-bind (streams failure)
                          (receive-http2-octets (http2-connection-session connection) buffer 0 end)
                        (dolist (stream streams)
                          (admit-http2-stream set connection stream))
                        (when failure
                          (return :http2))))
                    (when (or (>= reads +http2-reads-per-turn+) (http2-client-reads-slower-than-it-sends-p connection))
                      ;; Octets may wait that no new edge will report.
                      (setf (connection-unread-p holder) t)
                      (return :http2))
                    (let ((count (receive-bytes holder buffer 0 (length buffer))))
                      (case count
                        (:would-block (return :http2))
                        ((:error 0) (return :close))
                        (t (setf end count)))))
      ;; Run by this worker once the connection is parked, unless another
      ;; is woken for them first (worker-tasks.lisp).
      (start-waiting-streams connection answer))))

(defun admit-http2-stream (set connection stream)
  "Take STREAM of CONNECTION, whose request is whole, to be answered: at
once, without a worker, when it is refused (413, 431, 503 for a body the
memory budget had no room for), or while the memory budget is spent (503,
as HTTP/1.1's new requests); reset with REFUSED_STREAM when MAX-STREAMS of
the connection's handlers run or wait already; dropped when the client
reset it already; else it waits its turn (ADD-WAITING-STREAM)."
  (let ((refusal (http2-stream-refusal stream))
        (session (http2-connection-session connection)))
    (cond ((eq (http2-stream-state stream) :closed)
           ;; Reset by the client in the octets that made it whole.
           nil)
          (refusal
           (count-refused-head (readiness-set-counters set) refusal)
           (refuse-http2-stream-with set session stream refusal))
          ((memory-budget-exceeded-p (readiness-set-memory-budget set))
           (atomic-increment (memory-budget-refusals (readiness-set-memory-budget set)))
           (count-reply (readiness-set-counters set) 503)
           (refuse-http2-stream-with set session stream 503
                                     "This server is short of memory for the moment.  Please try again later."))
          ((add-waiting-stream connection stream))
          (t (atomic-increment (connection-counters-http2-streams-refused (readiness-set-counters set)))
             (refuse-http2-stream session stream)))))

(defun start-waiting-streams (connection answer)
  "Queue a worker task for each stream of CONNECTION that may begin now
(TAKE-STARTABLE-STREAMS), from any thread."
  (let ((streams (take-startable-streams connection)))
    (when streams
      (queue-worker-tasks (http2-connection-set connection)
                          (mapcar (lambda (stream) (http2-stream-task connection stream answer)) streams)))))

(defun http2-stream-task (connection stream answer)
  "The task that answers STREAM of CONNECTION in a worker: it calls ANSWER
with the worker's SERVING, the stream's HTTP2-REPLY-STREAM, the request's
octets (an HTTP/1.1 head and its body), where the request line and the
head end, the acceptor and the connection's addresses; then ends the
reply and counts it -- unless ANSWER returned :HELD (its handler deferred
it: whoever sends it ends and counts it), or only counts it when ANSWER
returned :OPEN (an event stream, ended later) -- and lets the
connection's next streams begin."
  (let ((set (http2-connection-set connection)))
    (lambda (serving)
      (atomic-decrement (http2-connection-queued connection))
      (multiple-value-bind (body-pieces body-length)
          (take-http2-stream-body (http2-connection-session connection) stream)
        (unwind-protect
             (let ((start (monotonic-microseconds))
                   (reply (make-http2-reply-stream connection stream)))
               (multiple-value-bind (octets request-line-end head-end)
                   (http2-stream-request-octets stream body-pieces (or body-length 0))
                 (setf body-pieces '())
                 (let ((outcome nil))
                   (unwind-protect
                        (setf outcome (funcall answer serving reply octets request-line-end head-end
                                               (http2-connection-acceptor connection)
                                               (http2-connection-addresses connection)))
                     (unless (eq outcome :held)
                       (count-answered-request (readiness-set-counters set)
                                               (mod (http2-stream-id stream) +request-count-stripes+)
                                               (if (eq outcome :open)
                                                   (http2-reply-stream-status reply)
                                                   (end-http2-reply reply))
                                               (- (monotonic-microseconds) start)))))))
          ;; The body, taken with its charge, is the task's until the request ends.
          (release-memory (readiness-set-memory-budget set) (or body-length 0))
          (finish-http2-handler connection stream answer))))))

(defun finish-http2-handler (connection stream answer)
  "The handler of STREAM, one of CONNECTION's, has ended, its reply ended:
counted, its reply's size noted, the streams waiting their turn begun,
what was answered sent (FLUSH-HTTP2-CONNECTION) now, or, while more of its
streams wait to be begun -- most likely by this worker, next -- with
theirs when the last of them ends, and in any case within
+TASK-NUDGE-MILLISECONDS+: a batch of
streams' replies leaves in one send, not one each (a send a stream was a
fifth of an HTTP/2 request's time, bench/profiles/2026-11-28-http2.txt)."
  (note-http2-reply-size connection (http2-stream-reply-made stream))
  (atomic-decrement (http2-connection-running connection))
  (let ((queued (http2-connection-queued connection)))
    (setf (http2-connection-last-active connection) (get-internal-real-time))
    (start-waiting-streams connection answer)
    (cond ((zerop queued) (flush-http2-connection connection))
          ((compare-and-swap (http2-connection-flush-pending-p connection) nil t)
           (call-soon (http2-connection-set connection) (lambda () (flush-http2-connection connection)))))))
