;;;; A connection that has become an event stream (a text/event-stream
;;;; reply, START-EVENT-STREAM in src/event-streams.lisp): its head sent,
;;;; its events go out through its outbox (outbox.lisp, "Sending from any
;;;; thread"), and it waits in the readiness set -- for room in its socket,
;;;; for its client resetting it (or sending, which is never read), for the
;;;; time of its next keep-alive comment,
;;;; which keeps proxies from closing an idle stream.  What its client does
;;;; not take waits up to MAX-QUEUE-BYTES; a stream that would pass them, or
;;;; whose client takes nothing of them for the write timeout, is closed
;;;; and counted.  The body ends when the connection closes (Connection:
;;;; close, no length), at which a browser's EventSource reconnects.
;;;;
;;;; These functions never close the connection: they say when the caller
;;;; is to (CLOSE-CONNECTION, closing.lisp, ends the stream).

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *keep-alive-comment* (map 'octets #'char-code (format nil ":~%~%"))
  "What an idle event stream is sent at its keep-alive interval: a comment
line, which EventSource ignores.")

(defstruct (event-stream (:include outbox) (:constructor %make-event-stream))
  "What the engine keeps of a connection that is an event stream."
  ;; The acceptor it was started on, for its log.
  (acceptor nil :read-only t)
  ;; Internal time units between the last octets queued and a keep-alive
  ;; comment.
  (keep-alive-interval 0 :type fixnum :read-only t)
  ;; Internal real time octets were last offered or queued: any thread
  ;; writes it, a fixnum, whole.
  (last-queued 0 :type fixnum)
  ;; Set by a thread asking for the end (CLOSE-EVENT-STREAM).
  (close-requested-p nil)
  ;; True once the client's socket showed octets: it is then watched for
  ;; nothing but errors (what it sent is never read).
  (input-seen-p nil)
  ;; Functions called with the stream once it has ended (the channels it
  ;; is subscribed to forget it): any thread pushes, the end takes.
  (end-hooks '()))

(defmethod print-object ((stream event-stream) out)
  (print-unreadable-object (stream out :type t :identity t)
    (format out "~S" (event-stream-state stream))))

(defun make-event-stream (set connection acceptor max-queue-bytes keep-alive-seconds)
  "Make CONNECTION, held by the caller in SET, an EVENT-STREAM of
ACCEPTOR's, counted open, whose queue holds up to MAX-QUEUE-BYTES and which
is sent a comment after KEEP-ALIVE-SECONDS idle; returns it.  Its head is
sent by the worker once the handler has returned."
  (atomic-increment (readiness-set-event-stream-count set))
  (setf (connection-event-stream connection)
        (%make-event-stream :connection connection :set set :acceptor acceptor
                            :max-queue-bytes max-queue-bytes
                            :keep-alive-interval (seconds->internal-units keep-alive-seconds)
                            :last-queued (get-internal-real-time))))

(defun offer-event-octets (stream counted)
  "Add COUNTED, the COUNTED-OCTETS of events the caller holds, to what
STREAM sends, from any thread (OFFER-OUTBOX-OCTETS).  True when added."
  (when (offer-outbox-octets stream counted)
    (setf (event-stream-last-queued stream) (get-internal-real-time))
    (atomic-increment (connection-counters-events-sent (readiness-set-counters (event-stream-set stream))))
    t))

(defun event-stream-deadline (stream)
  "When STREAM, about to park, is next looked at without its client: the
write timeout while octets wait, else the time of its keep-alive comment."
  (if (event-stream-queue stream)
      (outbox-write-deadline stream (get-internal-real-time))
      (+ (event-stream-last-queued stream) (event-stream-keep-alive-interval stream))))

(defun close-for-not-reading (stream)
  "STREAM's client takes too little of it: counted; :CLOSE."
  (atomic-increment (connection-counters-event-streams-not-reading
                     (readiness-set-counters (event-stream-set stream))))
  :close)

(defun park-event-stream (stream)
  "Send what STREAM has to send, then park its connection, held by the
caller, until its socket has room for the rest, its client hangs up, or its
deadline (EVENT-STREAM-DEADLINE).  T when parked (and perhaps another
thread's already); :CLOSE when the caller is to close it: it was asked to,
a send to it found no room, its client has gone, or the descriptor could
not be armed."
  (let ((connection (event-stream-connection stream))
        (set (event-stream-set stream)))
    (loop
      (cond ((eql (event-stream-refusal-code stream) 1008) (return (close-for-not-reading stream)))
            ;; 1013: the memory budget refused an event (counted there).
            ((event-stream-refusal-code stream) (return :close))
            ((eq (send-outbox-queue stream) :failed) (return :close))
            ;; After the send: what was sent before the request goes first.
            ((event-stream-close-requested-p stream) (return :close)))
      (setf (connection-awaiting connection) (cond ((event-stream-queue stream) :output)
                                                   ((event-stream-input-seen-p stream) :none)
                                                   (t :input))
            (connection-timeout-status connection) nil)
      (unless (park-connection set connection (event-stream-deadline stream))
        (return :close))
      ;; See "Sending from any thread" in outbox.lisp.
      (memory-barrier)
      (unless (and (or (event-stream-inbox stream) (event-stream-close-requested-p stream)
                       (event-stream-refusal-code stream))
                   (take-parked-connection connection))
        (return t)))))

(defun queue-keep-alive-comment (stream)
  "Queue *KEEP-ALIVE-COMMENT* on STREAM, held by the caller."
  (queue-counted-octets stream (uncounted-octets *keep-alive-comment*))
  (setf (event-stream-last-queued stream) (get-internal-real-time)))

(defun event-stream-deadline-reached (stream)
  "STREAM's connection, held by the caller, was parked until a deadline
that has passed: an idle stream is sent its keep-alive comment and parked
again; :CLOSE when the caller is to close it, its client having taken
nothing of what waits for the write timeout."
  (cond ((not (event-stream-queue stream))
         (queue-keep-alive-comment stream)
         (park-event-stream stream))
        ((client-took-octets-p (event-stream-connection stream)) (park-event-stream stream))
        (t (close-for-not-reading stream))))

(defun end-event-stream (set stream)
  "STREAM's connection, held by the caller, is being closed: what waits is
dropped, the stream counted closed, and its end hooks called (an error of
theirs logged)."
  (unless (eq (event-stream-state stream) :closed)
    (setf (event-stream-state stream) :closed)
    (drop-outbox-queue stream)
    (atomic-decrement (readiness-set-event-stream-count set))
    (dolist (hook (loop for hooks = (event-stream-end-hooks stream)
                        until (compare-and-swap (event-stream-end-hooks stream) hooks :ended)
                        finally (return (if (listp hooks) hooks '()))))
      (handler-case (funcall hook stream)
        (error (condition)
          (log-safely (event-stream-acceptor stream) :error "Error at the end of an event stream: ~A" condition))))))

(defun add-event-stream-end-hook (stream hook)
  "Call HOOK with STREAM once it has ended, or now if it has.  From any thread."
  (loop for hooks = (event-stream-end-hooks stream)
        do (cond ((eq hooks :ended) (return (funcall hook stream)))
                 ((compare-and-swap (event-stream-end-hooks stream) hooks (cons hook hooks)) (return)))))
