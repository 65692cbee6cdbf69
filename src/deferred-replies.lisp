;;;; Replies that wait without a thread.  A handler defers its reply
;;;; (DEFER-REPLY) and returns: its worker is free, and its connection
;;;; waits in the readiness set (engine/readiness/deferred-reply.lisp) until
;;;; any thread completes the reply (COMPLETE-REPLY), its timeout passes,
;;;; or the client goes.  CALL-AFTER calls a function after some
;;;; milliseconds on the engine's own timer (engine/readiness/timers.lisp),
;;;; without a thread waiting either.

(in-package #:hunchentoot-recycling-taskmaster)

(defun serving-of-waiting-reply (what &key http2-p)
  "The SERVING of the handler calling, whose reply is to be WHAT (\"deferred\",
\"an event stream\"); signals REPLY-NOT-DEFERRABLE outside a handler of a
parallel acceptor's request, in a websocket's, in an HTTP/2 stream's unless
HTTP2-P, or once the headers are sent, noted as the serving's refusal when
there is one (REPORT-HANDLER-ERROR logs it as its one line)."
  (let ((serving *serving*))
    (flet ((refuse (reason)
             (let ((condition (make-condition 'reply-not-deferrable :reason reason)))
               (when serving
                 (setf (serving-refusal serving) condition))
               (error condition))))
      (cond ((not (and serving (typep hunchentoot:*acceptor* 'parallel-acceptor) (boundp 'hunchentoot:*request*)
                       (let ((connection (worker-connection (serving-worker serving))))
                         (not (and connection (connection-websocket connection))))))
             (refuse (format nil "it is made ~A outside a handler of a parallel acceptor's request." what)))
            ((and (null (worker-connection (serving-worker serving)))
                  (not (and http2-p (http2-reply-stream-p (current-connection-stream)))))
             ;; A worker task's: the connection is its holder's.
             (refuse (format nil "it is made ~A in an HTTP/2 stream's handler, which this version answers ~
only when the handler returns." what)))
            ((headers-sent-p)
             (refuse "its headers have been sent."))
            (t serving)))))

(defun defer-reply (&key (timeout 30) (timeout-status 503) on-client-gone)
  "Inside a handler of a PARALLEL-ACCEPTOR's request, over HTTP/1.1 or an
HTTP/2 stream: make its reply wait for COMPLETE-REPLY, from any thread,
instead of the handler's return value, which is then ignored; returns the
DEFERRED-REPLY.  The handler returns at once and its worker serves others
meanwhile.  A reply not completed within
TIMEOUT seconds is answered TIMEOUT-STATUS (503, or 504) and its
connection closed.  When the client goes first -- it resets the
connection; one that only shuts down its side after the request still
gets the reply; on HTTP/2, it resets the stream or closes the
connection -- ON-CLIENT-GONE, if given, is called with the DEFERRED-REPLY, in a worker, with Hunchentoot's
specials bound as in the handler, and REPLY-CLIENT-GONE-P is true from then
on, so that the work behind the reply can stop.  Called again in the same
handler it returns the same DEFERRED-REPLY.  A handler that fails after
deferring is answered as the failure says; its reply can no longer be
completed.  A soft STOP waits for deferred replies as for any request, then
closes what is left.  Signals REPLY-NOT-DEFERRABLE outside such a handler
or once the headers are sent."
  (let ((serving (serving-of-waiting-reply "deferred" :http2-p t)))
    (cond ((serving-deferred serving))
          ((serving-event-stream serving)
           (error 'reply-not-deferrable :reason "it is an event stream already."))
          (t (check-type timeout (real (0)))
             (check-type timeout-status (integer 400 599))
             (setf (serving-deferred serving)
                   (let ((connection (worker-connection (serving-worker serving))))
                     (if connection
                         (make-deferred-reply (serving-set serving) connection
                                              hunchentoot:*acceptor* hunchentoot:*request* hunchentoot:*reply*
                                              hunchentoot:*session* timeout timeout-status on-client-gone)
                         (defer-http2-reply (serving-set serving) (current-connection-stream)
                                            timeout timeout-status on-client-gone))))))))

(defun complete-reply (deferred &key (status hunchentoot:+http-ok+) content-type headers (body ""))
  "Complete DEFERRED, from any thread: its reply is STATUS, with the
Content-Type CONTENT-TYPE (else the reply's, as Hunchentoot's default) and
HEADERS, an alist of header names (keywords) and values, set on it as with
HUNCHENTOOT:HEADER-OUT, then BODY, a string or octets.  A worker sends it
without this thread waiting.  True when this call completed it; NIL when
it was completed before, answered at its timeout, abandoned, or its client
is gone: only one call completes a reply."
  (check-type body (or string (vector (unsigned-byte 8))))
  (let ((headers (if content-type (acons :content-type content-type headers) headers)))
    (when (settle-deferred-reply-outcome deferred (make-completion status headers body))
      (let ((set (deferred-reply-set deferred))
            (connection (deferred-reply-connection deferred)))
        (unless connection
          (queue-worker-tasks set (list (lambda (serving) (send-http2-deferred-reply serving deferred))))
          (return-from complete-reply t))
        ;; See "Who arms it" in deferred-reply.lisp.  A worker calling
        ;; the timers serves the connection itself once they are called.
        (when (take-parked-connection connection)
          (let ((serving *serving*))
            (cond ((and serving (listp (serving-completed serving)) (eq (serving-set serving) set))
                   (push connection (serving-completed serving)))
                  ((not (park-for-completed-reply set connection))
                   (close-connection set connection))))))
      t)))

;;; On an HTTP/2 stream.  The stream stays open, its connection served as
;;; ever; a timer answers the reply at its timeout; a worker task sends it
;;; once completed (or timed out) on the stream's HTTP2-REPLY-STREAM, as the
;;; stream's handler would have; the stream's close, when its client resets
;;; it first, settles it :GONE.

(defun defer-http2-reply (set reply-stream timeout timeout-status on-client-gone)
  "The DEFERRED-REPLY of the HTTP/2 stream whose reply is written to
REPLY-STREAM, from its handler (DEFER-REPLY)."
  (let ((deferred (make-http2-deferred-reply set reply-stream hunchentoot:*acceptor* hunchentoot:*request*
                                             hunchentoot:*reply* hunchentoot:*session* timeout timeout-status
                                             on-client-gone #'time-out-http2-deferred-reply))
        (reply (reply-stream-reply reply-stream)))
    (unless (watch-http2-stream-close (http2-connection-session (http2-reply-connection reply))
                                      (http2-reply-stream reply)
                                      (lambda () (note-http2-deferred-client-gone deferred)))
      ;; Reset by the client already.
      (note-http2-deferred-client-gone deferred))
    deferred))

(defun time-out-http2-deferred-reply (deferred)
  "DEFERRED's timer, in a worker: answered its TIMEOUT-STATUS unless it was
settled first."
  (when (settle-deferred-reply-outcome deferred :timed-out)
    (send-http2-deferred-reply *serving* deferred)))

(defun note-http2-deferred-client-gone (deferred)
  "DEFERRED's stream closed, its session's lock held: settled :GONE unless
it was settled first, then, in a worker, told to its ON-CLIENT-GONE."
  (when (settle-deferred-reply-outcome deferred :gone)
    (let ((set (deferred-reply-set deferred)))
      (call-soon set (lambda ()
                       (ended-http2-deferred-reply deferred)
                       (note-client-gone set deferred))))))

(defun send-http2-deferred-reply (serving deferred)
  "Send DEFERRED's reply on its HTTP/2 stream, in a worker of SERVING,
settled as completed (with the handler's request, reply and session bound
again, as SEND-COMPLETED-REPLY) or timed out (the engine's page of its
TIMEOUT-STATUS); end it, count it, and send what the connection has."
  (let* ((reply-stream (deferred-reply-http2-reply deferred))
         (reply (reply-stream-reply reply-stream))
         (connection (http2-reply-connection reply))
         (set (deferred-reply-set deferred))
         (outcome (deferred-reply-outcome deferred))
         (status (deferred-reply-timeout-status deferred)))
    (unwind-protect
         (unless (eq (http2-stream-state (http2-reply-stream reply)) :closed)
           (if (completion-p outcome)
               (with-connection-bindings ()
                 (with-request-bindings ()
                   (setf (current-connection-stream) reply-stream)
                   (begin-request-state serving nil)
                   (let ((hunchentoot:*acceptor* (deferred-reply-acceptor deferred))
                         (hunchentoot:*request* (deferred-reply-request deferred))
                         (hunchentoot:*reply* (deferred-reply-reply deferred))
                         (hunchentoot:*session* (deferred-reply-session deferred)))
                     (send-completed-reply hunchentoot:*request* (completion-status outcome)
                                           (completion-headers outcome) (completion-body outcome))
                     (setf status (end-http2-reply reply-stream)))))
               (progn (atomic-increment (connection-counters-deferred-timeouts (readiness-set-counters set)))
                      (refuse-http2-stream-with set (http2-connection-session connection) (http2-reply-stream reply)
                                                status)))
           (count-answered-request (readiness-set-counters set)
                                   (mod (http2-stream-id (http2-reply-stream reply)) +request-count-stripes+)
                                   status (- (monotonic-microseconds) (deferred-reply-deferred-at deferred))))
      (ended-http2-deferred-reply deferred)
      (flush-http2-connection connection))))

(defun reply-pending-p (deferred)
  "True while DEFERRED is neither completed nor answered otherwise."
  (null (deferred-reply-outcome deferred)))

(defun reply-client-gone-p (deferred)
  "True once DEFERRED's client reset the connection before its reply, or
its connection was closed without it (a STOP)."
  (eq (deferred-reply-outcome deferred) :gone))

(defun acceptor-timers (acceptor)
  "The TIMERS of ACCEPTOR's current run; signals an error when it is not a
started PARALLEL-ACCEPTOR."
  (let* ((taskmaster (and (typep acceptor 'parallel-acceptor) (acceptor-taskmaster acceptor)))
         (engine (and taskmaster (taskmaster-engine taskmaster)))
         (set (and engine (engine-readiness-set engine))))
    (unless set
      (error "~S is not a started parallel acceptor: it has no timer." acceptor))
    (readiness-set-timers set)))

(defun call-after (milliseconds function &key (acceptor hunchentoot:*acceptor*))
  "Call FUNCTION, without arguments, MILLISECONDS from now, in a worker of
ACCEPTOR (by default the one serving the current request), with no thread
waiting meanwhile: FUNCTION must not wait either (complete a reply, send
an event).  An error escaping it is logged.  Returns a timer for
CANCEL-CALL.  Timers pending at STOP are dropped."
  (check-type milliseconds (real 0))
  (schedule-timer (acceptor-timers acceptor) milliseconds function))

(defun cancel-call (timer)
  "Make the call TIMER stands for (CALL-AFTER) not happen, unless it has begun."
  (cancel-timer timer))
