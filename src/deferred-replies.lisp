;;;; Replies that wait without a thread.  A handler defers its reply
;;;; (DEFER-REPLY) and returns: its worker is free, and its connection
;;;; waits in the readiness set (engine/readiness/deferred-reply.lisp) until
;;;; any thread completes the reply (COMPLETE-REPLY), its timeout passes,
;;;; or the client goes.  CALL-AFTER calls a function after some
;;;; milliseconds on the engine's own timer (engine/readiness/timers.lisp),
;;;; without a thread waiting either.

(in-package #:hunchentoot-recycling-taskmaster)

(defun serving-of-waiting-reply (what)
  "The SERVING of the handler calling, whose reply is to be WHAT (\"deferred\",
\"an event stream\"); signals REPLY-NOT-DEFERRABLE outside a handler of a
parallel acceptor's request, in a websocket's or an HTTP/2 stream's, or
once the headers are sent, noted as the serving's refusal when there is one
(REPORT-HANDLER-ERROR logs it as its one line)."
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
            ((null (worker-connection (serving-worker serving)))
             ;; A worker task's: the connection is its holder's.
             (refuse (format nil "it is made ~A in an HTTP/2 stream's handler, which this version answers ~
only when the handler returns." what)))
            ((headers-sent-p)
             (refuse "its headers have been sent."))
            (t serving)))))

(defun defer-reply (&key (timeout 30) (timeout-status 503) on-client-gone)
  "Inside a handler of a PARALLEL-ACCEPTOR's request: make its reply wait
for COMPLETE-REPLY, from any thread, instead of the handler's return value,
which is then ignored; returns the DEFERRED-REPLY.  The handler returns at
once and its worker serves others meanwhile.  A reply not completed within
TIMEOUT seconds is answered TIMEOUT-STATUS (503, or 504) and its
connection closed.  When the client goes first -- it resets the
connection; one that only shuts down its side after the request still
gets the reply -- ON-CLIENT-GONE, if given, is called with the DEFERRED-REPLY, in a worker, with Hunchentoot's
specials bound as in the handler, and REPLY-CLIENT-GONE-P is true from then
on, so that the work behind the reply can stop.  Called again in the same
handler it returns the same DEFERRED-REPLY.  A handler that fails after
deferring is answered as the failure says; its reply can no longer be
completed.  A soft STOP waits for deferred replies as for any request, then
closes what is left.  Signals REPLY-NOT-DEFERRABLE outside such a handler
or once the headers are sent."
  (let ((serving (serving-of-waiting-reply "deferred")))
    (cond ((serving-deferred serving))
          ((serving-event-stream serving)
           (error 'reply-not-deferrable :reason "it is an event stream already."))
          (t (check-type timeout (real (0)))
             (check-type timeout-status (integer 400 599))
             (setf (serving-deferred serving)
                   (make-deferred-reply (serving-set serving) (worker-connection (serving-worker serving))
                                        hunchentoot:*acceptor* hunchentoot:*request* hunchentoot:*reply*
                                        hunchentoot:*session* timeout timeout-status on-client-gone))))))

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
        ;; See "Who arms it" in deferred-reply.lisp.  A worker calling
        ;; the timers serves the connection itself once they are called.
        (when (take-parked-connection connection)
          (let ((serving *serving*))
            (cond ((and serving (listp (serving-completed serving)) (eq (serving-set serving) set))
                   (push connection (serving-completed serving)))
                  ((not (park-for-completed-reply set connection))
                   (close-connection set connection))))))
      t)))

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
